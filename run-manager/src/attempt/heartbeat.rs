//! The Heartbeat stream of one attempt: the latest worker progress goes to the
//! coordinator (renewing the lease, and the attempt's [`LeaseClock`]), its
//! directives come back as [`Signal`]s.
//!
//! One task per attempt keeps one stream open: it sends the latest progress
//! every `interval` and soon after it changes (at most once per
//! `min(interval, 1 s)`), forwards CANCEL / CHECKPOINT_NOW, reports a lost
//! lease (ABORTED: stale; UNAUTHENTICATED / PERMISSION_DENIED: this provider's
//! token is refused, see `crate::lease_lost`) and ends, and reopens the stream
//! with backoff when it breaks for any other reason. It ends when the progress
//! sender is dropped.

use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

use crate::artifacts::transfer::LeaseClock;
use crate::backoff::Backoff;
use crate::coordinator::client::ProviderClient;
use crate::lease_lost::LeaseLost;
use crate::proto::{Directive, HeartbeatRequest, HeartbeatResponse, Phase};
use crate::signal::Signal;
use crate::worker::events::Progress;

/// Map a worker phase name to the proto enum.
pub fn phase_from_name(name: &str) -> Phase {
    match name {
        "starting" => Phase::Starting,
        "prepare" => Phase::Prepare,
        "check" => Phase::Check,
        "capture" => Phase::Capture,
        "train" => Phase::Train,
        "export" => Phase::Export,
        "evaluate" => Phase::Evaluate,
        "finishing" => Phase::Finishing,
        _ => Phase::Unspecified,
    }
}

/// Copy a progress event into the next heartbeat; an absent `committed_step`
/// keeps the last one.
pub fn apply_progress(req: &mut HeartbeatRequest, p: &Progress) {
    req.phase = phase_from_name(&p.phase) as i32;
    req.step = p.step;
    req.total_steps = p.total_steps;
    req.metrics = p.metrics.iter().map(|(k, v)| (k.clone(), *v)).collect();
    if let Some(c) = p.committed_step {
        req.committed_step = c;
    }
}

/// How one stream ended.
enum StreamEnd {
    /// The attempt is over (progress sender dropped, lease lost, supervisor gone).
    Done,
    /// Open another stream after the backoff.
    Reopen,
}

/// The heartbeat task's state across streams.
struct Heartbeats {
    client: ProviderClient,
    progress: watch::Receiver<HeartbeatRequest>,
    out: mpsc::Sender<Signal>,
    interval: Duration,
    clock: LeaseClock,
    /// Consecutive failed streams (reset by any response).
    failures: u32,
}

/// How often and with what backoff heartbeats go, and the clock they renew.
pub struct Pace {
    pub interval: Duration,
    pub backoff: Backoff,
    pub clock: LeaseClock,
}

/// Run the heartbeat task of one attempt (see the module docs).
pub async fn heartbeat_task(
    client: ProviderClient,
    progress: watch::Receiver<HeartbeatRequest>,
    out: mpsc::Sender<Signal>,
    pace: Pace,
) {
    let Pace {
        interval,
        backoff,
        clock,
    } = pace;
    let mut hb = Heartbeats {
        client,
        progress,
        out,
        interval,
        clock,
        failures: 0,
    };
    loop {
        if let StreamEnd::Done = hb.stream().await {
            return;
        }
        let delay = backoff.delay(hb.failures.saturating_sub(1));
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            changed = hb.progress.changed() => if changed.is_err() { return; }
        }
    }
}

impl Heartbeats {
    /// Open one stream (its first message is the latest progress) and pump it.
    async fn stream(&mut self) -> StreamEnd {
        let (tx, rx) = mpsc::channel::<HeartbeatRequest>(8);
        let first = self.progress.borrow_and_update().clone();
        if tx.send(first).await.is_err() {
            return StreamEnd::Done;
        }
        let last_sent = Instant::now();
        match self
            .client
            .heartbeat(tonic::Request::new(ReceiverStream::new(rx)))
            .await
        {
            Err(status) => self.failed(status, "heartbeat stream failed to open").await,
            Ok(resp) => self.pump(tx, resp.into_inner(), last_sent).await,
        }
    }

