//! Docker launch mode: the worker runs in a CUDA container image, one
//! container per worker start.
//!
//! The image's entrypoint is the native client, so the container is started as
//! `docker run [options] IMAGE --job-dir DIR` and speaks the same event
//! protocol on stdout and JSON logs on stderr (docs/worker-events.md); the
//! `docker` CLI is the child process the run-manager supervises, and its
//! streams are relayed exactly like a native worker's.
//!
//! - Image: the lease's `image` (a tag or a digest) when set, else
//!   `<--image-repository>:<required_client_version>`.
//! - The job directory is bind-mounted at the same absolute path inside the
//!   container, so every path in `spec.json` and in the worker's events means
//!   the same file on both sides (artifacts are verified against the host path).
//!   A resume checkpoint from another work directory on this machine is
//!   visible the same way: its directory (the parent of the checkpoint's
//!   `manifest.json`) is mounted read-only at its own path.
//! - Hardening: no `--privileged`, `--cap-drop ALL`, `--security-opt
//!   no-new-privileges`, `--read-only` root filesystem; writable are only the
//!   job directory and a tmpfs scratch directory (`/tmp`, also `HOME`); every
//!   cache and temp variable (`XDG_CACHE_HOME`, `TORCH_HOME`, `TRITON_CACHE_DIR`,
//!   `HF_HOME`, `MPLCONFIGDIR`, `TMPDIR`) points into the tmpfs, and `USER` /
//!   `LOGNAME` are set, since the container's uid may have no passwd entry
//!   (`getpass.getuser()`, which torch's compile caches call, fails without one).
//!   `/dev/shm` is [`SHM_SIZE`]. Never root: the container runs as the
//!   run-manager's own uid:gid, so files it writes to the job directory belong to
//!   the provider; a run-manager running as root runs it as [`CONTAINER_UID`]
//!   instead and hands the job directory to that uid before each start
//!   ([`prepare_job_dir`]).
//! - Signals go to the container, never to the `docker` CLI (`--sig-proxy=false`):
//!   CANCEL / shutdown -> `docker stop --time <grace>`, CHECKPOINT_NOW ->
//!   `docker kill --signal USR1`, a stale lease -> `docker rm -f`. The
//!   container is started with `--rm` and removed with `docker rm -f` after the
//!   worker exits (a no-op when `--rm` already removed it), and also before a
//!   start, in case an earlier run-manager died and left one behind under the
//!   same deterministic name.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::process::Command;

use crate::error::{Error, Result};
use crate::proto::Lease;

/// Image repository used when a lease names no image; the tag is the run's
/// required client version (`ghcr.io/dflash-worker/dflash-worker:0.1.0`).
pub const DEFAULT_IMAGE_REPOSITORY: &str = "ghcr.io/dflash-worker/dflash-worker";
/// The docker executable looked up on `PATH` when `--docker` is not given.
pub const DOCKER_PROGRAM: &str = "docker";
/// Writable scratch inside the container (tmpfs); also the worker's `HOME`.
pub const SCRATCH_DIR: &str = "/tmp";
/// `/dev/shm` size: PyTorch data loaders pass batches through shared memory,
/// and Docker's 64 MiB default is too small for them.
pub const SHM_SIZE: &str = "8g";
/// The uid (and gid) a container runs as when the run-manager is root: the image's
/// `dflash` user (docker/Dockerfile). Root in the container is never used.
pub const CONTAINER_UID: u32 = 10001;
/// The user name the container's `USER` / `LOGNAME` say.
pub const CONTAINER_USER: &str = "dflash";
/// Longest image reference accepted from a lease (the coordinator allows 512).
const MAX_IMAGE_CHARS: usize = 512;
/// How long a `docker stop` / `kill` / `rm` call may take beyond the grace period.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(30);

/// How this provider runs containers.
#[derive(Debug, Clone)]
pub struct DockerConfig {
    /// The docker executable.
    pub program: PathBuf,
    /// Repository for leases without an `image`.
    pub repository: String,
    /// Pass `--gpus all` (the provider offers CUDA).
    pub gpus: bool,
    /// `uid:gid` the container runs as.
    pub user: String,
    /// `(uid, gid)` to hand the job directory to before each start: set when
    /// the run-manager is root and the container runs as [`CONTAINER_UID`].
    pub chown: Option<(u32, u32)>,
    /// Host directories mounted read-only at the same path (models, datasets).
    pub ro_mounts: Vec<PathBuf>,
}

