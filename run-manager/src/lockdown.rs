//! Least privilege against a compromised worker: what the run-manager does to
//! itself at start, before it has any thread or child.
//!
//! A worker parses untrusted data (corpora, tokenizers, checkpoints) and, in
//! native launch mode, runs as this process's user. Any process can read this
//! process's `/proc/PID/cmdline`, and one of the same user its
//! `/proc/PID/environ`, `mem` and `fd/` while it is dumpable. Those files show
//! the original argument and environment blocks, which
//! `std::env::remove_var` does not touch. So [`lock_down`]:
//!
//! - reads `DFLASH_PROVIDER_TOKEN` into memory ([`Cli::env_token`]; clap has
//!   read the flags already);
//! - on Linux overwrites with NUL bytes, in those original blocks, the values
//!   of the run-manager's credentials ([`crate::worker::environment::CREDENTIALS`]: the
//!   tokens, and the paths of the token and TLS key files) and of every other
//!   variable that looks like a secret ([`crate::worker::environment::is_secret`]), and
//!   the values of `--token`, `--token-file` and `--client-key` ([`SECRET_FLAGS`]);
//! - removes the credentials from the live environment, so no child (the
//!   docker CLI, the `--local` coordinator) inherits them; the other secrets are
//!   put back into the live environment (a copy on the heap), since `docker
//!   pull`'s credential helpers may need them;
//! - on Linux makes the process non-dumpable (`PR_SET_DUMPABLE` 0): no core
//!   dump, and a process of the same user without `CAP_SYS_PTRACE` can no
//!   longer read its environment, memory or open files, or attach to it.
//!
//! What it cannot prevent: a worker of the same user reading the token file
//! itself once it learns the path (a conventional location, a shell history):
//! run the worker as another user, or in Docker mode. A root worker reads
//! anything. On macOS only the live environment is cleaned.

use std::ffi::{OsStr, OsString};
use std::ops::Range;

use crate::cli::Cli;
use crate::env_vars;
use crate::worker::environment;

/// Flags whose values are credentials or name the files holding them.
pub const SECRET_FLAGS: &[&str] = &["--token", "--token-file", "--client-key"];

/// What [`lock_down`] did, for the log (values never appear in it).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Environment variables whose values were overwritten in the original block.
    pub env_scrubbed: Vec<String>,
    /// Flags whose values were overwritten in the original argument block.
    pub args_scrubbed: Vec<String>,
    /// Whether the process is now non-dumpable (always false off Linux).
    pub non_dumpable: bool,
    /// What could not be done, one line each.
    pub failures: Vec<String>,
}

/// Read the environment's token into `cli`, scrub the credentials and make
/// the process non-dumpable. Call it once, first thing in `main`, before any
/// thread starts (it changes the environment) or any child is spawned.
pub fn lock_down(cli: &mut Cli) -> Report {
    cli.env_token = std::env::var(env_vars::PROVIDER_TOKEN).ok();
    let mut report = Report::default();
    // The other secrets' values, copied before their bytes are overwritten.
    let kept: Vec<(OsString, OsString)> = std::env::vars_os()
        .filter(|(k, _)| environment::is_secret(k) && !is_credential(k))
        .collect();
    platform::scrub_blocks(&mut report);
    for name in environment::CREDENTIALS {
        std::env::remove_var(name);
    }
    for (k, v) in kept {
        std::env::set_var(k, v);
    }
    platform::set_non_dumpable(&mut report);
    report
}

/// Log what [`lock_down`] did (call once logging is set up).
pub fn log(report: &Report) {
    for f in &report.failures {
        tracing::warn!("{f}");
    }
    tracing::debug!(
        env = ?report.env_scrubbed,
        args = ?report.args_scrubbed,
        non_dumpable = report.non_dumpable,
        "credentials scrubbed from this process's original environment and command line"
    );
}

fn is_credential(name: &OsStr) -> bool {
    name.to_str()
        .is_some_and(|n| environment::CREDENTIALS.contains(&n))
}

/// The NUL-terminated entries of a block (`/proc/PID/environ` or `cmdline`
/// bytes), as ranges into it, without their terminators.
fn entries(block: &[u8]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, b) in block.iter().enumerate() {
        if *b == 0 {
            out.push(start..i);
            start = i + 1;
        }
    }
    if start < block.len() {
        out.push(start..block.len());
    }
    out
}

/// In an environment block, the value bytes of every `NAME=value` entry whose
/// name `secret` picks, with the names picked (in block order, once each).
pub fn env_spans(
    block: &[u8],
    secret: impl Fn(&OsStr) -> bool,
) -> (Vec<Range<usize>>, Vec<String>) {
    use std::os::unix::ffi::OsStrExt;
    let mut spans = Vec::new();
    let mut names = Vec::new();
    for e in entries(block) {
        let entry = &block[e.clone()];
        let Some(eq) = entry.iter().position(|b| *b == b'=') else {
            continue;
        };
        let name = OsStr::from_bytes(&entry[..eq]);
        if secret(name) && eq + 1 < entry.len() {
            spans.push(e.start + eq + 1..e.end);
            let shown = name.to_string_lossy().into_owned();
            if !names.contains(&shown) {
                names.push(shown);
            }
        }
    }
    (spans, names)
}

