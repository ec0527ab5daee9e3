"""Fixtures for the end-to-end tests: the tiny world, the job spec, process cleanup, the uninterrupted baseline."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
from e2e_helpers import cmdline, export_model, local_path, missing_binaries, pid_alive, pipeline_spec, sha256_file
from launchers import NATIVE_CLIENT, Coordinator, RunManager


@pytest.fixture(scope="session")
def binaries() -> None:
    missing = missing_binaries()
    if missing:
        pytest.fail(f"missing binaries {missing}\nhint: run `make install`", pytrace=False)


def _world(tmp_path_factory, family: str, **target_kwargs):
    from dflash_worker.testing.world import build_world

    return build_world(tmp_path_factory.mktemp(f"world-{family}"), family=family, **target_kwargs)


@pytest.fixture(scope="session")
def world(tmp_path_factory, binaries):
    """The demo's world: a Qwen3 target."""
    return _world(tmp_path_factory, "qwen3")


# At `build_world`'s default seed (0) the tiny Qwen3.5-MoE teacher answers the evaluated test prompts
# with its stop token at once, so an evaluation would verify nothing; from this seed it generates.
QWEN3_5_MOE_WORLD_SEED = 1


@pytest.fixture(scope="session")
def qwen3_5_moe_world(tmp_path_factory, binaries):
    """A Qwen3.5-MoE target as released: the multimodal wrapper (vision tower, `mtp.*` shard), experts packed."""
    return _world(tmp_path_factory, "qwen3_5_moe", expert_layout="packed", seed=QWEN3_5_MOE_WORLD_SEED)


@pytest.fixture(scope="session")
def spec(world) -> dict:
    return pipeline_spec(world)


class Processes:
    """Everything a test started (tests/launchers.py: real unless a call says `warm=True`); whatever is still
    alive at teardown is killed, one pid at a time."""

    def __init__(self):
        self.coordinators: list[Coordinator] = []
        self.run_managers: list[RunManager] = []

    def coordinator(self, workdir: Path, **kw) -> Coordinator:
        c = Coordinator(workdir, **kw)
        self.coordinators.append(c)
        return c.start()

    def run_manager(self, work_dir: Path, *args: str, **kw) -> RunManager:
        rm = RunManager(work_dir, *args, **kw)
        self.run_managers.append(rm)
        return rm

    def cleanup(self) -> None:
        for rm in self.run_managers:
            if rm.proc.poll() is None:
                rm.proc.send_signal(signal.SIGKILL)
                rm.proc.wait(30)
            # A SIGKILLed run-manager leaves its worker behind: end it (only if it is still ours).
            for pid in rm.worker_pids():
                argv = cmdline(pid)
                if pid_alive(pid) and argv and os.path.basename(argv[0]) == NATIVE_CLIENT.name and str(rm.work_dir.resolve()) in " ".join(argv):
                    os.kill(pid, signal.SIGKILL)
        for c in self.coordinators:
            c.stop()


@pytest.fixture
def procs():
    p = Processes()
    yield p
    p.cleanup()


@pytest.fixture(scope="session")
def session_procs():
    """`procs` for session-scoped fixtures (a test module must not import this file: `conftest` names
    whichever tests/*/conftest.py pytest loaded first)."""
    p = Processes()
    yield p
    p.cleanup()


@dataclass(frozen=True)
class Baseline:
    """An uninterrupted `run-manager --local` run of `spec` in the native client.

    Real on purpose: the crash, rank, graph, trust, liar and verify tests compare their exports (most from warm
    jobs) with this one byte for byte, so a warm job that differed from the native client would show. Being
    session-scoped it serves tests of both kinds, and its launch is not held to a `real_process` marker.
    """

    work: Path
    summary: dict
    stderr: str
    export_sha256: str


@pytest.fixture(scope="session")
def baseline(tmp_path_factory, spec) -> Baseline:
    root = tmp_path_factory.mktemp("baseline")
    spec_file = root / "run.json"
    spec_file.write_text(json.dumps({"name": "baseline", "spec": spec}))
    procs = Processes()
    try:
        rm = procs.run_manager(root / "work", "--local", "--json", "--spec", str(spec_file))
        rc = rm.wait()
        assert rc == 0, f"stdout:\n{rm.stdout}\nstderr:\n{rm.text()}"
    finally:
        procs.cleanup()
    summary = json.loads(rm.stdout)
    job = summary["jobs"][0]
    model = export_model(job)
    job_dir = (root / "work" / "jobs" / job["job_id"]).resolve()
    return Baseline(root / "work", summary, rm.text(), sha256_file(local_path(job_dir, model)))
