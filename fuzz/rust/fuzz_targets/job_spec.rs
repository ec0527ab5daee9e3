//! Fuzz target: the two spec parsers, on the same bytes.
//!
//! - `worker::jobdir::parse_spec`: a lease's `spec_json` from the coordinator. Accepted
//!   means a JSON object, and the run-manager writes it back into `spec.json`
//!   (`JobSpecFile::write`), so the value must survive serialization unchanged.
//! - `commands::local::submit::RunSpecFile::parse`: the `--spec` file of `--local`.
//!   Accepted means it can be turned into a `RunSpec` whose `spec_json`
//!   `parse_spec` accepts again.
#![no_main]

use libfuzzer_sys::fuzz_target;
use run_manager::commands::local::submit::RunSpecFile;
use run_manager::worker::jobdir::parse_spec;

fuzz_target!(|data: &[u8]| {
    // Both readers take `&str`: a lease field is a proto string, the spec file
    // goes through `read_to_string`; invalid UTF-8 never reaches them.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(v) = parse_spec(text) {
        assert!(v.is_object());
        let written = serde_json::to_string_pretty(&v).expect("an accepted spec serializes");
        assert_eq!(
            parse_spec(&written).as_ref(),
            Ok(&v),
            "spec changed on the way to spec.json"
        );
    }
    if let Ok(s) = RunSpecFile::parse(text) {
        assert!(!(s.spec.is_some() && s.spec_json.is_some()));
        let run = s
            .to_run_spec()
            .expect("an accepted spec file makes a RunSpec");
        assert!(
            parse_spec(&run.spec_json).is_ok(),
            "RunSpec.spec_json refused: {:?}",
            run.spec_json
        );
    }
});
