//! How workers are started and reached: natively (the worker is our child
//! process, in its own process group; a job of several local ranks is that
//! many children, `crate::worker::ranks`) or in a container (the child is the
//! `docker run` CLI, and signals go to the container through `docker`).
//!
//! The mode is decided once per attempt ([`Launcher`]); each worker start
//! yields a [`Launch`] whose methods hide the mode from the supervisor.

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use tokio::process::Child;
use tokio::sync::mpsc;

use crate::error::Result;
use crate::proto::Lease;
use crate::worker::docker::{self, Container, DockerConfig};
use crate::worker::environment;
use crate::worker::events::WorkerEvent;
use crate::worker::process::{self, LogRelay, LogTags, Worker, WorkerCommand};
use crate::worker::ranks::{self, RankGroup, RankPlan};

/// Extra time `docker stop` gets beyond the grace period: it SIGKILLs after
/// the grace period itself, and the CLI must be allowed to do so.
const DOCKER_STOP_SLACK: Duration = Duration::from_secs(10);

/// How this attempt starts its workers.
#[derive(Debug, Clone)]
pub enum Launcher {
    /// Run this command (`--job-dir DIR` is appended), once per local rank.
    Native(WorkerCommand, RankPlan),
    /// Run `image` with docker (its entrypoint is the native client).
    Docker { docker: DockerConfig, image: String },
}

/// A started worker: what to wait on and where signals go.
#[derive(Debug)]
pub enum Launch {
    Native {
        child: Child,
        pid: u32,
    },
    /// Several local ranks, started natively.
    Ranks(RankGroup),
    Container {
        /// The `docker run` CLI.
        child: Child,
        pid: u32,
        container: Container,
    },
}

/// What a started worker says: its events (stdout) and the relay of its logs (stderr).
pub struct WorkerOutput {
    pub events: mpsc::Receiver<WorkerEvent>,
    pub logs: LogRelay,
}

impl Launcher {
    /// The launcher for `lease` with `plan.world` local ranks: Docker when configured
    /// (the lease must name a usable image and want one rank, else the error
    /// refuses it), else the native worker command.
    pub fn for_lease(
        worker: &WorkerCommand,
        docker: Option<&DockerConfig>,
        lease: &Lease,
        plan: RankPlan,
    ) -> std::result::Result<Self, String> {
        match docker {
            None => Ok(Launcher::Native(worker.clone(), plan)),
            // This provider offers one rank in Docker mode (`setup`); a lease wanting more is a coordinator's mistake.
            Some(_) if plan.world > 1 => Err(format!(
                "job `{}` wants {} local ranks, but Docker launch mode runs one rank per job\nhint: run multi-rank jobs with `--launch-mode native`",
                lease.job_id, plan.world
            )),
            Some(d) => {
                docker::image_for_lease(lease, &d.repository).map(|image| Launcher::Docker {
                    docker: d.clone(),
                    image,
                })
            }
        }
    }

    /// Work done once per attempt before the first start: pulling the image.
    /// The error (a pull that failed) ends the attempt RETRYABLE.
    pub async fn prepare(&self, job_id: &str) -> std::result::Result<(), String> {
        match self {
            Launcher::Native(..) => Ok(()),
            Launcher::Docker { docker, image } => {
                tracing::info!(job_id = %job_id, %image, "pulling the image");
                docker::pull(docker, image).await
            }
        }
    }

