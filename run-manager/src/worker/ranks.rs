//! Several local ranks of one job: N worker processes that form one
//! `torch.distributed` process group, supervised as one worker.
//!
//! Why the run-manager starts the ranks itself rather than running
//! `torchrun`: it already is the supervisor of the worker (signals, log
//! relay, restarts from the last committed checkpoint, the event protocol),
//! and `torchrun`'s elastic agent would be a second one between it and the
//! ranks, with its own restart policy, one merged stdout and no forwarding of
//! SIGUSR1 (CHECKPOINT_NOW). Each rank gets the environment `torchrun` gives
//! its workers (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT`, and `OMP_NUM_THREADS=1` unless the provider
//! set it), so the worker joins with the standard `env://` rendezvous
//! (`dflash_worker.dist`), exactly as under `torchrun` by hand.
//!
//! The group, as the supervisor sees it:
//! - events: rank 0's; another rank's `error` is passed on too (it explains
//!   why that rank is about to exit), anything else from it is dropped with a
//!   warning, since only rank 0 reports progress and artifacts;
//! - logs: every rank's stderr, relayed tagged with its `rank`;
//! - signals (SIGTERM, SIGUSR1, SIGKILL) go to every rank still running;
//! - the first rank that fails (non-zero exit or a signal) takes the others
//!   down at once (SIGKILL: they would only wait in a collective for a peer
//!   that is gone), and the group's exit is that rank's, so the attempt
//!   restarts every rank from the last committed checkpoint;
//! - ranks other than 0 finish once the stages that need them are done
//!   (capture, training) and exit 0 early; rank 0 ends the group: a rank
//!   still running [`LINGER`] after rank 0 exited is killed.

use std::ffi::OsString;
use std::process::ExitStatus;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::env_vars;
use crate::error::{Error, Result};
use crate::worker::events::WorkerEvent;
use crate::worker::process::{self, describe_exit, LogRelay, LogTags, WorkerCommand};

/// How long the other ranks may run on after rank 0 exited.
pub const LINGER: Duration = Duration::from_secs(10);
/// The rendezvous address: every rank is on this machine.
pub const MASTER_ADDR: &str = "127.0.0.1";

/// How one job's ranks are started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankPlan {
    /// Number of local ranks (the lease's `local_ranks`).
    pub world: u32,
    /// CPU ranks (`--cpu-ranks`): the worker is told it may run them (`DFLASH_CPU_RANKS=1`).
    pub cpu: bool,
}

/// The environment variables rank `rank` gets on top of the worker's own.
pub fn rank_env(
    plan: RankPlan,
    rank: u32,
    port: u16,
    base: &[(OsString, OsString)],
) -> Vec<(OsString, OsString)> {
    let world = plan.world.to_string();
    let rank = rank.to_string();
    let mut out: Vec<(OsString, OsString)> = vec![
        (env_vars::RANK.into(), rank.clone().into()),
        (env_vars::LOCAL_RANK.into(), rank.into()),
        (env_vars::WORLD_SIZE.into(), world.clone().into()),
        (env_vars::LOCAL_WORLD_SIZE.into(), world.into()),
        (env_vars::MASTER_ADDR.into(), MASTER_ADDR.into()),
        (env_vars::MASTER_PORT.into(), port.to_string().into()),
    ];
    // As torchrun does: N ranks each using every core would oversubscribe the machine.
    if !base.iter().any(|(k, _)| k == env_vars::OMP_NUM_THREADS) {
        out.push((env_vars::OMP_NUM_THREADS.into(), "1".into()));
    }
    if plan.cpu {
        out.push((env_vars::CPU_RANKS.into(), "1".into()));
    }
    out
}

/// A free TCP port on the loopback interface for rank 0's rendezvous store.
///
/// The port is free when this returns and rank 0 binds it moments later; another
/// process taking it in between makes the start fail like any crash (and retried).
pub fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind((MASTER_ADDR, 0)).map_err(|e| {
        Error::Internal(format!(
            "cannot find a free port for the ranks' rendezvous: {e}"
        ))
    })?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| Error::Internal(format!("cannot read the rendezvous port: {e}")))
}

