//! Command-line interface (clap derive). Flags take CLI > env > default.

use std::path::PathBuf;

use clap::{ArgAction, Parser, ValueEnum};

use crate::device::DeviceChoice;
use crate::env_vars;

/// How the worker is launched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LaunchModeArg {
    /// `docker` on Linux when `nvidia-smi` lists GPUs (except with `--local`, or when a native
    /// client or worker command was given), else `native`.
    Auto,
    /// The native client (embeds CPython) on this machine's Python environment.
    Native,
    /// A Docker + CUDA container per worker, image from the lease (or the run's client version).
    Docker,
}

/// Log line format on stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Log verbosity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

const AFTER_HELP: &str = "\
Modes:
  run-manager --coordinator https://HOST:PORT --token-file FILE [--ca-file CA.pem]
              [--client-cert CERT.pem --client-key KEY.pem]
      join a coordinator over TLS (mutual TLS with a client certificate) and run
      the jobs it leases, until stopped; plaintext (`http://`) only to this
      machine, or with `--insecure`
  run-manager --local [--spec FILE]
      start an embedded coordinator (SQLite, local artifact directory) under the
      work directory, create one run from FILE (default: a `noop` demo job), run
      its jobs on this machine and print a summary

The worker runs as a child process: `<native-client> --job-dir DIR`, where DIR
holds `spec.json`; it reports progress as JSON lines on stdout
(docs/worker-events.md) and logs JSON lines on stderr, which are re-emitted
tagged with run id and rank. SIGINT/SIGTERM: the worker gets SIGTERM, writes a
checkpoint and exits; the attempt is handed back RETRYABLE. The worker starts
with an allow-listed environment (PATH, HOME, locale, Python and CUDA settings,
DFLASH_DEVICE, DFLASH_MPS_BF16, DFLASH_REQUIRE_*; see docs/run-manager.md), never
the provider token or anything named like a secret.

Docker launch mode (the default on Linux with NVIDIA GPUs, except `--local`): the child is
`docker run --rm --gpus all --cap-drop ALL --read-only ... IMAGE --job-dir DIR`
with the job directory mounted at the same path; IMAGE is the run's image, else
`--image-repository`:<run's client version>. CANCEL and shutdown become
`docker stop --time <grace>`, CHECKPOINT_NOW `docker kill --signal USR1`.

Exit codes:
  0    ok (`--local`: every job succeeded)
  1    user error (flags, spec file, token, TLS set-up or handshake, refused by the coordinator)
  2    unexpected error
  3    `--local`: a job did not succeed (see the summary)
  10   upgrade required: the coordinator (or the preflight) wants another client version
  130  stopped by SIGINT, 143 stopped by SIGTERM (after the worker stopped)";

/// Join a dflash coordinator and run DFlash2 draft-training jobs on this machine.
#[derive(Debug, Parser)]
#[command(
    name = "run-manager",
    version = crate::version::CLIENT_VERSION,
    after_long_help = AFTER_HELP,
    max_term_width = 100
)]
pub struct Cli {
    /// Coordinator address: `https://HOST:PORT` (TLS), or `http://HOST:PORT` / `HOST:PORT`
    /// (plaintext: only to this machine, unless `--insecure`).
    #[arg(long, env = env_vars::COORDINATOR, conflicts_with = "local")]
    pub coordinator: Option<String>,

    /// Bearer token that identifies this provider to the coordinator (a command line is visible
    /// to other users: prefer `--token-file`). Else `--token-file`, else the environment variable
    /// `DFLASH_PROVIDER_TOKEN`.
    // Tokens are URL-safe base64 and may start with `-`. No clap `env`: the
    // environment comes after `--token-file` (token::provider_token).
    #[arg(long, allow_hyphen_values = true)]
    pub token: Option<String>,

    /// The value of `DFLASH_PROVIDER_TOKEN`, read by `lockdown::lock_down` before it removes the
    /// variable from this process's environment (not a flag).
    #[arg(skip)]
    pub env_token: Option<String>,

    /// File holding the provider token (one line); refused unless mode 0600 or stricter.
    #[arg(long, env = env_vars::PROVIDER_TOKEN_FILE, value_name = "PATH")]
    pub token_file: Option<PathBuf>,

    /// TLS: PEM file with the CA certificate(s) the coordinator's certificate must chain to
    /// (default: the system's trusted CAs).
    #[arg(long, env = env_vars::TLS_CA, value_name = "PATH")]
    pub ca_file: Option<PathBuf>,

