//! The worker -> run-manager event protocol (JSON lines on the worker's stdout)
//! and a line reader that cannot be made to allocate without bound.
//!
//! One JSON object per line, discriminated by `"event"`:
//!
//! ```json
//! {"event": "progress", "phase": "train", "step": 3, "total_steps": 10,
//!  "metrics": {"loss": 2.5}, "committed_step": 2}
//! {"event": "artifact", "name": "checkpoints/step-00000002", "kind": "checkpoint",
//!  "path": "run/checkpoints/step-00000002/manifest.json", "sha256": "<64 hex>",
//!  "size_bytes": 1234, "step": 2}
//! {"event": "done"}
//! {"event": "error", "message": "bad recipe: ...", "retryable": false}
//! {"event": "stopped", "committed_step": 4}
//! ```
//!
//! - `progress`: `phase` is one of `starting prepare check capture train
//!   export evaluate finishing`; `step`/`total_steps` count optimizer steps in
//!   `train`, items elsewhere; `metrics` maps names to finite numbers (at most
//!   [`MAX_METRICS`]); `committed_step` is the step of the last checkpoint that
//!   was committed (0 or absent when none). All but `phase` are optional.
//! - `artifact`: a file the worker finished writing. `path` is absolute or
//!   relative to the job directory and must resolve inside it; `name` is the
//!   artifact's relative name in the job's namespace; `kind` is one of
//!   `checkpoint export manifest report metrics capture data`; `sha256`/`size_bytes`
//!   are checked against the file before it is reported. A `checkpoint`
//!   artifact is one file per committed checkpoint, its `manifest.json`: the
//!   last one is what a restarted worker resumes from (`resume_checkpoint`).
//! - `done`: the job finished; the worker then exits 0.
//! - `error`: the job failed; `retryable: false` means another attempt would
//!   fail the same way (bad spec, bad data), so the worker is not restarted.
//! - `stopped`: the worker got SIGTERM, committed a checkpoint at
//!   `committed_step` and exits 0 without finishing the job.
//!
//! Lines that are not JSON objects, longer than [`MAX_LINE_BYTES`], name an
//! unknown event or carry fields of the wrong type are logged and ignored:
//! they never stop the run-manager. `docs/worker-events.md` is the same
//! contract for worker authors.

use std::collections::BTreeMap;

use serde::Deserialize;
use tokio::io::{AsyncBufRead, AsyncBufReadExt};

/// Longest line accepted from a worker; longer lines are skipped whole.
pub const MAX_LINE_BYTES: usize = 1 << 20;
/// Most metrics kept from one progress event.
pub const MAX_METRICS: usize = 64;
/// Longest metric name kept.
pub const MAX_METRIC_NAME: usize = 64;
/// Longest error message kept from an `error` event.
pub const MAX_MESSAGE_CHARS: usize = 4096;

/// Artifact kinds the coordinator accepts.
/// (`data`: the split files a graph run's `prepare` job writes, which its
/// `capture` jobs download as their inputs.)
pub const ARTIFACT_KINDS: [&str; 7] = [
    "checkpoint",
    "export",
    "manifest",
    "report",
    "metrics",
    "capture",
    "data",
];
/// Phases a progress event may name (the proto's `Phase`, lowercase).
pub const PHASES: [&str; 8] = [
    "starting",
    "prepare",
    "check",
    "capture",
    "train",
    "export",
    "evaluate",
    "finishing",
];

/// One event from the worker.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkerEvent {
    Progress(Progress),
    Artifact(ArtifactEvent),
    Done,
    Error { message: String, retryable: bool },
    Stopped { committed_step: Option<u64> },
}

/// Payload of a `progress` event.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Progress {
    pub phase: String,
    pub step: u64,
    pub total_steps: u64,
    pub metrics: BTreeMap<String, f64>,
    pub committed_step: Option<u64>,
}

/// Payload of an `artifact` event.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArtifactEvent {
    pub name: String,
    pub kind: String,
    pub path: String,
    pub sha256: String,
    pub size_bytes: u64,
    #[serde(default)]
    pub step: u64,
}