/// Find `program` (a name looked up on `PATH`, or a path) and return its path.
pub fn find_program(program: &Path, path_var: Option<&std::ffi::OsStr>) -> Option<PathBuf> {
    if program.components().count() > 1 {
        return program.is_file().then(|| program.to_path_buf());
    }
    std::env::split_paths(path_var?)
        .map(|dir| dir.join(program))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// The docker executable: `--docker` / `DFLASH_DOCKER` (a path or a name), else `docker` on `PATH`.
pub fn find_docker(flag: Option<&Path>) -> Result<PathBuf> {
    let wanted = flag.unwrap_or(Path::new(DOCKER_PROGRAM));
    find_program(wanted, std::env::var_os("PATH").as_deref()).ok_or_else(|| {
        Error::Usage(format!(
            "docker launch mode: cannot find the docker executable `{}` (looked on PATH)\nhint: install Docker and the NVIDIA Container Toolkit, pass `--docker PATH`, or use `--launch-mode native`",
            wanted.display()
        ))
    })
}

/// Check a path can be written into a `--mount` value (comma-separated
/// `key=value` pairs): a comma, a quote or a control character would split or
/// corrupt the field.
pub fn check_mount_path(p: &Path) -> std::result::Result<(), String> {
    let s = p.to_str().ok_or_else(|| {
        format!(
            "`{}` is not valid UTF-8 and cannot be bind-mounted",
            p.display()
        )
    })?;
    if !p.is_absolute() {
        return Err(format!("`{s}` is not an absolute path"));
    }
    if s.chars().any(|c| c == ',' || c == '"' || c.is_control()) {
        return Err(format!(
            "`{s}` contains a comma, quote or control character, which `docker run --mount` cannot take\nhint: use a work directory (`--work-dir`) without such characters"
        ));
    }
    Ok(())
}

/// Check an image reference (`repo[:tag]` or `repo@sha256:<64 hex>`) well
/// enough that it cannot be mistaken for a flag or smuggle anything onto the
/// command line.
pub fn check_image(image: &str) -> std::result::Result<(), String> {
    let shown: String = image.chars().take(80).collect();
    if image.is_empty() || image.len() > MAX_IMAGE_CHARS {
        return Err(format!(
            "image reference `{shown}` must have 1 to {MAX_IMAGE_CHARS} characters"
        ));
    }
    if !image.as_bytes()[0].is_ascii_alphanumeric() {
        return Err(format!(
            "image reference `{shown}` must start with a letter or digit"
        ));
    }
    let ok = image.bytes().all(|b| {
        b.is_ascii_lowercase()
            || b.is_ascii_uppercase()
            || b.is_ascii_digit()
            || matches!(b, b'.' | b'_' | b'-' | b'/' | b':' | b'@')
    });
    if !ok {
        return Err(format!(
            "image reference `{shown}` has characters outside `A-Z a-z 0-9 . _ - / : @`"
        ));
    }
    if let Some((_, digest)) = image.split_once('@') {
        let hex = digest.strip_prefix("sha256:").unwrap_or("");
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!(
                "image reference `{shown}` has a malformed digest (expected `@sha256:` and 64 hex digits)"
            ));
        }
    }
    Ok(())
}

/// The image to run for `lease`: its `image`, else `repository:required_client_version`.
pub fn image_for_lease(lease: &Lease, repository: &str) -> std::result::Result<String, String> {
    let image = if lease.image.is_empty() {
        let tag = &lease.required_client_version;
        // Docker tags: [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}; semver build metadata (`+`) has no place.
        let tag_ok = !tag.is_empty()
            && tag.len() <= 128
            && !tag.starts_with(['.', '-'])
            && tag
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
        if !tag_ok {
            return Err(format!(
                "run `{}` names no image and its client version `{}` is not a valid image tag\nhint: the run admin can set the run's image (`runs create --image`)",
                lease.run_id,
                tag.chars().take(80).collect::<String>()
            ));
        }
        format!("{repository}:{tag}")
    } else {
        lease.image.clone()
    };
    check_image(&image).map_err(|e| format!("run `{}`: {e}", lease.run_id))?;
    Ok(image)
}