    /// Mutual TLS: this provider's PEM client certificate, signed by the coordinator's client CA;
    /// its subject CN must be the provider's name (`providers create NAME`). Needs `--client-key`.
    #[arg(long, env = env_vars::TLS_CLIENT_CERT, value_name = "PATH")]
    pub client_cert: Option<PathBuf>,

    /// Mutual TLS: the PEM private key of `--client-cert` (unencrypted; keep it mode 0600).
    #[arg(long, env = env_vars::TLS_CLIENT_KEY, value_name = "PATH")]
    pub client_key: Option<PathBuf>,

    /// Allow a plaintext coordinator address that is not this machine; the token and job data
    /// cross the network unencrypted (a warning is logged). Plaintext to loopback needs no flag.
    #[arg(long)]
    pub insecure: bool,

    /// Directory for job state: `jobs/<job_id>/` (spec.json, checkpoints, exports) and, with
    /// `--local`, the embedded coordinator's database and artifacts.
    #[arg(long, env = env_vars::WORK_DIR, default_value = "./dflash-work")]
    pub work_dir: PathBuf,

    /// Start an embedded coordinator on 127.0.0.1 (SQLite under the work directory), create a
    /// run from `--spec`, run its jobs here, print a summary and exit.
    #[arg(long)]
    pub local: bool,

    /// With `--local`: run spec file (JSON: `name`, `spec` or `spec_json`,
    /// `required_client_version`, `checkpoint_policy`, `max_local_ranks`, `required_features`,
    /// `num_jobs`, `approve_native_versions`); default: a `noop` demo job.
    #[arg(long, env = env_vars::SPEC, requires = "local")]
    pub spec: Option<PathBuf>,

    /// With `--local`: Python interpreter that runs the embedded coordinator (default: the
    /// `python3` next to this binary, else `$VIRTUAL_ENV/bin/python`, else `python3` on PATH).
    #[arg(long, env = env_vars::PYTHON)]
    pub python: Option<PathBuf>,

    /// With `--local`: print the summary as JSON on stdout.
    #[arg(long)]
    pub json: bool,

    /// Name this machine registers under (default: the host name).
    #[arg(long, env = env_vars::PROVIDER_NAME)]
    pub name: Option<String>,

    /// How workers are launched.
    #[arg(long, env = env_vars::LAUNCH_MODE, value_enum, default_value_t = LaunchModeArg::Auto)]
    pub launch_mode: LaunchModeArg,

    /// Docker launch mode: the docker executable (a path, or a name looked up on PATH).
    #[arg(long, env = env_vars::DOCKER, value_name = "PATH", default_value = crate::worker::docker::DOCKER_PROGRAM)]
    pub docker: PathBuf,

    /// Docker launch mode: image repository for runs that name no image; the tag is the run's
    /// required client version.
    #[arg(long, env = env_vars::IMAGE_REPOSITORY, value_name = "REPO", default_value = crate::worker::docker::DEFAULT_IMAGE_REPOSITORY)]
    pub image_repository: String,

    /// Docker launch mode: also mount this host directory read-only at the same path in the
    /// container (models, datasets); repeatable.
    #[arg(long, value_name = "DIR")]
    pub docker_mount: Vec<PathBuf>,

    /// Run workers with the native client binary at PATH (without PATH: the
    /// `dflash-native-client` next to this binary, which is also the default worker).
    #[arg(long, env = env_vars::NATIVE_CLIENT, value_name = "PATH", num_args = 0..=1, conflicts_with = "worker_cmd")]
    pub native_client: Option<Option<PathBuf>>,

    /// Native client version to ask the coordinator to accept when a run requires another
    /// version; it runs only if the run admin approved it. Must equal the native client's own
    /// `--version`.
    #[arg(long, env = env_vars::NATIVE_CLIENT_VERSION, value_name = "VERSION")]
    pub native_client_version: Option<String>,

    /// Worker command line instead of the native client, split on whitespace (no quoting);
    /// `--job-dir DIR` is appended. Its version counts as this run-manager's.
    #[arg(long, env = env_vars::WORKER_CMD, value_name = "CMD")]
    pub worker_cmd: Option<String>,

    /// Device backend to offer: `auto` picks CUDA when `nvidia-smi` lists GPUs, MPS on macOS
    /// arm64, else CPU.
    #[arg(long, env = env_vars::DEVICE, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,

