"""Docker launch mode against a real engine: the CPU image (scripts/build-cpu-image.sh) runs the whole job
in a hardened container, `run-manager --launch-mode docker` driving the real `docker` CLI.

- the full pipeline in the container, artifacts reported, and `docker inspect` of the job's own container
  (captured while it runs) showing the hardening: CapDrop ALL, ReadonlyRootfs, not Privileged,
  no-new-privileges, the tmpfs, `/dev/shm`, a non-root user, the read-only model mount;
- a probe container with exactly that container's settings checks what they allow and forbid
  (each fix the hardened container needed: writable paths, HOME / cache / temp variables, `/dev/shm`,
  the non-root uid with and without a passwd entry, the read-only mount);
- cancel -> `docker stop` -> the container is gone; the provider token is in no layer, no image setting
  and not in the container's configuration;
- SIGKILL of the container -> a restart from the last checkpoint with the undisturbed run's export sha256.

Where no Docker engine can be started (not root, no apt-get: a developer's Mac) every test here skips with
the reason (fails instead under `DFLASH_REQUIRE_DOCKER=1`); as root on Debian (CI here)
scripts/ensure-docker.sh installs and starts one.
`DFLASH_TEST_ARTIFACTS`, when set, receives the captured `docker inspect`, `docker history` and build timings.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from e2e_helpers import (
    STEPS,
    client_version,
    export_model,
    is_checkpoint_queued,
    is_checkpoint_report,
    local_path,
    metrics_steps,
    sha256_file,
)
from launchers import REPO, wait_until

pytestmark = pytest.mark.slow

BUILD = REPO / "scripts" / "build-cpu-image.sh"
# What the run-manager sets (run-manager/src/worker/docker.rs): uid 10001 when it runs as root.
CONTAINER_UID = 10001
SHM_BYTES = 8 << 30
CACHE_VARS = ("XDG_CACHE_HOME", "TORCH_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "HF_HOME", "MPLCONFIGDIR")
SECRET_NAME = re.compile(r"(^AWS_|SECRET|_TOKEN$|_TOKEN_FILE$|_KEY$|_PASSWORD$)", re.I)


def docker(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    p = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"`docker {' '.join(args)}` exited {p.returncode}:\n{p.stderr}")
    return p


def record(name: str, text: str, tmp: Path) -> Path:
    """Save `text` as `name` in `tmp` and, when set, in $DFLASH_TEST_ARTIFACTS."""
    path = tmp / name
    path.write_text(text)
    if out := os.environ.get("DFLASH_TEST_ARTIFACTS"):
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(out) / name)
    return path


@pytest.fixture(scope="session")
def image(tmp_path_factory) -> str:
    """The CPU image, built (or found cached) by scripts/build-cpu-image.sh; skips only when no engine can run here."""
    t0 = time.monotonic()
    p = subprocess.run([str(BUILD)], capture_output=True, text=True, timeout=3600, cwd=REPO)
    took = time.monotonic() - t0
    if p.returncode == 3:
        why = f"no Docker engine here: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else 'ensure-docker failed'}"
        if os.environ.get("DFLASH_REQUIRE_DOCKER") == "1":
            pytest.fail(f"{why} (DFLASH_REQUIRE_DOCKER=1)", pytrace=False)
        pytest.skip(why)
    assert p.returncode == 0, f"build-cpu-image.sh exited {p.returncode}:\n{p.stderr}"
    ref = p.stdout.strip().splitlines()[-1]
    tmp = tmp_path_factory.mktemp("image")
    record("docker-build.log", f"{ref} ready in {took:.1f} s (this session)\n{p.stderr}", tmp)
    return ref


@pytest.fixture(scope="session")
def models(world) -> Path:
    """The world, world-readable (the container's uid reads it as "other"), to mount read-only."""
    root = Path(world.root)
    for dirpath, _dirs, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for f in filenames:
            fp = os.path.join(dirpath, f)
            if not os.path.islink(fp):
                os.chmod(fp, 0o644)
    # (Its parents need no change: in the container, the directories above a mount are Docker's own.)
    return root.resolve()


class ContainerWatch:
    """Capture `docker inspect` of the job's container while it runs (from the run-manager's log line)."""

    def __init__(self, rm):
        self.rm = rm

    def started(self, start: int = 0) -> dict:
        return self.rm.wait_for("a container to start", lambda v: "container" in v and str(v.get("message", "")).startswith("worker started"))

    def inspect(self, name: str) -> dict:
        def get():
            p = docker("inspect", name, check=False)
            return json.loads(p.stdout)[0] if p.returncode == 0 else None

        return wait_until(get, timeout=60, interval=0.1, what=f"`docker inspect {name}`")


def run_docker_job(procs, tmp_path: Path, name: str, spec: dict, image: str, models: Path, *extra: str):
    spec_file = tmp_path / "run.json"
    spec_file.write_text(json.dumps({"name": name, "spec": spec, "image": image}))
    work = tmp_path / "work"
    rm = procs.run_manager(
        work, "--local", "--json", "--spec", str(spec_file), "--launch-mode", "docker", "--docker-mount", str(models), *extra,
        native_client=False,
    )  # fmt: skip
    return rm, work


def remove_containers(rm) -> None:
    for v in rm.messages(lambda v: "container" in v):
        docker("rm", "-f", v["container"], check=False)


def gone(name: str) -> bool:
    return docker("ps", "-a", "--filter", f"name=^{name}$", "--format", "{{.Names}}").stdout.strip() == ""


@pytest.fixture(scope="session")
def docker_run(tmp_path_factory, spec, image, models, world, session_procs):
    """One undisturbed run of the pipeline in the container; `docker inspect` of its container, captured mid-run."""
    tmp = tmp_path_factory.mktemp("docker-run")
    procs = session_procs
    try:
        t0 = time.monotonic()
        rm, work = run_docker_job(procs, tmp, "docker-pipeline", spec, image, models)
        started = ContainerWatch(rm).started()
        inspect = ContainerWatch(rm).inspect(started["container"])
        rc = rm.wait(timeout=900)
        took = time.monotonic() - t0
        assert rc == 0, f"stdout:\n{rm.stdout}\nstderr:\n{rm.text()}"
    finally:
        remove_containers(rm)
        procs.cleanup()
    record("docker-inspect-job.json", json.dumps(inspect, indent=1), tmp)
    return {"rm": rm, "work": work, "inspect": inspect, "started": started, "summary": json.loads(rm.stdout), "seconds": took}


def test_full_pipeline_runs_in_the_hardened_container(docker_run, image, baseline, models):
    summary, inspect = docker_run["summary"], docker_run["inspect"]
    (job,) = summary["jobs"]
    assert job["state"] == "succeeded" and job["attempts"] == 1, json.dumps(summary, indent=1)
    job_dir = (docker_run["work"] / "jobs" / job["job_id"]).resolve()
    model = export_model(job)
    path = local_path(job_dir, model)
    assert path == job_dir / "run" / "export" / "model.safetensors"
    assert model["sha256"] == sha256_file(path)
    kinds = {a["kind"] for a in job["artifacts"]}
    assert {"checkpoint", "export", "report", "manifest", "capture"} <= kinds, kinds
    assert metrics_steps(job_dir / "run") == list(range(1, STEPS + 1))
    report = json.loads((job_dir / "eval" / "report.json").read_text())
    assert report["prompts"] == 2, report
    # Same torch on another Python build (Debian's 3.11.2 in the image, this environment's here): same bytes.
    assert model["sha256"] == baseline.export_sha256, "the container's export differs from the native run's"

    # The job's own container, as Docker ran it.
    assert inspect["Config"]["Image"] == image
    assert inspect["Name"] == "/" + docker_run["started"]["container"]
    hc = inspect["HostConfig"]
    assert hc["CapDrop"] == ["ALL"] and not hc.get("CapAdd"), (hc["CapDrop"], hc.get("CapAdd"))
    assert hc["ReadonlyRootfs"] is True
    assert hc["Privileged"] is False
    assert "no-new-privileges" in hc["SecurityOpt"], hc["SecurityOpt"]
    assert hc["ShmSize"] == SHM_BYTES
    assert set(hc["Tmpfs"]) == {"/tmp"}, hc["Tmpfs"]
    assert hc["Init"] is True and hc["AutoRemove"] is True
    assert hc["NetworkMode"] != "host" and hc["PidMode"] == "" and hc["IpcMode"] != "host", hc
    uid = CONTAINER_UID if os.getuid() == 0 else os.getuid()
    assert inspect["Config"]["User"].split(":")[0] == str(uid), inspect["Config"]["User"]
    mounts = {m["Destination"]: m for m in inspect["Mounts"]}
    assert set(mounts) == {str(job_dir), str(models)}, mounts
    assert mounts[str(job_dir)]["RW"] is True and mounts[str(models)]["RW"] is False, mounts
    env = dict(e.split("=", 1) for e in inspect["Config"]["Env"])
    assert env["HOME"] == env["TMPDIR"] == "/tmp" and env["USER"] == env["LOGNAME"] == "dflash", env
    assert all(env[k].startswith("/tmp/") for k in CACHE_VARS), env
    assert not [k for k in env if SECRET_NAME.search(k)], env
    # Files the container wrote belong to its user, and the container is gone (`--rm`, then `docker rm -f`).
    assert path.stat().st_uid == uid
    assert gone(docker_run["started"]["container"])


PROBE = r"""
import errno, getpass, json, os, sys, tempfile
job, ro = sys.argv[1], sys.argv[2]
out = {"uid": os.getuid(), "gid": os.getgid()}
status = dict(l.split(":\t", 1) for l in open("/proc/self/status").read().splitlines() if ":\t" in l)
out["CapEff"], out["NoNewPrivs"] = status["CapEff"].strip(), status["NoNewPrivs"].strip()
def writable(d):
    try:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, ".probe"), "w") as f:
            f.write("x")
        os.unlink(os.path.join(d, ".probe"))
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
out["write"] = {d: writable(d) for d in ["/", "/opt/dflash/venv", "/etc", "/tmp", os.environ["HOME"], job, ro]}
out["write_cache"] = {k: writable(os.environ[k]) for k in %(cache)r}
out["tempdir"] = tempfile.gettempdir()
try:
    out["user"] = getpass.getuser()
except Exception as e:
    out["user"] = "error: " + type(e).__name__
fd = os.open("/dev/shm/probe", os.O_CREAT | os.O_RDWR)
try:
    os.posix_fallocate(fd, 0, 256 << 20)
    out["shm_256m"] = "ok"
except OSError as e:
    out["shm_256m"] = errno.errorcode.get(e.errno, str(e.errno))
finally:
    os.close(fd)
    os.unlink("/dev/shm/probe")
st = os.statvfs("/dev/shm")
out["shm_bytes"] = st.f_blocks * st.f_frsize
if sys.argv[3] == "torch":
    import torch
    out["torch"] = torch.__version__
    x = torch.randn(64, 64)
    out["matmul"] = float((x @ x.T).trace()) > 0
print(json.dumps(out))
"""


def probe_args(inspect: dict, *, user: str | None = None, drop_env: tuple[str, ...] = (), extra_env: tuple[str, ...] = ()) -> list[str]:
    """`docker run` arguments rebuilt from a container's inspect: the same user, capabilities, options, mounts and env."""
    hc, cfg = inspect["HostConfig"], inspect["Config"]
    args = ["run", "--rm", "--network", "none", "--user", user or cfg["User"]]
    args += [a for c in hc["CapDrop"] for a in ("--cap-drop", c)]
    args += [a for o in hc["SecurityOpt"] for a in ("--security-opt", o)]
    args += ["--read-only"] if hc["ReadonlyRootfs"] else []
    args += [a for d, o in hc["Tmpfs"].items() for a in ("--tmpfs", f"{d}:{o}" if o else d)]
    args += ["--shm-size", str(hc["ShmSize"])]
    for m in inspect["Mounts"]:
        args += ["--mount", f"type=bind,source={m['Source']},target={m['Destination']}" + ("" if m["RW"] else ",readonly")]
    for e in cfg["Env"]:
        if e.split("=", 1)[0] not in drop_env:
            args += ["--env", e]
    args += [a for e in extra_env for a in ("--env", e)]
    return args + ["--entrypoint", "/opt/dflash/venv/bin/python", cfg["Image"]]


def run_probe(inspect: dict, job_dir: Path, ro: Path, *, torch: bool = False, **kw) -> dict:
    """Run PROBE in a container like the job's; `torch` also imports torch there and multiplies (one probe does)."""
    what = "torch" if torch else "settings"
    p = docker(*probe_args(inspect, **kw), "-c", PROBE % {"cache": CACHE_VARS}, str(job_dir), str(ro), what, timeout=300)
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_probe_with_the_job_containers_settings_finds_each_fix_in_place(docker_run, models, tmp_path):
    inspect = docker_run["inspect"]
    job_dir = Path(next(m["Source"] for m in inspect["Mounts"] if m["RW"]))
    got = run_probe(inspect, job_dir, models, torch=True)
    record("docker-probe.json", json.dumps(got, indent=1), tmp_path)
    uid = CONTAINER_UID if os.getuid() == 0 else os.getuid()
    assert got["uid"] == uid != 0, got
    assert got["CapEff"] == "0000000000000000" and got["NoNewPrivs"] == "1", got
    # Writable: only the job directory and the tmpfs (HOME and every cache under it).
    w = got["write"]
    assert w["/"] == w["/opt/dflash/venv"] == w["/etc"] == "EROFS", w
    assert w["/tmp"] == w[str(job_dir)] == "ok", w
    assert w[str(models)] == "EROFS", w
    assert set(got["write_cache"].values()) == {"ok"}, got["write_cache"]
    assert got["tempdir"] == "/tmp" and got["user"] == "dflash", got
    # /dev/shm holds a data loader's batches (Docker's default is 64 MiB).
    assert got["shm_256m"] == "ok" and got["shm_bytes"] == SHM_BYTES, got
    assert got["torch"].startswith("2.13.0") and got["matmul"] is True, got

    # A run-manager that is not root runs the container as its own uid, which has no passwd entry in the
    # image: USER/LOGNAME make `getpass.getuser()` (torch's compile caches call it) work there ...
    nobody = run_probe(inspect, job_dir, models, user="23456:23456")
    assert nobody["uid"] == 23456 and nobody["user"] == "dflash" and nobody["write"]["/tmp"] == "ok", nobody
    # ... and without them it fails: the fix is what makes it work.
    bare = run_probe(inspect, job_dir, models, user="23456:23456", drop_env=("USER", "LOGNAME"))
    assert bare["user"] == "error: KeyError" or bare["user"].startswith("error:"), bare
    # Without HOME in the tmpfs, the image's own default cache location is read-only for this uid.
    # With HOME on the read-only root (what a uid's passwd home would be), the cache variables still keep
    # every cache in the tmpfs (without them each one would follow HOME onto the read-only root).
    ro_home = run_probe(inspect, job_dir, models, extra_env=("HOME=/home/dflash",))
    assert ro_home["write"]["/home/dflash"] == "EROFS" and set(ro_home["write_cache"].values()) == {"ok"}, ro_home


def test_image_history_and_no_secrets(image, docker_run, tmp_path):
    hist = docker("history", "--no-trunc", "--format", "{{.Size}}\t{{.CreatedBy}}", image).stdout
    size = docker("image", "inspect", "--format", "{{.Size}}", image).stdout.strip()
    record("docker-history.txt", f"image {image}: {int(size) / 1e9:.2f} GB\n{hist}", tmp_path)
    # The image is the base, the environment, the user and this package, nothing else.
    assert "dflash-native-client" in hist and "pip install --no-cache-dir --no-deps /tmp/dist/" in hist, hist
    cfg = json.loads(docker("image", "inspect", image).stdout)[0]["Config"]
    names = [e.split("=", 1)[0] for e in cfg["Env"] or []]
    assert not [n for n in names if SECRET_NAME.search(n)], names
    assert not re.search(r"(TOKEN|SECRET|PASSWORD|_KEY)=", hist, re.I), hist
    # Its build context held only the lock, the wheels and the project wheel: nothing from this
    # machine's home or environment can be in a layer.
    ctx = Path(os.environ.get("DFLASH_CACHE_DIR", Path.home() / ".cache" / "dflash-worker")) / "docker-context"
    (lock_ctx,) = [d for d in ctx.iterdir() if d.name == cfg["Labels"]["dflash.lock"]]
    assert sorted(p.name for p in lock_ctx.iterdir()) == ["project-wheel", "requirements", "wheels"]
    assert [p.name for p in (lock_ctx / "requirements").iterdir()] == ["lock.txt"]
    assert all(p.suffix == ".whl" or p.name == ".complete" for p in (lock_ctx / "wheels").iterdir())
    assert [p.suffix for p in (lock_ctx / "project-wheel").iterdir()] == [".whl"]
    # The running job's container got no secret through its configuration (its env, command or labels).
    job_cfg = json.dumps(docker_run["inspect"]["Config"])
    assert not re.search(r"TOKEN|SECRET|PASSWORD", job_cfg, re.I), job_cfg


def test_cancel_stops_the_container_and_the_token_never_reaches_it(procs, tmp_path, spec, image, models):
    coord = procs.coordinator(tmp_path / "coord", lease_ttl=30, warm=True)
    coord.create_run("docker-cancel", spec, "--image", image, client_version=client_version())
    token = coord.provider_token("docker-box")
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    rm = procs.run_manager(
        tmp_path / "work", "--coordinator", coord.address, "--token-file", str(token_file), "--max-jobs", "1",
        "--launch-mode", "docker", "--docker-mount", str(models), "--grace-period", "30", native_client=False,
    )  # fmt: skip
    try:
        started = ContainerWatch(rm).started()
        name = started["container"]
        inspect = ContainerWatch(rm).inspect(name)
        # The token is in the run-manager's hands only: not in the container's env, command, labels or mounts.
        assert token not in json.dumps(inspect), "the provider token reached the container's configuration"
        assert str(token_file) not in json.dumps(inspect)
        assert token not in docker("history", "--no-trunc", image).stdout
        rm.wait_for("a checkpoint", is_checkpoint_report, timeout=600)
        coord.cli("jobs", "cancel", started["job_id"])
        rc = rm.wait(timeout=300)
        assert rc == 0, rm.text()
        # SIGTERM through `docker stop`, the worker checkpointed, and the container is gone.
        wait_until(lambda: gone(name), timeout=60, what=f"container {name} to be removed")
        assert coord.job_state(started["job_id"]) == "cancelled", coord.attempt_messages(started["job_id"])
        stopped = rm.messages(lambda v: "cancel" in str(v.get("message", "")).lower())
        assert stopped, rm.text()
    finally:
        remove_containers(rm)


def _worker_host_pid(container: str) -> int:
    """The native client's pid on this machine: the child of the container's init (`--init`)."""
    init = int(docker("inspect", "--format", "{{.State.Pid}}", container).stdout)
    children = Path(f"/proc/{init}/task/{init}/children").read_text().split()
    (pid,) = [int(c) for c in children if "dflash-native-client" in Path(f"/proc/{c}/cmdline").read_bytes().decode(errors="replace")]
    return pid


def test_sigkilled_container_restarts_from_its_checkpoint_to_the_same_export(procs, tmp_path, spec, image, models, docker_run):
    rm, work = run_docker_job(procs, tmp_path, "docker-crash", spec, image, models)
    try:
        started = ContainerWatch(rm).started()
        name = started["container"]
        job_dir = (work / "jobs" / started["job_id"]).resolve()
        rm.wait_for("a checkpoint event", is_checkpoint_queued, timeout=600)
        # Hold the worker still (as test_e2e_crash does) until its checkpoint is reported, then kill the container.
        os.kill(_worker_host_pid(name), signal.SIGSTOP)
        rm.wait_for("a committed checkpoint", is_checkpoint_report)
        docker("kill", "--signal", "KILL", name)
        rc = rm.wait(timeout=900)
        assert rc == 0, f"stdout:\n{rm.stdout}\nstderr:\n{rm.text()}"
    finally:
        remove_containers(rm)
    crash = rm.wait_for("the restart", lambda v: "restarting from checkpoint at step" in str(v.get("message", "")))
    step = int(re.search(r"restarting from checkpoint at step (\d+)", crash["message"]).group(1))
    assert 0 < step < STEPS, crash
    names = [v["container"] for v in rm.messages(lambda v: "container" in v and str(v.get("message", "")).startswith("worker started"))]
    assert names == [name, name.replace("-r0", "-r1")], names
    assert gone(names[0]) and gone(names[1])
    (job,) = json.loads(rm.stdout)["jobs"]
    assert job["state"] == "succeeded" and job["attempts"] == 1, job
    model = export_model(job)
    assert model["sha256"] == sha256_file(local_path(job_dir, model))
    undisturbed = export_model(docker_run["summary"]["jobs"][0])["sha256"]
    assert model["sha256"] == undisturbed, "the restarted container's export differs from the undisturbed run's"
    assert metrics_steps(job_dir / "run") == list(range(1, STEPS + 1))


def test_ensure_docker_exits_3_with_the_reason_where_no_engine_can_be_had(tmp_path):
    """The one case the tests skip for (exit 3): not root and no engine answering. Runs without the image."""
    env = {**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/no-such.sock"}
    cmd = ["bash", str(REPO / "scripts" / "ensure-docker.sh")]
    if os.getuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without `setpriv` to drop to another uid")
        cmd = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 3, (p.returncode, p.stderr)
    assert "no Docker engine answers" in p.stderr and "not root" in p.stderr, p.stderr