/// The container's user for a run-manager running as `uid:gid`: the same ids,
/// except that root becomes [`CONTAINER_UID`], whose job directory then needs
/// handing over (the second value).
pub fn container_user(uid: u32, gid: u32) -> (String, Option<(u32, u32)>) {
    if uid == 0 {
        let id = CONTAINER_UID;
        (format!("{id}:{id}"), Some((id, id)))
    } else {
        (format!("{uid}:{gid}"), None)
    }
}

/// Hand `job_dir` and everything in it to `cfg.chown` (when set): the
/// run-manager, as root, wrote `spec.json` and any downloaded checkpoint there,
/// and the container's non-root user must be able to write beside and over them.
/// Symlinks are changed themselves, never followed.
pub fn prepare_job_dir(cfg: &DockerConfig, job_dir: &Path) -> std::io::Result<()> {
    let Some((uid, gid)) = cfg.chown else {
        return Ok(());
    };
    let mut stack = vec![job_dir.to_path_buf()];
    while let Some(p) = stack.pop() {
        std::os::unix::fs::lchown(&p, Some(uid), Some(gid))?;
        if std::fs::symlink_metadata(&p)?.is_dir() {
            for entry in std::fs::read_dir(&p)? {
                stack.push(entry?.path());
            }
        }
    }
    Ok(())
}

/// The container's environment (`--env` pairs): scratch, caches and the user
/// name, nothing taken from the run-manager's own environment.
pub fn container_env() -> Vec<(&'static str, String)> {
    let under = |p: &str| format!("{SCRATCH_DIR}/{p}");
    vec![
        ("HOME", SCRATCH_DIR.to_string()),
        ("TMPDIR", SCRATCH_DIR.to_string()),
        ("USER", CONTAINER_USER.to_string()),
        ("LOGNAME", CONTAINER_USER.to_string()),
        ("PYTHONUNBUFFERED", "1".to_string()),
        ("XDG_CACHE_HOME", under(".cache")),
        ("TORCH_HOME", under(".cache/torch")),
        ("TORCHINDUCTOR_CACHE_DIR", under(".cache/torchinductor")),
        ("TRITON_CACHE_DIR", under(".cache/triton")),
        ("HF_HOME", under(".cache/huggingface")),
        ("MPLCONFIGDIR", under(".cache/matplotlib")),
    ]
}

/// Deterministic container name for one worker start of one attempt:
/// `dflash-<job_id>-a<attempt>-r<restart>` (job ids are `[A-Za-z0-9._-]`).
pub fn container_name(job_id: &str, attempt: u32, restart: u32) -> String {
    format!("dflash-{job_id}-a{attempt}-r{restart}")
}

/// Everything one `docker run` needs besides the provider's configuration.
#[derive(Debug, Clone)]
pub struct RunRequest<'a> {
    pub name: &'a str,
    pub image: &'a str,
    pub job_dir: &'a Path,
    pub run_id: &'a str,
    pub job_id: &'a str,
    pub attempt: u32,
    /// The directory of a resume checkpoint outside the job directory (the
    /// parent of its `manifest.json`), mounted read-only at the same path.
    pub resume_dir: Option<&'a Path>,
}

fn bind(src: &Path, readonly: bool) -> OsString {
    let mut v = OsString::from("type=bind,source=");
    v.push(src);
    v.push(",target=");
    v.push(src);
    if readonly {
        v.push(",readonly");
    }
    v
}

/// Arguments after `docker`, ending with the image; the caller appends
/// `--job-dir DIR` (the entrypoint's arguments).
pub fn run_args(cfg: &DockerConfig, req: &RunRequest<'_>) -> Vec<OsString> {
    let mut a: Vec<OsString> = Vec::new();
    let mut push = |s: &str| a.push(s.into());
    push("run");
    push("--rm");
    push("--name");
    push(req.name);
    // The run-manager signals the container through `docker stop/kill`; a
    // signal to the CLI process must not be forwarded twice.
    push("--sig-proxy=false");
    // A tiny init as PID 1: reaps data-loader zombies and forwards SIGTERM/SIGUSR1.
    push("--init");
    if cfg.gpus {
        push("--gpus");
        push("all");
    }
    push("--cap-drop");
    push("ALL");
    push("--security-opt");
    push("no-new-privileges");
    push("--read-only");
    // exec: triton and torch extensions load the kernels they compile into the cache.
    push("--tmpfs");
    push(&format!("{SCRATCH_DIR}:rw,nosuid,nodev,exec"));
    push("--shm-size");
    push(SHM_SIZE);
    push("--user");
    push(&cfg.user);
    for (k, v) in container_env() {
        push("--env");
        push(&format!("{k}={v}"));
    }
    for (k, v) in [
        ("dflash.run_id", req.run_id),
        ("dflash.job_id", req.job_id),
        ("dflash.attempt", &req.attempt.to_string()),
    ] {
        push("--label");
        push(&format!("{k}={v}"));
    }
    a.push("--mount".into());
    a.push(bind(req.job_dir, false));
    for ro in cfg
        .ro_mounts
        .iter()
        .map(PathBuf::as_path)
        .chain(req.resume_dir)
    {
        a.push("--mount".into());
        a.push(bind(ro, true));
    }
    a.push("--workdir".into());
    a.push(req.job_dir.into());
    a.push(req.image.into());
    a
}