/// The running ranks of one worker start.
#[derive(Debug)]
pub struct RankGroup {
    pids: Vec<u32>,
    /// (rank, exit) as each rank's process ends.
    exits: mpsc::UnboundedReceiver<(u32, std::io::Result<ExitStatus>)>,
    statuses: Vec<Option<ExitStatus>>,
    /// The first rank that failed, before the run-manager killed anyone.
    first_failure: Option<(u32, ExitStatus)>,
    /// Set once the run-manager killed the remaining ranks: their deaths are its doing.
    reaped: bool,
    /// When the ranks still running after rank 0 exited are killed.
    linger_until: Option<Instant>,
    job_id: String,
}

/// Start `plan.world` ranks of `cmd --job-dir job_dir`, each with `env` plus its
/// [`rank_env`]; the events channel carries what [`RankGroup`] passes on.
pub fn spawn(
    cmd: &WorkerCommand,
    job_dir: &std::path::Path,
    env: Vec<(OsString, OsString)>,
    tags: LogTags,
    plan: RankPlan,
) -> Result<(RankGroup, mpsc::Receiver<WorkerEvent>, LogRelay)> {
    let port = free_port()?;
    let (events_tx, events) = mpsc::channel(256);
    let (exit_tx, exits) = mpsc::unbounded_channel();
    let mut pids = Vec::new();
    let mut relays = Vec::new();
    for rank in 0..plan.world {
        let mut rank_vars = env.clone();
        rank_vars.extend(rank_env(plan, rank, port, &env));
        let tags = LogTags {
            rank,
            ..tags.clone()
        };
        let w = match process::spawn(cmd, job_dir, rank_vars, tags.clone()) {
            Ok(w) => w,
            Err(e) => {
                // The ranks already started would wait for this one forever.
                for &pid in &pids {
                    let _ = process::kill_group(pid);
                }
                return Err(e);
            }
        };
        pids.push(w.pid);
        relays.push(w.logs);
        tokio::spawn(forward_events(rank, w.events, events_tx.clone(), tags));
        let (mut child, tx) = (w.child, exit_tx.clone());
        tokio::spawn(async move {
            let st = child.wait().await;
            let _ = tx.send((rank, st));
        });
    }
    let group = RankGroup {
        statuses: vec![None; pids.len()],
        pids,
        exits,
        first_failure: None,
        reaped: false,
        linger_until: None,
        job_id: tags.job_id,
    };
    Ok((group, events, LogRelay::merge(relays)))
}

/// Pass rank 0's events on, and another rank's `error` events; warn about the rest.
async fn forward_events(
    rank: u32,
    mut from: mpsc::Receiver<WorkerEvent>,
    to: mpsc::Sender<WorkerEvent>,
    t: LogTags,
) {
    while let Some(ev) = from.recv().await {
        let passed = rank == 0 || matches!(ev, WorkerEvent::Error { .. });
        if passed {
            if to.send(ev).await.is_err() {
                break;
            }
        } else {
            tracing::warn!(run_id = %t.run_id, job_id = %t.job_id, rank, "ignored an event from rank {rank}: only rank 0 reports progress and artifacts");
        }
    }
}

impl RankGroup {
    /// Rank 0's process id.
    pub fn pid(&self) -> u32 {
        self.pids[0]
    }

    /// Every rank's process id, in rank order.
    pub fn pids(&self) -> &[u32] {
        &self.pids
    }

