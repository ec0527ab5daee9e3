//! Every environment variable the run-manager and the native client read, in one place.
//! Precedence everywhere: command-line flag > environment > default.

/// Coordinator address: `https://HOST:PORT` (TLS), or `http://HOST:PORT` / `HOST:PORT`
/// (plaintext: loopback only, unless `--insecure`).
pub const COORDINATOR: &str = "DFLASH_COORDINATOR";
/// Bearer token identifying this provider to the coordinator. Lowest
/// precedence: `--token` > `--token-file` / `DFLASH_PROVIDER_TOKEN_FILE` > this.
pub const PROVIDER_TOKEN: &str = "DFLASH_PROVIDER_TOKEN";
/// File holding the provider token (`--token-file`); refused unless mode 0600 or stricter.
pub const PROVIDER_TOKEN_FILE: &str = "DFLASH_PROVIDER_TOKEN_FILE";
/// TLS: PEM CA certificate(s) the coordinator's certificate must chain to
/// (`--ca-file`; default: the system roots).
pub const TLS_CA: &str = "DFLASH_TLS_CA";
/// Mutual TLS: this provider's PEM client certificate (`--client-cert`); its
/// subject CN must be the provider's name.
pub const TLS_CLIENT_CERT: &str = "DFLASH_TLS_CLIENT_CERT";
/// Mutual TLS: the PEM private key of `--client-cert` (`--client-key`).
pub const TLS_CLIENT_KEY: &str = "DFLASH_TLS_CLIENT_KEY";
/// Read by `dflash-coordinator serve` (not by the run-manager): the TLS
/// certificate, key and client CA it serves with. Removed from the environment
/// of the `--local` embedded coordinator, which must serve the plaintext
/// loopback that `--local` dials whatever the shell has set.
pub const COORDINATOR_TLS_CERT: &str = "DFLASH_TLS_CERT";
/// See [`COORDINATOR_TLS_CERT`].
pub const COORDINATOR_TLS_KEY: &str = "DFLASH_TLS_KEY";
/// See [`COORDINATOR_TLS_CERT`].
pub const COORDINATOR_TLS_CLIENT_CA: &str = "DFLASH_TLS_CLIENT_CA";
/// The coordinator's admin token. The run-manager sets it only for the
/// embedded coordinator of `--local` (kept off its command line) and never
/// passes it to a worker.
pub const ADMIN_TOKEN: &str = "DFLASH_ADMIN_TOKEN";
/// Working directory for jobs (checkpoints, captured features, exports).
pub const WORK_DIR: &str = "DFLASH_WORK_DIR";
/// Name this machine registers under (default: the host name).
pub const PROVIDER_NAME: &str = "DFLASH_PROVIDER_NAME";
/// Launch mode: `auto` (default: `docker` on Linux with NVIDIA GPUs, else `native`), `native` or `docker`.
pub const LAUNCH_MODE: &str = "DFLASH_LAUNCH_MODE";
/// Docker launch mode: the docker executable, a path or a name looked up on `PATH` (default `docker`).
pub const DOCKER: &str = "DFLASH_DOCKER";
/// Docker launch mode: image repository for leases that name no image (tag = the run's client version).
pub const IMAGE_REPOSITORY: &str = "DFLASH_IMAGE_REPOSITORY";
/// Path of the native client binary (`--native-client`).
pub const NATIVE_CLIENT: &str = "DFLASH_NATIVE_CLIENT";
/// Native client version to ask the coordinator to accept (`--native-client-version`).
pub const NATIVE_CLIENT_VERSION: &str = "DFLASH_NATIVE_CLIENT_VERSION";
/// Worker command line, split on whitespace (`--worker-cmd`); `--job-dir DIR` is appended.
pub const WORKER_CMD: &str = "DFLASH_WORKER_CMD";
/// Device backend: `auto`, `cuda`, `mps` or `cpu`.
pub const DEVICE: &str = "DFLASH_DEVICE";
/// `1` or `0`: whether MPS supports bfloat16 (reported in the device capabilities).
pub const MPS_BF16: &str = "DFLASH_MPS_BF16";
/// Read by the worker: `DFLASH_REQUIRE_CUDA=1` / `DFLASH_REQUIRE_MPS=1` make a
/// missing backend an error instead of a CPU fallback (python/dflash_worker/device.py).
/// Passed to the native worker by this prefix.
pub const REQUIRE_PREFIX: &str = "DFLASH_REQUIRE_";
/// Stop after this many job attempts (0 = no limit).
pub const MAX_JOBS: &str = "DFLASH_MAX_JOBS";
/// Seconds the coordinator may hold a lease request open (long-poll).
pub const POLL_WAIT: &str = "DFLASH_POLL_WAIT";
/// Stop after this many seconds without work (unset: wait for work forever).
pub const IDLE_TIMEOUT: &str = "DFLASH_IDLE_TIMEOUT";
/// Restarts of a crashed worker within one attempt before it ends RETRYABLE.
pub const MAX_RESTARTS: &str = "DFLASH_MAX_RESTARTS";
/// First worker-restart delay in milliseconds (doubles per restart).
pub const RESTART_BACKOFF_MS: &str = "DFLASH_RESTART_BACKOFF_MS";
/// Cap on the worker-restart delay in milliseconds.
pub const RESTART_BACKOFF_MAX_MS: &str = "DFLASH_RESTART_BACKOFF_MAX_MS";
/// Retries of a coordinator call that failed with UNAVAILABLE.
pub const RPC_RETRIES: &str = "DFLASH_RPC_RETRIES";
/// First delay between coordinator retries in milliseconds (doubles per retry).
pub const RPC_BACKOFF_MS: &str = "DFLASH_RPC_BACKOFF_MS";
/// Cap on the delay between coordinator retries in milliseconds.
pub const RPC_BACKOFF_MAX_MS: &str = "DFLASH_RPC_BACKOFF_MAX_MS";
/// Heartbeat interval override in seconds (default: what the coordinator asks for).
pub const HEARTBEAT_INTERVAL: &str = "DFLASH_HEARTBEAT_INTERVAL";
/// Seconds a worker has to checkpoint and exit after SIGTERM before SIGKILL.
pub const GRACE_PERIOD: &str = "DFLASH_GRACE_PERIOD";
/// Log format on stderr: `text` or `json`.
pub const LOG_FORMAT: &str = "DFLASH_LOG_FORMAT";
/// Log level: `error`, `warn`, `info`, `debug` or `trace`.
pub const LOG_LEVEL: &str = "DFLASH_LOG";
/// Python interpreter that runs the embedded coordinator in `--local` mode.
pub const PYTHON: &str = "DFLASH_PYTHON";
/// Run spec file for `--local` (JSON, see `docs/run-manager.md`).
pub const SPEC: &str = "DFLASH_SPEC";
/// Disable coloured output when set to anything (https://no-color.org).
pub const NO_COLOR: &str = "NO_COLOR";