#[derive(Deserialize)]
struct RawProgress {
    phase: String,
    #[serde(default)]
    step: u64,
    #[serde(default)]
    total_steps: u64,
    #[serde(default)]
    metrics: BTreeMap<String, serde_json::Value>,
    #[serde(default)]
    committed_step: Option<u64>,
}

#[derive(Deserialize)]
struct RawError {
    message: String,
    #[serde(default)]
    retryable: bool,
}

/// Why a line was not an event. Every variant is logged and the line skipped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventError {
    #[error("line is not JSON: {0}")]
    NotJson(String),
    #[error("line is JSON but not an object with a string `event` field")]
    NoEventField,
    #[error("unknown event `{0}`")]
    Unknown(String),
    #[error("bad `{event}` event: {message}")]
    Invalid { event: String, message: String },
}

fn invalid(event: &str, message: impl Into<String>) -> EventError {
    EventError::Invalid {
        event: event.to_string(),
        message: message.into(),
    }
}

fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(max).collect();
        t.push_str("...");
        t
    }
}

/// Parse one line of worker stdout.
pub fn parse_event(line: &str) -> Result<WorkerEvent, EventError> {
    let value: serde_json::Value = serde_json::from_str(line)
        .map_err(|e| EventError::NotJson(truncate(&e.to_string(), 200)))?;
    let event = value
        .get("event")
        .and_then(|v| v.as_str())
        .ok_or(EventError::NoEventField)?
        .to_string();
    let mut fields = value;
    if let Some(obj) = fields.as_object_mut() {
        obj.remove("event");
    }
    match event.as_str() {
        "progress" => parse_progress(fields),
        "artifact" => parse_artifact(fields),
        "done" => Ok(WorkerEvent::Done),
        "stopped" => {
            let committed_step = match fields.get("committed_step") {
                None | Some(serde_json::Value::Null) => None,
                Some(v) => Some(v.as_u64().ok_or_else(|| {
                    invalid(&event, "`committed_step` must be a non-negative integer")
                })?),
            };
            Ok(WorkerEvent::Stopped { committed_step })
        }
        "error" => {
            let raw: RawError =
                serde_json::from_value(fields).map_err(|e| invalid(&event, e.to_string()))?;
            Ok(WorkerEvent::Error {
                message: truncate(&raw.message, MAX_MESSAGE_CHARS),
                retryable: raw.retryable,
            })
        }
        other => Err(EventError::Unknown(truncate(other, 40))),
    }
}

/// A `progress` event: a known phase; metrics sanitized (see [`MAX_METRICS`]).
fn parse_progress(fields: serde_json::Value) -> Result<WorkerEvent, EventError> {
    let event = "progress";
    let raw: RawProgress =
        serde_json::from_value(fields).map_err(|e| invalid(event, e.to_string()))?;
    if !PHASES.contains(&raw.phase.as_str()) {
        return Err(invalid(
            event,
            format!("unknown phase `{}`", truncate(&raw.phase, 40)),
        ));
    }
    let mut metrics = BTreeMap::new();
    for (k, v) in raw.metrics {
        if metrics.len() >= MAX_METRICS {
            break;
        }
        // Non-numeric, non-finite and over-long names are dropped, not fatal:
        // a metric is advisory, the step count is what matters.
        if k.is_empty() || k.len() > MAX_METRIC_NAME {
            continue;
        }
        if let Some(x) = v.as_f64().filter(|x| x.is_finite()) {
            metrics.insert(k, x);
        }
    }
    Ok(WorkerEvent::Progress(Progress {
        phase: raw.phase,
        step: raw.step,
        total_steps: raw.total_steps,
        metrics,
        committed_step: raw.committed_step,
    }))
}

/// An `artifact` event: a known kind, a hex sha256, a valid name and a path.
fn parse_artifact(fields: serde_json::Value) -> Result<WorkerEvent, EventError> {
    let event = "artifact";
    let a: ArtifactEvent =
        serde_json::from_value(fields).map_err(|e| invalid(event, e.to_string()))?;
    if !ARTIFACT_KINDS.contains(&a.kind.as_str()) {
        return Err(invalid(
            event,
            format!("unknown kind `{}`", truncate(&a.kind, 40)),
        ));
    }
    let hex = |b: u8| b.is_ascii_digit() || (b'a'..=b'f').contains(&b);
    if a.sha256.len() != 64 || !a.sha256.bytes().all(hex) {
        return Err(invalid(event, "`sha256` must be 64 lowercase hex digits"));
    }
    crate::paths::check_artifact_name(&a.name).map_err(|e| invalid(event, e.to_string()))?;
    if a.path.is_empty() || a.path.contains('\0') {
        return Err(invalid(event, "`path` is empty or contains NUL"));
    }
    Ok(WorkerEvent::Artifact(a))
}