    fn running(&self) -> impl Iterator<Item = u32> + '_ {
        self.pids
            .iter()
            .zip(&self.statuses)
            .filter(|(_, st)| st.is_none())
            .map(|(pid, _)| *pid)
    }

    /// Send `sig` to every rank still running.
    pub fn signal(&self, sig: i32) {
        for pid in self.running() {
            let _ = process::signal(pid, sig);
        }
    }

    /// SIGKILL every rank still running (each one's process group).
    pub fn kill(&mut self) {
        self.reaped = true;
        for pid in self.running().collect::<Vec<_>>() {
            let _ = process::kill_group(pid);
        }
    }

    /// Wait until every rank has exited; the group's exit (module docstring).
    /// Cancel-safe: what is known of exits is kept between calls.
    pub async fn wait(&mut self) -> std::io::Result<ExitStatus> {
        loop {
            if let Some(st) = self.outcome() {
                return Ok(st);
            }
            let linger = self.linger_until;
            let linger_over = async move {
                match linger {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                got = self.exits.recv() => match got {
                    Some((rank, st)) => self.on_exit(rank, st?),
                    None => return Err(std::io::Error::other("lost track of the ranks' processes")),
                },
                _ = linger_over => {
                    let left: Vec<u32> = (0..self.pids.len() as u32).filter(|r| self.statuses[*r as usize].is_none()).collect();
                    tracing::warn!(job_id = %self.job_id, ?left, "rank(s) {left:?} still running {}s after rank 0 exited: killing them", LINGER.as_secs());
                    self.linger_until = None;
                    self.kill();
                }
            }
        }
    }

    fn on_exit(&mut self, rank: u32, st: ExitStatus) {
        self.statuses[rank as usize] = Some(st);
        let others_running = self.running().next().is_some();
        if !st.success() && !self.reaped && self.first_failure.is_none() {
            self.first_failure = Some((rank, st));
            if others_running {
                tracing::warn!(job_id = %self.job_id, rank, "rank {rank} {}: stopping the other ranks", describe_exit(&st));
                self.kill();
            }
        } else if rank == 0 && others_running && !self.reaped {
            self.linger_until = Some(Instant::now() + LINGER);
        }
    }

    fn outcome(&self) -> Option<ExitStatus> {
        if self.statuses.iter().any(Option::is_none) {
            return None;
        }
        Some(match self.first_failure {
            Some((_, st)) => st,
            None => self.statuses[0].expect("every rank exited"),
        })
    }

    /// `rank 1 of 2 killed by signal 9 (SIGKILL)`, or rank 0's exit with the group size.
    pub fn describe(&self, status: &ExitStatus) -> String {
        let world = self.pids.len();
        match self.first_failure {
            Some((rank, st)) => format!("rank {rank} of {world} {}", describe_exit(&st)),
            None => format!("{} (rank 0 of {world})", describe_exit(status)),
        }
    }
}