/// Set by the native client and read by it: a Python prefix or virtual
/// environment whose site-packages the embedded interpreter should import from.
pub const PYTHON_HOME: &str = "DFLASH_PYTHON_HOME";
/// Read at BUILD time (`option_env!` in `native-client/src/main.rs`, which must
/// spell the same name): the environment a standalone native client imports
/// from when nothing else names one. Set by `scripts/build-native-*.sh`.
pub const BUILD_PYTHON_HOME: &str = "DFLASH_BUILD_PYTHON_HOME";
/// The active virtual environment (set by `activate`); the native client
/// imports from its site-packages.
pub const VIRTUAL_ENV: &str = "VIRTUAL_ENV";
/// Set for the worker so the embedded interpreter does not buffer stdout
/// (progress events must arrive as they are written).
pub const PYTHONUNBUFFERED: &str = "PYTHONUNBUFFERED";
/// CPython's own: where the standard library lives. A standalone native client
/// (built by `scripts/build-native-*.sh`, not inside an environment) sets it to
/// the prefix of the Python it was built against when it is unset, and removes
/// it again once the interpreter is up, so the job's subprocesses never see it.
pub const PYTHONHOME: &str = "PYTHONHOME";

/// Test-only: where the `worker::jobdir::tests::writes_fixture_spec_json_for_python`
/// unit test writes a sample `spec.json` for the Python side's round-trip test
/// (`tests/worker/test_rust_spec.py`); unset, it writes nothing.
pub const SPEC_FIXTURE_OUT: &str = "DFLASH_SPEC_FIXTURE_OUT";

// The standard `torch.distributed` environment each local rank gets (`crate::worker::ranks`),
// as `torchrun` sets it.
pub const RANK: &str = "RANK";
pub const LOCAL_RANK: &str = "LOCAL_RANK";
pub const WORLD_SIZE: &str = "WORLD_SIZE";
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
pub const MASTER_ADDR: &str = "MASTER_ADDR";
pub const MASTER_PORT: &str = "MASTER_PORT";
/// Threads per rank: 1 unless the provider set it (as `torchrun` does).
pub const OMP_NUM_THREADS: &str = "OMP_NUM_THREADS";
/// The worker's permission to run several ranks on CPU (`dflash_worker.dist.CPU_RANKS_ENV`),
/// set for each rank of a `--cpu-ranks` provider.
pub const CPU_RANKS: &str = "DFLASH_CPU_RANKS";