/// In an argument block, the value bytes of every flag in `flags`, given as
/// `--flag VALUE` or `--flag=VALUE`, with the flags found. Stops at `--`.
pub fn arg_spans(block: &[u8], flags: &[&str]) -> (Vec<Range<usize>>, Vec<String>) {
    let mut spans = Vec::new();
    let mut found = Vec::new();
    let all = entries(block);
    // The program name is not a flag.
    let mut i = 1;
    while i < all.len() {
        let arg = &block[all[i].clone()];
        if arg == b"--" {
            break;
        }
        for flag in flags {
            let f = flag.as_bytes();
            let span = if arg == f {
                all.get(i + 1).cloned()
            } else if arg.len() > f.len() && arg.starts_with(f) && arg[f.len()] == b'=' {
                Some(all[i].start + f.len() + 1..all[i].end)
            } else {
                None
            };
            if let Some(span) = span {
                if arg == f {
                    // The value is the next argument: skip it.
                    i += 1;
                }
                if !span.is_empty() {
                    spans.push(span);
                }
                if !found.iter().any(|x| x == flag) {
                    found.push((*flag).to_string());
                }
                break;
            }
        }
        i += 1;
    }
    (spans, found)
}

#[cfg(target_os = "linux")]
mod platform {
    use std::ops::Range;

    use super::{arg_spans, env_spans, Report, SECRET_FLAGS};
    use crate::worker::environment;

    /// `arg_start`, `arg_end`, `env_start`, `env_end` of `/proc/self/stat`
    /// (fields 48 to 51, Linux 3.5+): the blocks `cmdline` and `environ` show.
    pub(super) fn block_bounds(stat: &str) -> Option<[usize; 4]> {
        // The command name (field 2) may hold spaces and parentheses: count from the last `)`.
        let rest = &stat[stat.rfind(')')? + 1..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        // `fields[0]` is field 3 (the state).
        let get = |n: usize| fields.get(n - 3)?.parse::<usize>().ok();
        let b = [get(48)?, get(49)?, get(50)?, get(51)?];
        (b[0] != 0 && b[0] <= b[1] && b[2] <= b[3]).then_some(b)
    }

    /// This process's bytes `range` (a block of [`block_bounds`]).
    fn read(range: &Range<usize>) -> Vec<u8> {
        let mut out = vec![0u8; range.len()];
        // SAFETY: the range is this process's initial argument or environment
        // strings, on its stack and mapped for its whole life (the kernel's
        // `mm->arg_start..env_end`); nothing else runs yet to change them.
        unsafe {
            std::ptr::copy_nonoverlapping(range.start as *const u8, out.as_mut_ptr(), out.len());
        }
        out
    }

    /// Overwrite this process's bytes `base + span` with NUL.
    fn blank(base: usize, spans: &[Range<usize>]) {
        for span in spans {
            for addr in span.start + base..span.end + base {
                // SAFETY: as in `read`, and the stack is writable; Rust holds no
                // reference into these strings (std and libc keep raw `argv` /
                // `environ` pointers, which still point at NUL-terminated strings).
                unsafe { std::ptr::write_volatile(addr as *mut u8, 0) };
            }
        }
    }

    pub(super) fn scrub_blocks(report: &mut Report) {
        let bounds = match std::fs::read_to_string("/proc/self/stat") {
            Ok(stat) => block_bounds(&stat),
            Err(e) => {
                report.failures.push(format!(
                    "cannot read `/proc/self/stat` ({e}): the credentials stay in this process's original environment and command line"
                ));
                return;
            }
        };
        let Some([arg_start, arg_end, env_start, env_end]) = bounds else {
            report.failures.push("`/proc/self/stat` shows no argument and environment blocks: the credentials stay in them".into());
            return;
        };
        let (spans, names) = env_spans(&read(&(env_start..env_end)), environment::is_secret);
        blank(env_start, &spans);
        report.env_scrubbed = names;
        let (spans, flags) = arg_spans(&read(&(arg_start..arg_end)), SECRET_FLAGS);
        blank(arg_start, &spans);
        report.args_scrubbed = flags;
    }

    pub(super) fn set_non_dumpable(report: &mut Report) {
        // SAFETY: prctl with integer arguments only.
        let rc = unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            report.failures.push(format!(
                "cannot make this process non-dumpable ({e}): a worker of the same user can read its memory"
            ));
        }
        report.non_dumpable = dumpable() == Some(false);
    }

    /// `PR_GET_DUMPABLE` of this process (`None`: the call failed).
    pub fn dumpable() -> Option<bool> {
        // SAFETY: prctl with integer arguments only.
        let rc = unsafe { libc::prctl(libc::PR_GET_DUMPABLE, 0, 0, 0, 0) };
        (rc >= 0).then_some(rc != 0)
    }
}

#[cfg(not(target_os = "linux"))]
mod platform {
    use super::Report;

    pub(super) fn scrub_blocks(_: &mut Report) {}

    pub(super) fn set_non_dumpable(_: &mut Report) {}
}