/// Run `docker ARGS` to completion (stdout/stderr captured), bounded by `timeout`.
async fn docker(
    program: &Path,
    args: &[&str],
    timeout: Option<Duration>,
) -> std::result::Result<String, String> {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let what = format!("`{} {}`", program.display(), args.join(" "));
    let fut = cmd.output();
    let out = match timeout {
        Some(t) => tokio::time::timeout(t, fut)
            .await
            .map_err(|_| format!("{what} did not finish within {}s", t.as_secs()))?,
        None => fut.await,
    }
    .map_err(|e| format!("cannot run {what}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        Err(format!(
            "{what} {}: {}",
            crate::worker::process::describe_exit(&out.status),
            err.trim().chars().take(2000).collect::<String>()
        ))
    }
}

/// `docker pull IMAGE`; when the pull fails but the image is already present
/// (an offline provider, a private registry without credentials here), use it.
pub async fn pull(cfg: &DockerConfig, image: &str) -> std::result::Result<(), String> {
    match docker(&cfg.program, &["pull", image], None).await {
        Ok(_) => Ok(()),
        Err(pull_err) => {
            match docker(
                &cfg.program,
                &["image", "inspect", "--format", "{{.Id}}", image],
                Some(CONTROL_TIMEOUT),
            )
            .await
            {
                Ok(_) => {
                    tracing::warn!(%image, "pull failed; using the local copy of the image: {pull_err}");
                    Ok(())
                }
                Err(_) => Err(format!("cannot pull image `{image}`: {pull_err}")),
            }
        }
    }
}

/// A started container, for signalling and cleanup.
#[derive(Debug, Clone)]
pub struct Container {
    pub program: PathBuf,
    pub name: String,
}

impl Container {
    /// `docker stop --time GRACE NAME` in the background: SIGTERM to the worker,
    /// SIGKILL from Docker after the grace period.
    pub fn stop(&self, grace: Duration) {
        let (program, name) = (self.program.clone(), self.name.clone());
        let secs = grace.as_secs_f64().ceil().max(0.0) as u64;
        tokio::spawn(async move {
            let t = secs.to_string();
            if let Err(e) = docker(
                &program,
                &["stop", "--time", &t, &name],
                Some(grace + CONTROL_TIMEOUT),
            )
            .await
            {
                tracing::warn!(container = %name, "{e}");
            }
        });
    }

    /// `docker kill --signal USR1 NAME` in the background (CHECKPOINT_NOW).
    pub fn checkpoint(&self) {
        let (program, name) = (self.program.clone(), self.name.clone());
        tokio::spawn(async move {
            if let Err(e) = docker(
                &program,
                &["kill", "--signal", "USR1", &name],
                Some(CONTROL_TIMEOUT),
            )
            .await
            {
                tracing::warn!(container = %name, "{e}");
            }
        });
    }

    /// `docker rm -f NAME` in the background (stale lease, grace period over).
    pub fn kill(&self) {
        let this = self.clone();
        tokio::spawn(async move { this.remove().await });
    }

