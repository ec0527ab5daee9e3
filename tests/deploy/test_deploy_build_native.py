"""scripts/build-native-linux.sh: a release build whose native client runs a job with an empty environment.

Slow: a release build (cargo reuses CARGO_TARGET_DIR, the Makefile's shared
cache by default, so only the first run on a machine compiles everything), here
without the release profile's LTO and optimization, incrementally.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "build-native-linux.sh"
EMPTY_ENV = {"PATH": "/usr/bin:/bin"}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="builds Linux binaries"),
]


def noop_final_state(steps: int) -> str:
    """The noop stage's state after `steps` steps, computed independently of dflash_worker.job."""
    state = hashlib.sha256(b"dflash-noop-v1").hexdigest()
    for k in range(1, steps + 1):
        state = hashlib.sha256(f"{state}:{k}".encode()).hexdigest()
    return state


def runpaths(binary: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(binary)], capture_output=True, text=True, check=True).stdout
    found = []
    for m in re.finditer(r"\((?:RUNPATH|RPATH)\)\s+Library (?:runpath|rpath): \[([^\]]*)\]", out):
        found.extend(p for p in m.group(1).split(":") if p)
    return found


def noop_job(tmp: Path, steps: int) -> Path:
    job = tmp / "job"
    job.mkdir()
    spec = {"schema_version": 1, "spec": {"stages": ["noop"], "noop": {"steps": steps, "step_seconds": 0, "checkpoint_every": 2}}}
    (job / "spec.json").write_text(json.dumps(spec))
    return job


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed")
    out = tmp_path_factory.mktemp("native")
    env = dict(os.environ)
    env.setdefault("CARGO_TARGET_DIR", str(Path.home() / ".cache" / "dflash-worker" / "cargo-target"))
    # The release profile's thin LTO took 90 of the 120 CPU seconds of rebuilding the workspace
    # crates (each commit rebuilds them: the binary embeds it) and changes nothing checked here
    # (rpaths, build info, the empty-environment job); cargo reads the override from the environment.
    env.setdefault("CARGO_PROFILE_RELEASE_LTO", "off")
    # For the same reason, opt-level 0 and incremental compilation: the release build then recompiles the two
    # workspace crates a new commit changes in a fraction of the ~100 CPU seconds it took optimized (each
    # commit's build replaces the last one's: the profile's own artifacts are distinct from an optimized build's).
    env.setdefault("CARGO_PROFILE_RELEASE_OPT_LEVEL", "0")
    env.setdefault("CARGO_PROFILE_RELEASE_INCREMENTAL", "true")
    python = Path(sys.prefix) / "bin" / "python"
    r = subprocess.run([str(SCRIPT), "--python", str(python), "--out", str(out)], capture_output=True, text=True, env=env, timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    import torch

    assert f"torch {torch.__version__}" in r.stderr, r.stderr
    assert "CUDA available: " in r.stderr, r.stderr
    assert "runs a noop job with an empty environment" in r.stderr, r.stderr  # the script's own check ran
    return out


def test_binaries_and_build_info(built):
    for name in ("dflash-native-client", "run-manager"):
        assert os.access(built / name, os.X_OK), name
    info = json.loads((built / "build-info.json").read_text())
    assert info["python_home"] == sys.prefix
    assert info["python_libdir"] == sysconfig.get_config_var("LIBDIR")
    import torch

    assert info["torch_version"] == torch.__version__
    assert info["native_client_version"].startswith("dflash-native-client "), info
    r = subprocess.run([str(built / "run-manager"), "--version"], capture_output=True, text=True, env=EMPTY_ENV, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("run-manager "), r


def test_readelf_shows_python_and_torch_rpaths(built):
    import torch

    paths = runpaths(built / "dflash-native-client")
    assert sysconfig.get_config_var("LIBDIR") in paths, paths
    assert str(Path(torch.__file__).parent / "lib") in paths, paths


def test_native_client_runs_a_noop_job_with_an_empty_environment(built, tmp_path):
    steps = 3
    job = noop_job(tmp_path, steps)
    r = subprocess.run([str(built / "dflash-native-client"), "--job-dir", str(job)], capture_output=True, text=True, env=EMPTY_ENV, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    events = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    assert events[-1] == {"event": "done"}, events
    report = next(e for e in events if e["event"] == "artifact" and e["kind"] == "report")
    data = Path(report["path"]).read_bytes()
    assert hashlib.sha256(data).hexdigest() == report["sha256"]
    assert json.loads(data)["state"] == noop_final_state(steps)
    # Logs are the worker's JSON lines on stderr.
    assert any(json.loads(line).get("logger", "").startswith("dflash_worker") for line in r.stderr.splitlines() if line.startswith("{"))


def test_without_the_recorded_environment_the_job_cannot_import(tmp_path):
    # Control: the development build (no environment recorded at build time),
    # moved out of its venv and run with an empty environment, cannot find
    # dflash_worker. This is what the build script's recorded home fixes.
    dev = Path(sys.prefix) / "bin" / "dflash-native-client"
    if not dev.exists():
        pytest.skip("no development native client in this environment (run `make install`)")
    copy = tmp_path / "bin" / "dflash-native-client"
    copy.parent.mkdir()
    shutil.copy2(dev, copy)
    job = noop_job(tmp_path, 1)
    r = subprocess.run([str(copy), "--job-dir", str(job)], capture_output=True, text=True, env=EMPTY_ENV, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "dflash_worker" in r.stdout + r.stderr