    /// Test and development switch: offer N local ranks on CPU (gloo), so multi-rank jobs
    /// (`max_local_ranks > 1`) run here as they would on an N-GPU machine. The ranks share
    /// this machine's cores: slower than one rank, never faster. Native launch mode only.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=64))]
    pub cpu_ranks: Option<u32>,

    /// Stop after this many job attempts (0: no limit).
    #[arg(long, env = env_vars::MAX_JOBS, default_value_t = 0)]
    pub max_jobs: u32,

    /// Seconds the coordinator may hold a lease request open waiting for work.
    #[arg(long, env = env_vars::POLL_WAIT, default_value_t = 30)]
    pub poll_wait: u32,

    /// Stop after this many seconds without a lease (default: wait forever; with `--local`: 60,
    /// then fail naming the jobs this machine cannot take).
    #[arg(long, env = env_vars::IDLE_TIMEOUT, value_name = "SECS")]
    pub idle_timeout: Option<u64>,

    /// Restarts of a crashed worker (non-zero exit or signal) within one attempt; each
    /// resumes from the last committed checkpoint. Then the attempt ends RETRYABLE.
    #[arg(long, env = env_vars::MAX_RESTARTS, default_value_t = 3)]
    pub max_restarts: u32,

    /// Delay before the first worker restart, in milliseconds; doubles per restart.
    #[arg(long, env = env_vars::RESTART_BACKOFF_MS, default_value_t = 2000, value_name = "MS")]
    pub restart_backoff_ms: u64,

    /// Cap on the worker-restart delay, in milliseconds.
    #[arg(long, env = env_vars::RESTART_BACKOFF_MAX_MS, default_value_t = 60_000, value_name = "MS")]
    pub restart_backoff_max_ms: u64,

    /// Retries of a coordinator call that fails with UNAVAILABLE. Artifact uploads, downloads and
    /// FinishAttempt keep retrying UNAVAILABLE until the lease would expire; for them this bounds
    /// streams cut some other way in a row.
    #[arg(long, env = env_vars::RPC_RETRIES, default_value_t = 8)]
    pub rpc_retries: u32,

    /// Delay before the first coordinator retry, in milliseconds; doubles per retry.
    #[arg(long, env = env_vars::RPC_BACKOFF_MS, default_value_t = 500, value_name = "MS")]
    pub rpc_backoff_ms: u64,

    /// Cap on the delay between coordinator retries, in milliseconds.
    #[arg(long, env = env_vars::RPC_BACKOFF_MAX_MS, default_value_t = 30_000, value_name = "MS")]
    pub rpc_backoff_max_ms: u64,

    /// Heartbeat (lease renewal) interval in seconds (default: the coordinator's; never more
    /// than a third of the lease TTL).
    #[arg(long, env = env_vars::HEARTBEAT_INTERVAL, value_name = "SECS")]
    pub heartbeat_interval: Option<f64>,

    /// Seconds a worker has to checkpoint and exit after SIGTERM before it is killed.
    #[arg(long, env = env_vars::GRACE_PERIOD, default_value_t = 60.0, value_name = "SECS")]
    pub grace_period: f64,

    /// Log format on stderr.
    #[arg(long, env = env_vars::LOG_FORMAT, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Log level.
    #[arg(long, env = env_vars::LOG_LEVEL, value_enum, default_value_t = LogLevel::Info)]
    pub log_level: LogLevel,

    /// Print more (repeat for more; overrides `--log-level` upwards).
    #[arg(short, long, action = ArgAction::Count)]
    pub verbose: u8,

    /// Hidden (`bench/artifacts.py`): upload this one file as an `export` artifact of
    /// `--upload-lease` through the run-manager's uploader, print a JSON line and exit.
    #[arg(
        long,
        hide = true,
        value_name = "PATH",
        requires = "upload_lease",
        conflicts_with = "local"
    )]
    pub upload_file: Option<PathBuf>,

    /// Hidden: the lease (held by this provider's token) that `--upload-file` uploads under.
    #[arg(long, hide = true, value_name = "LEASE_ID", requires = "upload_file")]
    pub upload_lease: Option<String>,

    /// Hidden: the artifact name of `--upload-file` (default: its file name).
    #[arg(long, hide = true, value_name = "NAME", requires = "upload_file")]
    pub upload_name: Option<String>,
}