    /// A broken or refused stream: a lost lease (ABORTED, or the token
    /// refused when the stream reopens) ends the task, anything else reopens.
    async fn failed(&mut self, status: tonic::Status, what: &str) -> StreamEnd {
        if let Some(lost) = LeaseLost::of("Heartbeat", &status) {
            let _ = self.out.send(Signal::Lost(lost)).await;
            return StreamEnd::Done;
        }
        tracing::warn!(code = ?status.code(), "{what}: {}", status.message());
        self.failures += 1;
        StreamEnd::Reopen
    }

    /// Send progress on the tick and on change, forward the directives that come back.
    async fn pump(
        &mut self,
        tx: mpsc::Sender<HeartbeatRequest>,
        mut inbound: tonic::Streaming<HeartbeatResponse>,
        mut last_sent: Instant,
    ) -> StreamEnd {
        let min_gap = self.interval.min(Duration::from_secs(1));
        let mut ticker = tokio::time::interval(self.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await;
        // A progress change inside `min_gap` of the last send is sent when the gap ends.
        let mut pending = false;
        loop {
            let flush_at = tokio::time::Instant::from_std(last_sent + min_gap);
            let send_now = tokio::select! {
                _ = ticker.tick() => true,
                changed = self.progress.changed() => {
                    if changed.is_err() { return StreamEnd::Done; }
                    self.progress.borrow_and_update();
                    pending = true;
                    last_sent.elapsed() >= min_gap
                }
                _ = tokio::time::sleep_until(flush_at), if pending => true,
                msg = inbound.message() => match msg {
                    Ok(Some(resp)) => {
                        self.failures = 0;
                        self.clock.renewed();
                        if !self.forward(resp.directive).await { return StreamEnd::Done; }
                        false
                    }
                    Ok(None) => {
                        tracing::debug!("coordinator closed the heartbeat stream; reopening");
                        return StreamEnd::Reopen;
                    }
                    Err(status) => return self.failed(status, "heartbeat stream broke").await,
                }
            };
            if send_now {
                let req = self.progress.borrow().clone();
                if tx.send(req).await.is_err() {
                    return StreamEnd::Reopen;
                }
                last_sent = Instant::now();
                pending = false;
            }
        }
    }

    /// Pass a CANCEL / CHECKPOINT_NOW on; false when the supervisor is gone.
    async fn forward(&self, directive: i32) -> bool {
        let signal = match Directive::try_from(directive) {
            Ok(Directive::Cancel) => Signal::Cancel,
            Ok(Directive::CheckpointNow) => Signal::CheckpointNow,
            _ => return true,
        };
        self.out.send(signal).await.is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_map_to_proto() {
        for (i, name) in crate::worker::events::PHASES.iter().enumerate() {
            assert_eq!(phase_from_name(name) as i32, i as i32 + 1, "{name}");
        }
        assert_eq!(phase_from_name("nap"), Phase::Unspecified);
    }

    #[test]
    fn progress_updates_heartbeat_but_keeps_committed_step_when_absent() {
        let mut req = HeartbeatRequest {
            committed_step: 4,
            ..Default::default()
        };
        let mut p = Progress {
            phase: "train".into(),
            step: 7,
            total_steps: 10,
            ..Default::default()
        };
        p.metrics.insert("loss".into(), 1.5);
        apply_progress(&mut req, &p);
        assert_eq!(
            (req.phase, req.step, req.total_steps, req.committed_step),
            (Phase::Train as i32, 7, 10, 4)
        );
        assert_eq!(req.metrics.get("loss"), Some(&1.5));
        p.committed_step = Some(6);
        apply_progress(&mut req, &p);
        assert_eq!(req.committed_step, 6);
    }
}
