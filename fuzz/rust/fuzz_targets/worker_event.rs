//! Fuzz target: one line of worker stdout through `worker::events::parse_event`.
//!
//! The run-manager reads these lines from a child it does not trust (user data,
//! tokenizers and chat templates run in it), so the property is more than "no
//! panic": whatever is accepted must already satisfy the documented limits
//! (`docs/worker-events.md`), because nothing downstream checks them again.
#![no_main]

use libfuzzer_sys::fuzz_target;
use run_manager::worker::events::{
    parse_event, WorkerEvent, ARTIFACT_KINDS, MAX_MESSAGE_CHARS, MAX_METRICS, MAX_METRIC_NAME,
    PHASES,
};

fuzz_target!(|data: &[u8]| {
    // The reader hands parse_event each line decoded lossily (read_bounded_line).
    let line = String::from_utf8_lossy(data);
    match parse_event(&line) {
        Err(_) => {}
        Ok(WorkerEvent::Progress(p)) => {
            assert!(PHASES.contains(&p.phase.as_str()), "phase {:?}", p.phase);
            assert!(p.metrics.len() <= MAX_METRICS);
            for (k, v) in &p.metrics {
                assert!(!k.is_empty() && k.len() <= MAX_METRIC_NAME, "metric {k:?}");
                assert!(v.is_finite(), "metric {k:?} = {v}");
            }
        }
        Ok(WorkerEvent::Artifact(a)) => {
            assert!(
                ARTIFACT_KINDS.contains(&a.kind.as_str()),
                "kind {:?}",
                a.kind
            );
            assert_eq!(a.sha256.len(), 64);
            assert!(a
                .sha256
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
            assert!(run_manager::paths::check_artifact_name(&a.name).is_ok());
            assert!(!a.path.is_empty() && !a.path.contains('\0'));
        }
        Ok(WorkerEvent::Error { message, .. }) => {
            assert!(message.chars().count() <= MAX_MESSAGE_CHARS + 3);
        }
        Ok(WorkerEvent::Done | WorkerEvent::Stopped { .. }) => {}
    }
});