/// A line read by [`read_bounded_line`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Line {
    /// A complete line without its `\n` (and `\r`), decoded lossily as UTF-8.
    Text(String),
    /// A line longer than the limit; its bytes were discarded.
    TooLong(usize),
}

/// Read one line of at most `max` bytes. Longer lines are consumed and
/// dropped without buffering them. `Ok(None)` at end of input.
pub async fn read_bounded_line<R: AsyncBufRead + Unpin>(
    reader: &mut R,
    max: usize,
) -> std::io::Result<Option<Line>> {
    let mut buf: Vec<u8> = Vec::new();
    let mut total = 0usize;
    let mut overflow = false;
    loop {
        let avail = reader.fill_buf().await?;
        if avail.is_empty() {
            if total == 0 {
                return Ok(None);
            }
            break;
        }
        let (take, consume, end) = match avail.iter().position(|&b| b == b'\n') {
            Some(i) => (i, i + 1, true),
            None => (avail.len(), avail.len(), false),
        };
        total = total.saturating_add(take);
        if !overflow {
            if buf.len() + take > max {
                overflow = true;
                buf = Vec::new();
            } else {
                buf.extend_from_slice(&avail[..take]);
            }
        }
        reader.consume(consume);
        if end {
            break;
        }
    }
    if overflow {
        return Ok(Some(Line::TooLong(total)));
    }
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    Ok(Some(Line::Text(String::from_utf8_lossy(&buf).into_owned())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_event() {
        let p = parse_event(
            r#"{"event":"progress","phase":"train","step":3,"total_steps":10,"metrics":{"loss":2.5,"lr":0.001},"committed_step":2}"#,
        )
        .expect("progress");
        let WorkerEvent::Progress(p) = p else {
            panic!("not progress")
        };
        assert_eq!(
            (p.phase.as_str(), p.step, p.total_steps, p.committed_step),
            ("train", 3, 10, Some(2))
        );
        assert_eq!(p.metrics.get("loss"), Some(&2.5));

        let sha = "a".repeat(64);
        let a = parse_event(&format!(
            r#"{{"event":"artifact","name":"ckpt/step-2","kind":"checkpoint","path":"ckpt/2.bin","sha256":"{sha}","size_bytes":12,"step":2}}"#
        ))
        .expect("artifact");
        let WorkerEvent::Artifact(a) = a else {
            panic!("not artifact")
        };
        assert_eq!(
            (a.name.as_str(), a.kind.as_str(), a.size_bytes, a.step),
            ("ckpt/step-2", "checkpoint", 12, 2)
        );
        // A graph run's prepare job reports its split files as `data`.
        let d = parse_event(&format!(
            r#"{{"event":"artifact","name":"data/train.jsonl","kind":"data","path":"data/train.jsonl","sha256":"{sha}","size_bytes":3}}"#
        ));
        assert!(
            matches!(&d, Ok(WorkerEvent::Artifact(a)) if a.kind == "data"),
            "{d:?}"
        );

        assert_eq!(parse_event(r#"{"event":"done"}"#), Ok(WorkerEvent::Done));
        assert_eq!(
            parse_event(r#"{"event":"stopped","committed_step":4}"#),
            Ok(WorkerEvent::Stopped {
                committed_step: Some(4)
            })
        );
        assert!(parse_event(r#"{"event":"stopped","committed_step":"x"}"#).is_err());
        assert_eq!(
            parse_event(r#"{"event":"error","message":"bad spec","retryable":false}"#),
            Ok(WorkerEvent::Error {
                message: "bad spec".into(),
                retryable: false
            })
        );
    }

    #[test]
    fn hostile_and_corrupt_lines_are_errors_not_panics() {
        let cases = [
            "",
            "not json",
            "{",
            "[]",
            "42",
            "null",
            r#"{"event": 3}"#,
            r#"{"no_event": 1}"#,
            r#"{"event":"progress"}"#,
            r#"{"event":"progress","phase":"train","step":-1}"#,
            r#"{"event":"progress","phase":"train","step":1e400}"#,
            r#"{"event":"progress","phase":"nap","step":1}"#,
            r#"{"event":"artifact","name":"../../etc/passwd","kind":"export","path":"x","sha256":"0000000000000000000000000000000000000000000000000000000000000000","size_bytes":1}"#,
            r#"{"event":"artifact","name":"a","kind":"weird","path":"x","sha256":"0000000000000000000000000000000000000000000000000000000000000000","size_bytes":1}"#,
            r#"{"event":"artifact","name":"a","kind":"export","path":"x","sha256":"ZZ","size_bytes":1}"#,
            r#"{"event":"artifact","name":"a","kind":"export","path":"x","sha256":"0000000000000000000000000000000000000000000000000000000000000000","size_bytes":1,"extra":true}"#,
            r#"{"event":"error"}"#,
            r#"{"event":"launch_missiles"}"#,
            "\u{0}\u{1}\u{2}",
        ];
        for line in cases {
            assert!(parse_event(line).is_err(), "accepted {line:?}");
        }
        assert_eq!(
            parse_event(r#"{"event":"launch_missiles"}"#),
            Err(EventError::Unknown("launch_missiles".into()))
        );
        // Deeply nested JSON is refused by serde_json's recursion limit, not a stack overflow.
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert!(matches!(parse_event(&deep), Err(EventError::NotJson(_))));
    }

    #[test]
    fn metrics_are_sanitized_not_fatal() {
        let mut m = String::from("{");
        for i in 0..200 {
            m.push_str(&format!("\"m{i:03}\":{i},"));
        }
        m.push_str(&format!(
            "\"{}\":1,\"s\":\"str\",\"n\":null}}",
            "k".repeat(100)
        ));
        let line = format!(r#"{{"event":"progress","phase":"capture","metrics":{m}}}"#);
        let WorkerEvent::Progress(p) = parse_event(&line).expect("progress") else {
            panic!()
        };
        assert_eq!(p.metrics.len(), MAX_METRICS);
        assert!(p.metrics.keys().all(|k| k.len() <= MAX_METRIC_NAME));
        assert!(!p.metrics.contains_key("s"));
    }

    #[test]
    fn long_error_messages_are_truncated() {
        let line = format!(
            r#"{{"event":"error","message":"{}","retryable":true}}"#,
            "x".repeat(100_000)
        );
        let WorkerEvent::Error { message, retryable } = parse_event(&line).expect("error") else {
            panic!()
        };
        assert!(retryable);
        assert!(message.len() < MAX_MESSAGE_CHARS + 10);
    }

    #[tokio::test]
    async fn bounded_reader_skips_huge_lines_and_keeps_going() {
        let mut input = Vec::new();
        input.extend_from_slice(b"first\r\n");
        input.extend(std::iter::repeat_n(b'x', 10_000));
        input.extend_from_slice(b"\nlast-no-newline");
        // A tiny internal buffer forces many fill_buf rounds per line.
        let mut r = tokio::io::BufReader::with_capacity(7, &input[..]);
        assert_eq!(
            read_bounded_line(&mut r, 100).await.expect("io"),
            Some(Line::Text("first".into()))
        );
        assert_eq!(
            read_bounded_line(&mut r, 100).await.expect("io"),
            Some(Line::TooLong(10_000))
        );
        assert_eq!(
            read_bounded_line(&mut r, 100).await.expect("io"),
            Some(Line::Text("last-no-newline".into()))
        );
        assert_eq!(read_bounded_line(&mut r, 100).await.expect("io"), None);
    }

    #[tokio::test]
    async fn bounded_reader_replaces_invalid_utf8() {
        let input = b"\xff\xfeok\n".to_vec();
        let mut r = tokio::io::BufReader::new(&input[..]);
        let Some(Line::Text(t)) = read_bounded_line(&mut r, 100).await.expect("io") else {
            panic!()
        };
        assert!(t.ends_with("ok"));
        assert!(parse_event(&t).is_err());
    }
}