#[cfg(target_os = "linux")]
pub use platform::dumpable;

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn blanked(block: &[u8], spans: &[Range<usize>]) -> Vec<u8> {
        let mut b = block.to_vec();
        for s in spans {
            b[s.clone()].fill(0);
        }
        b
    }

    #[test]
    fn env_values_of_secrets_are_found_and_nothing_else() {
        let block = b"PATH=/bin\0DFLASH_PROVIDER_TOKEN=tok-s3cret\0HOME=/h\0AWS_SECRET_ACCESS_KEY=aws-s3cret\0DFLASH_PROVIDER_TOKEN_FILE=/etc/t\0EMPTY_TOKEN=\0NOEQ\0DFLASH_PROVIDER_TOKEN=again-s3cret\0";
        let (spans, names) = env_spans(block, environment::is_secret);
        assert_eq!(
            names,
            [
                "DFLASH_PROVIDER_TOKEN",
                "AWS_SECRET_ACCESS_KEY",
                "DFLASH_PROVIDER_TOKEN_FILE",
            ]
        );
        let out = blanked(block, &spans);
        assert_eq!(out.len(), block.len());
        let text = String::from_utf8_lossy(&out);
        assert!(
            !text.contains("s3cret") && !text.contains("/etc/t"),
            "{text:?}"
        );
        // Names, the other variables and every terminator stay where they were.
        for kept in [
            "PATH=/bin\0",
            "\0HOME=/h\0",
            "DFLASH_PROVIDER_TOKEN=\0",
            "NOEQ\0",
        ] {
            assert!(text.contains(kept), "{kept:?} in {text:?}");
        }
        assert_eq!(
            out.iter().filter(|b| **b == 0).count() - spans.iter().map(|s| s.len()).sum::<usize>(),
            block.iter().filter(|b| **b == 0).count()
        );
    }

    #[test]
    fn flag_values_in_both_spellings_are_found() {
        let block = b"run-manager\0--token\0-tok-s3cret\0--work-dir\0/w\0--token-file=/etc/t\0--client-key\0/k.pem\0--tokenish\0x\0--\0--token\0positional\0";
        let (spans, flags) = arg_spans(block, SECRET_FLAGS);
        assert_eq!(flags, ["--token", "--token-file", "--client-key"]);
        let out = blanked(block, &spans);
        let text = String::from_utf8_lossy(&out);
        assert!(
            !text.contains("s3cret") && !text.contains("/etc/t") && !text.contains("/k.pem"),
            "{text:?}"
        );
        for kept in [
            "--work-dir\0/w\0",
            "--token-file=\0",
            "--tokenish\0x\0",
            "--\0--token\0positional\0",
        ] {
            assert!(text.contains(kept), "{kept:?} in {text:?}");
        }
        // A flag as the last argument (clap refuses it) or an unterminated block.
        assert_eq!(arg_spans(b"rm\0--token\0", SECRET_FLAGS).0, []);
        let (spans, _) = arg_spans(b"rm\0--token=abc", SECRET_FLAGS);
        assert_eq!(spans.len(), 1);
        assert_eq!(spans[0], 11..14);
        // The program name is never taken for a flag.
        assert_eq!(arg_spans(b"--token\0abc\0", SECRET_FLAGS).0, []);
    }

    #[test]
    fn the_secret_flags_are_the_cli_s() {
        let cmd = Cli::command();
        for flag in SECRET_FLAGS {
            let long = flag.trim_start_matches("--");
            let arg = cmd
                .get_arguments()
                .find(|a| a.get_long() == Some(long))
                .unwrap_or_else(|| panic!("{flag} is not a flag"));
            assert!(
                arg.get_short().is_none() && arg.get_aliases().is_none(),
                "{flag}"
            );
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn stat_fields_48_to_51_are_the_blocks() {
        let mut fields: Vec<String> = (3..=52).map(|n| n.to_string()).collect();
        fields[48 - 3] = "100".into();
        fields[49 - 3] = "200".into();
        fields[50 - 3] = "200".into();
        fields[51 - 3] = "300".into();
        let stat = format!("42 (a (b) c) {}", fields.join(" "));
        assert_eq!(platform::block_bounds(&stat), Some([100, 200, 200, 300]));
        assert_eq!(platform::block_bounds("42 (x) R 1 2"), None);
        let own = std::fs::read_to_string("/proc/self/stat").expect("stat");
        let [a0, a1, e0, e1] = platform::block_bounds(&own).expect("own blocks");
        let cmdline = std::fs::read("/proc/self/cmdline").expect("cmdline");
        let environ = std::fs::read("/proc/self/environ").expect("environ");
        assert_eq!((a1 - a0, e1 - e0), (cmdline.len(), environ.len()));
    }

    /// Makes this test process non-dumpable: harmless to the other tests.
    #[cfg(target_os = "linux")]
    #[test]
    fn set_non_dumpable_clears_pr_get_dumpable() {
        let mut report = Report::default();
        platform::set_non_dumpable(&mut report);
        assert_eq!(dumpable(), Some(false));
        assert!(
            report.non_dumpable && report.failures.is_empty(),
            "{report:?}"
        );
    }
}