    /// Start worker number `restart` of the attempt in `job_dir`. `resume` is
    /// the checkpoint it resumes from (a container must be able to read it).
    pub async fn start(
        &self,
        lease: &Lease,
        job_dir: &Path,
        restart: u32,
        resume: Option<&Path>,
    ) -> Result<(Launch, WorkerOutput)> {
        let tags = LogTags {
            run_id: lease.run_id.clone(),
            job_id: lease.job_id.clone(),
            attempt: lease.attempt,
            rank: 0,
        };
        let job_id = &lease.job_id;
        match self {
            Launcher::Native(command, plan) if plan.world > 1 => {
                let env = environment::native(std::env::vars_os());
                let (group, events, logs) = ranks::spawn(command, job_dir, env, tags, *plan)?;
                for (rank, pid) in group.pids().iter().enumerate() {
                    tracing::info!(job_id = %job_id, pid, rank, restart, "worker started: rank {rank} of {}: {}", plan.world, command.program.display());
                }
                Ok((Launch::Ranks(group), WorkerOutput { events, logs }))
            }
            Launcher::Native(command, _) => {
                let env = environment::native(std::env::vars_os());
                let (child, pid, output) = split(process::spawn(command, job_dir, env, tags)?);
                tracing::info!(job_id = %job_id, pid, restart, "worker started: {}", command.program.display());
                Ok((Launch::Native { child, pid }, output))
            }
            Launcher::Docker { docker, image } => {
                let (command, container) =
                    docker_command(docker, image, lease, job_dir, restart, resume);
                // A container of this name left by a run-manager that died would block the start.
                container.remove().await;
                docker::prepare_job_dir(docker, job_dir).map_err(crate::error::Error::io(
                    "cannot hand the job directory to the container's user",
                    job_dir,
                ))?;
                // The CLI, not the worker: the container's environment is its `--env` pairs.
                let env = environment::without_secrets(std::env::vars_os());
                let (child, pid, output) = split(process::spawn(&command, job_dir, env, tags)?);
                tracing::info!(job_id = %job_id, pid, restart, container = %container.name, image = %image, "worker started: container `{}`", container.name);
                let launch = Launch::Container {
                    child,
                    pid,
                    container,
                };
                Ok((launch, output))
            }
        }
    }
}

/// The process apart from its output, so the supervisor can wait on one while reading the other.
fn split(w: Worker) -> (Child, u32, WorkerOutput) {
    let output = WorkerOutput {
        events: w.events,
        logs: w.logs,
    };
    (w.child, w.pid, output)
}

impl Launch {
    /// The process id of the child (the worker, rank 0, or the `docker run` CLI).
    pub fn pid(&self) -> u32 {
        match self {
            Launch::Native { pid, .. } | Launch::Container { pid, .. } => *pid,
            Launch::Ranks(group) => group.pid(),
        }
    }

    /// Wait for the child to exit (every rank: `RankGroup::wait`).
    pub async fn wait(&mut self) -> std::io::Result<ExitStatus> {
        match self {
            Launch::Native { child, .. } | Launch::Container { child, .. } => child.wait().await,
            Launch::Ranks(group) => group.wait().await,
        }
    }

    /// `killed by signal 9 (SIGKILL)`; for ranks, which rank ended the group.
    pub fn describe_exit(&self, status: &ExitStatus) -> String {
        match self {
            Launch::Ranks(group) => group.describe(status),
            _ => process::describe_exit(status),
        }
    }

    /// Ask the worker to checkpoint and stop (SIGTERM; `docker stop` for a
    /// container, which SIGKILLs after `grace` itself).
    pub fn terminate(&self, grace: Duration) {
        match self {
            Launch::Native { pid, .. } => {
                let _ = process::signal(*pid, libc::SIGTERM);
            }
            Launch::Ranks(group) => group.signal(libc::SIGTERM),
            Launch::Container { container, .. } => container.stop(grace),
        }
    }

    /// How long after [`Launch::terminate`] the worker is killed.
    pub fn kill_after(&self, grace: Duration) -> Duration {
        match self {
            Launch::Native { .. } | Launch::Ranks(_) => grace,
            Launch::Container { .. } => grace + DOCKER_STOP_SLACK,
        }
    }

    /// Ask the worker to commit a checkpoint and keep going (SIGUSR1).
    pub fn checkpoint(&self) {
        match self {
            Launch::Native { pid, .. } => {
                let _ = process::signal(*pid, libc::SIGUSR1);
            }
            Launch::Ranks(group) => group.signal(libc::SIGUSR1),
            Launch::Container { container, .. } => container.checkpoint(),
        }
    }

    /// Kill the worker now (its process group, every rank's; the container too).
    pub fn kill(&mut self) {
        match self {
            Launch::Ranks(group) => group.kill(),
            Launch::Container { container, .. } => {
                container.kill();
                let _ = process::kill_group(self.pid());
            }
            Launch::Native { pid, .. } => {
                let _ = process::kill_group(*pid);
            }
        }
    }