    /// `docker rm -f NAME`, waited for; "no such container" is the normal case
    /// after `--rm` and is not reported.
    pub async fn remove(&self) {
        if let Err(e) = docker(
            &self.program,
            &["rm", "-f", &self.name],
            Some(CONTROL_TIMEOUT),
        )
        .await
        {
            if e.to_ascii_lowercase().contains("no such container") {
                tracing::debug!(container = %self.name, "already removed");
            } else {
                tracing::warn!(container = %self.name, "{e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(image: &str, version: &str) -> Lease {
        Lease {
            run_id: "r1".into(),
            job_id: "j1".into(),
            image: image.into(),
            required_client_version: version.into(),
            ..Default::default()
        }
    }

    #[test]
    fn image_from_lease_or_repository_and_version() {
        assert_eq!(
            image_for_lease(&lease("", "0.1.0"), "ghcr.io/x/y").expect("ok"),
            "ghcr.io/x/y:0.1.0"
        );
        let digest = format!("registry.example:5000/dflash@sha256:{}", "ab".repeat(32));
        assert_eq!(
            image_for_lease(&lease(&digest, "0.1.0"), "r").expect("ok"),
            digest
        );
        assert_eq!(
            image_for_lease(&lease("dflash:1.2.3-rc.1", "9"), "r").expect("ok"),
            "dflash:1.2.3-rc.1"
        );
        // Hostile or malformed references never reach the command line.
        for bad in [
            "--privileged",
            "img; rm -rf /",
            "img name",
            "img@sha256:abc",
            "img@md5:0123",
            "ünïcode",
        ] {
            let err = image_for_lease(&lease(bad, "0.1.0"), "r").expect_err(bad);
            assert!(err.contains("image reference"), "{err}");
        }
        let long = "a".repeat(600);
        assert!(image_for_lease(&lease(&long, "0.1.0"), "r").is_err());
        // Build metadata cannot be a tag: the run admin must name the image.
        let err = image_for_lease(&lease("", "1.0.0+b5"), "r").expect_err("plus");
        assert!(err.contains("hint:"), "{err}");
        assert!(image_for_lease(&lease("", ""), "r").is_err());
    }

    #[test]
    fn run_arguments_are_hardened() {
        let cfg = DockerConfig {
            program: "docker".into(),
            repository: DEFAULT_IMAGE_REPOSITORY.into(),
            gpus: true,
            user: "1000:1000".into(),
            chown: None,
            ro_mounts: vec!["/models".into()],
        };
        let req = RunRequest {
            name: &container_name("j1", 2, 0),
            image: "img:1",
            job_dir: Path::new("/w/jobs/j1"),
            run_id: "r1",
            job_id: "j1",
            attempt: 2,
            resume_dir: None,
        };
        let args: Vec<String> = run_args(&cfg, &req)
            .into_iter()
            .map(|s| s.into_string().expect("utf8"))
            .collect();
        let joined = args.join(" ");
        assert_eq!(args.first().map(String::as_str), Some("run"));
        assert_eq!(args.last().map(String::as_str), Some("img:1"));
        for want in [
            "--rm",
            "--name dflash-j1-a2-r0",
            "--gpus all",
            "--cap-drop ALL",
            "--security-opt no-new-privileges",
            "--read-only",
            "--tmpfs /tmp:rw,nosuid,nodev,exec",
            "--user 1000:1000",
            "--mount type=bind,source=/w/jobs/j1,target=/w/jobs/j1 ",
            "--mount type=bind,source=/models,target=/models,readonly",
            "--sig-proxy=false",
        ] {
            assert!(joined.contains(want), "missing `{want}` in {joined}");
        }
        assert!(!joined.contains("privileged"), "{joined}");
        // The container's environment is these pairs (and the image's), nothing
        // taken from this process: no token can reach it through `--env`.
        let env: Vec<&str> = args
            .windows(2)
            .filter(|w| w[0] == "--env")
            .map(|w| w[1].as_str())
            .collect();
        assert_eq!(
            env,
            [
                "HOME=/tmp",
                "TMPDIR=/tmp",
                "USER=dflash",
                "LOGNAME=dflash",
                "PYTHONUNBUFFERED=1",
                "XDG_CACHE_HOME=/tmp/.cache",
                "TORCH_HOME=/tmp/.cache/torch",
                "TORCHINDUCTOR_CACHE_DIR=/tmp/.cache/torchinductor",
                "TRITON_CACHE_DIR=/tmp/.cache/triton",
                "HF_HOME=/tmp/.cache/huggingface",
                "MPLCONFIGDIR=/tmp/.cache/matplotlib",
            ]
        );
        // Every writable path the environment names is in the tmpfs scratch.
        for pair in &env[..2] {
            assert!(pair.ends_with("=/tmp"), "{pair}");
        }
        for pair in env.iter().filter(|p| p.contains('/')) {
            assert!(
                pair.split_once('=').expect("pair").1.starts_with("/tmp"),
                "{pair}"
            );
        }
        assert!(joined.contains("--shm-size 8g"), "{joined}");
        let cpu = DockerConfig { gpus: false, ..cfg };
        let joined: Vec<OsString> = run_args(&cpu, &req);
        assert!(!joined.iter().any(|a| a == "--gpus"));
    }

    #[test]
    fn mount_paths_and_program_lookup() {
        assert!(check_mount_path(Path::new("/w/jobs/j1")).is_ok());
        assert!(check_mount_path(Path::new("relative")).is_err());
        let err = check_mount_path(Path::new("/w/a,b")).expect_err("comma");
        assert!(err.contains("hint:"), "{err}");
        // `sh` is on every PATH these tests run with; a missing name is None.
        let path = std::env::var_os("PATH");
        assert!(find_program(Path::new("sh"), path.as_deref()).is_some());
        assert!(find_program(Path::new("no-such-docker-here"), path.as_deref()).is_none());
        assert!(find_program(Path::new("/nonexistent/docker"), path.as_deref()).is_none());
        let err = find_docker(Some(Path::new("/nonexistent/docker"))).expect_err("missing");
        assert_eq!(err.exit_code(), 1);
        assert!(err.to_string().contains("hint:"), "{err}");
    }

    #[test]
    fn root_runs_the_container_as_the_image_user_and_hands_it_the_job_dir() {
        assert_eq!(container_user(1000, 1001), ("1000:1001".into(), None));
        assert_eq!(
            container_user(0, 0),
            ("10001:10001".into(), Some((10001, 10001)))
        );
        // Handing over: every entry, symlinks themselves (never their targets).
        // Only root may give files away; elsewhere the plain case (no chown) is checked.
        let dir = std::env::temp_dir().join(format!("rm-docker-chown-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("job/run/checkpoints")).expect("mkdir");
        std::fs::write(dir.join("job/spec.json"), "{}").expect("write");
        std::fs::write(dir.join("outside"), "x").expect("write");
        std::os::unix::fs::symlink(dir.join("outside"), dir.join("job/link")).expect("symlink");
        let mut cfg = DockerConfig {
            program: "docker".into(),
            repository: "r".into(),
            gpus: false,
            user: "1:1".into(),
            chown: None,
            ro_mounts: vec![],
        };
        prepare_job_dir(&cfg, &dir.join("job")).expect("no-op");
        // SAFETY: getuid cannot fail and has no preconditions.
        if unsafe { libc::getuid() } == 0 {
            use std::os::unix::fs::MetadataExt;
            cfg.chown = Some((CONTAINER_UID, CONTAINER_UID));
            prepare_job_dir(&cfg, &dir.join("job")).expect("chown");
            for p in ["job", "job/run", "job/run/checkpoints", "job/spec.json"] {
                let m = std::fs::metadata(dir.join(p)).expect("stat");
                assert_eq!((m.uid(), m.gid()), (CONTAINER_UID, CONTAINER_UID), "{p}");
            }
            let link = std::fs::symlink_metadata(dir.join("job/link")).expect("lstat");
            assert_eq!(link.uid(), CONTAINER_UID);
            let target = std::fs::metadata(dir.join("outside")).expect("stat");
            assert_eq!(target.uid(), 0, "the symlink's target was changed");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn pull_falls_back_to_a_local_image_only_when_present() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("rm-docker-pull-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        // A stand-in docker whose registry is unreachable; `image inspect`
        // succeeds only for `local:1`.
        let script = dir.join("docker");
        std::fs::write(
            &script,
            "#!/bin/sh\ncase \"$1\" in\n  pull) echo 'registry unreachable' >&2; exit 1 ;;\n  image) [ \"$5\" = local:1 ] && exit 0; echo 'No such image' >&2; exit 1 ;;\nesac\nexit 2\n",
        )
        .expect("write");
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let cfg = DockerConfig {
            program: script,
            repository: "r".into(),
            gpus: false,
            user: "0:0".into(),
            chown: None,
            ro_mounts: vec![],
        };
        assert_eq!(pull(&cfg, "local:1").await, Ok(()));
        let err = pull(&cfg, "remote:1").await.expect_err("absent");
        assert!(
            err.contains("cannot pull image `remote:1`") && err.contains("registry unreachable"),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