impl Drop for RankGroup {
    fn drop(&mut self) {
        // As `kill_on_drop` does for one worker: no rank outlives its supervisor's interest.
        for pid in self.running().collect::<Vec<_>>() {
            let _ = process::kill_group(pid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tags() -> LogTags {
        LogTags {
            run_id: "r".into(),
            job_id: "j".into(),
            attempt: 1,
            rank: 0,
        }
    }

    fn sh(script: &str) -> WorkerCommand {
        WorkerCommand {
            program: "sh".into(),
            args: vec!["-c".into(), script.into(), "worker".into()],
        }
    }

    fn env() -> Vec<(OsString, OsString)> {
        vec![("PATH".into(), std::env::var_os("PATH").unwrap_or_default())]
    }

    /// Two CPU ranks of `sh -c script` in `dir`.
    fn two_ranks(
        script: &str,
        dir: &std::path::Path,
    ) -> (RankGroup, mpsc::Receiver<WorkerEvent>, LogRelay) {
        let plan = RankPlan {
            world: 2,
            cpu: true,
        };
        spawn(&sh(script), dir, env(), tags(), plan).expect("spawn")
    }

    fn job_dir(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("rm-ranks-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("mkdir");
        d
    }

    #[test]
    fn each_rank_gets_the_torchrun_environment() {
        let plan = RankPlan {
            world: 2,
            cpu: true,
        };
        let e = rank_env(plan, 1, 29500, &env());
        let get = |k: &str| {
            e.iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.to_str().expect("utf8").to_string())
        };
        assert_eq!(get("RANK").as_deref(), Some("1"));
        assert_eq!(get("LOCAL_RANK").as_deref(), Some("1"));
        assert_eq!(get("WORLD_SIZE").as_deref(), Some("2"));
        assert_eq!(get("LOCAL_WORLD_SIZE").as_deref(), Some("2"));
        assert_eq!(get("MASTER_ADDR").as_deref(), Some("127.0.0.1"));
        assert_eq!(get("MASTER_PORT").as_deref(), Some("29500"));
        assert_eq!(get("OMP_NUM_THREADS").as_deref(), Some("1"));
        assert_eq!(get("DFLASH_CPU_RANKS").as_deref(), Some("1"));
        // The provider's own thread count wins; CUDA ranks are not CPU ranks.
        let mut base = env();
        base.push(("OMP_NUM_THREADS".into(), "4".into()));
        let e = rank_env(
            RankPlan {
                world: 2,
                cpu: false,
            },
            0,
            1,
            &base,
        );
        assert!(
            !e.iter()
                .any(|(k, _)| k == "OMP_NUM_THREADS" || k == "DFLASH_CPU_RANKS"),
            "{e:?}"
        );
    }

    #[tokio::test]
    async fn the_group_passes_rank_0_events_and_tags_ranks() {
        let dir = job_dir("events");
        // Every rank prints an event and an error event, then exits 0.
        let script = r#"echo "{\"event\":\"progress\",\"phase\":\"train\",\"step\":$((RANK + 1))}"; echo "{\"event\":\"error\",\"message\":\"rank $RANK\",\"retryable\":true}""#;
        let (mut g, mut events, logs) = two_ranks(script, &dir);
        let st = g.wait().await.expect("wait");
        assert!(st.success(), "{}", g.describe(&st));
        assert_eq!(g.describe(&st), "exited with code 0 (rank 0 of 2)");
        logs.finish(Duration::from_secs(2)).await;
        let mut got = Vec::new();
        while let Ok(Some(ev)) = tokio::time::timeout(Duration::from_secs(2), events.recv()).await {
            got.push(ev);
        }
        // Rank 0's progress (step 1), both errors; never rank 1's progress (step 2).
        let steps: Vec<u64> = got
            .iter()
            .filter_map(|e| match e {
                WorkerEvent::Progress(p) => Some(p.step),
                _ => None,
            })
            .collect();
        assert_eq!(steps, [1]);
        let mut errors: Vec<String> = got
            .iter()
            .filter_map(|e| match e {
                WorkerEvent::Error { message, .. } => Some(message.clone()),
                _ => None,
            })
            .collect();
        errors.sort();
        assert_eq!(errors, ["rank 0", "rank 1"]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_rank_that_dies_takes_the_others_down() {
        let dir = job_dir("death");
        // Rank 1 is SIGKILLed by itself; rank 0 would wait forever for it.
        let script = r#"if [ "$RANK" = 1 ]; then kill -9 $$; fi; exec sleep 60"#;
        let (mut g, _events, _logs) = two_ranks(script, &dir);
        let pids = g.pids().to_vec();
        let st = tokio::time::timeout(Duration::from_secs(20), g.wait())
            .await
            .expect("the group ends")
            .expect("wait");
        assert!(!st.success());
        assert_eq!(g.describe(&st), "rank 1 of 2 killed by signal 9 (SIGKILL)");
        for pid in pids {
            // SAFETY: kill(pid, 0) only checks that the process exists.
            assert_ne!(
                unsafe { libc::kill(pid as libc::pid_t, 0) },
                0,
                "rank pid {pid} is still alive"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn ranks_finish_early_and_rank_0_ends_the_group() {
        let dir = job_dir("early");
        // Rank 1 exits at once; rank 0 works on, then exits 3: the group's exit is rank 0's.
        let script = r#"if [ "$RANK" = 1 ]; then exit 0; fi; sleep 0.3; exit 3"#;
        let (mut g, _events, _logs) = two_ranks(script, &dir);
        let st = g.wait().await.expect("wait");
        assert_eq!(st.code(), Some(3));
        assert_eq!(g.describe(&st), "rank 0 of 2 exited with code 3");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn signals_reach_every_rank() {
        let dir = job_dir("signals");
        // Each rank writes a marker when SIGTERM arrives, then exits 0.
        let script =
            r#"trap 'echo term > "$2/term-$RANK"; exit 0' TERM; while :; do sleep 0.05; done"#;
        let (mut g, _events, _logs) = two_ranks(script, &dir);
        tokio::time::sleep(Duration::from_millis(300)).await;
        g.signal(libc::SIGTERM);
        let st = tokio::time::timeout(Duration::from_secs(20), g.wait())
            .await
            .expect("the group ends")
            .expect("wait");
        assert!(st.success(), "{}", g.describe(&st));
        for r in 0..2 {
            assert!(
                dir.join(format!("term-{r}")).is_file(),
                "rank {r} did not get SIGTERM"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