    /// After the child exited: remove a container that `--rm` did not (a
    /// stopped or killed one may linger).
    pub async fn cleanup(&self) {
        if let Launch::Container { container, .. } = self {
            container.remove().await;
        }
    }
}

/// The `docker run` command for one worker start, and the container it names.
fn docker_command(
    d: &DockerConfig,
    image: &str,
    lease: &Lease,
    job_dir: &Path,
    restart: u32,
    resume: Option<&Path>,
) -> (WorkerCommand, Container) {
    let name = docker::container_name(&lease.job_id, lease.attempt, restart);
    let resume_dir = resume.and_then(|p| resume_mount(p, job_dir, &lease.job_id));
    let req = docker::RunRequest {
        name: &name,
        image,
        job_dir,
        run_id: &lease.run_id,
        job_id: &lease.job_id,
        attempt: lease.attempt,
        resume_dir: resume_dir.as_deref(),
    };
    let args = docker::run_args(d, &req)
        .into_iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    (
        WorkerCommand {
            program: d.program.clone(),
            args,
        },
        Container {
            program: d.program.clone(),
            name,
        },
    )
}

/// The directory to mount read-only so a container sees the resume
/// checkpoint: the checkpoint's own directory (the parent of its
/// `manifest.json`), when the checkpoint lies outside the job directory
/// (another work directory on this machine) and can be mounted.
fn resume_mount(checkpoint: &Path, job_dir: &Path, job_id: &str) -> Option<PathBuf> {
    if checkpoint.starts_with(job_dir) {
        return None;
    }
    let dir = checkpoint.parent()?;
    match docker::check_mount_path(dir) {
        Ok(()) => Some(dir.to_path_buf()),
        Err(e) => {
            tracing::warn!(job_id = %job_id, "cannot mount resume checkpoint `{}` into the container: {e}", checkpoint.display());
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resume_checkpoint_elsewhere_mounts_its_directory() {
        let job_dir = Path::new("/w2/jobs/j1");
        let elsewhere = Path::new("/w1/jobs/j1/run/checkpoints/step-00000004/manifest.json");
        assert_eq!(
            resume_mount(elsewhere, job_dir, "j1").as_deref(),
            Some(Path::new("/w1/jobs/j1/run/checkpoints/step-00000004"))
        );
        // Inside the job directory it is mounted already.
        let inside = job_dir.join("checkpoints/step-000004/manifest.json");
        assert_eq!(resume_mount(&inside, job_dir, "j1"), None);
        // A directory `--mount` cannot name is left out (the worker starts fresh).
        let comma = Path::new("/w,1/checkpoints/step-000004/manifest.json");
        assert_eq!(resume_mount(comma, job_dir, "j1"), None);
    }

    #[test]
    fn docker_command_mounts_the_resume_directory_read_only() {
        let d = DockerConfig {
            program: "docker".into(),
            repository: docker::DEFAULT_IMAGE_REPOSITORY.into(),
            gpus: false,
            user: "1000:1000".into(),
            chown: None,
            ro_mounts: vec![],
        };
        let lease = Lease {
            run_id: "r1".into(),
            job_id: "j1".into(),
            attempt: 2,
            ..Default::default()
        };
        let resume = Path::new("/w1/jobs/j1/checkpoints/step-000004/manifest.json");
        let (cmd, container) = docker_command(
            &d,
            "img:1",
            &lease,
            Path::new("/w2/jobs/j1"),
            1,
            Some(resume),
        );
        assert_eq!(container.name, "dflash-j1-a2-r1");
        let mounts: Vec<&str> = cmd
            .args
            .windows(2)
            .filter(|w| w[0] == "--mount")
            .map(|w| w[1].as_str())
            .collect();
        assert_eq!(
            mounts,
            [
                "type=bind,source=/w2/jobs/j1,target=/w2/jobs/j1",
                "type=bind,source=/w1/jobs/j1/checkpoints/step-000004,target=/w1/jobs/j1/checkpoints/step-000004,readonly",
            ]
        );
    }
}
