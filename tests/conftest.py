"""Suite-wide hooks: heaviest test files first, and a way to re-measure what "heavy" is.

`make test` runs the files on every core (`scripts/run-pytest.sh`: pytest-xdist, one file per
worker at a time, `--no-loadscope-reorder`). A worker that picks up a 4-minute file near the end
leaves the other core idle for those minutes, so the files are collected longest first (longest
processing time first), by the seconds `tests/durations.json` records per file; files it does not
name keep their order after the ones it does. Refresh it after a full run with
`DFLASH_RECORD_DURATIONS=tests/durations.json scripts/run-pytest.sh` (setup, call and teardown
seconds summed per file, written by the controlling process at the end of the session). The same
run writes `FILE.cpu.json`: per file, wall seconds, CPU seconds (the worker's own and its waited-for
child processes', user + system) and their ratio, to see which files wait more than they compute.

Run outside `make`, the session first sets the cargo environment the Makefile exports
(scripts/cargo-env.py), so the tests that build Rust reuse `make`'s builds instead of rebuilding.

The `real_process` marker: each test's setup and call tell tests/warm_worker.py which test runs and which
real processes its marker asks for, so every launcher (tests/launchers.py) can hold its warm-or-real choice
against it; a marker naming no known kind stops the session at collection.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
from pathlib import Path

import pytest
import warm_worker

DURATIONS = Path(__file__).resolve().parent / "durations.json"
RECORD_ENV = "DFLASH_RECORD_DURATIONS"
_recorded: dict[str, float] = {}
_recorded_cpu: dict[str, float] = {}
ROOT = Path(__file__).resolve().parents[1]
# vLLM's interop tests run only in vLLM's own environment (`make interop-vllm`, scripts/interop-vllm.sh);
# SGLang's and llama.cpp's need theirs (`make interop-sglang`, `make interop-llamacpp`).
collect_ignore = ["interop_vllm", "interop_sglang", "interop_llamacpp"]


def _set_cargo_env() -> None:
    """The Makefile's cargo environment, where `make` did not set it (scripts/cargo-env.py)."""
    if "DFLASH_RUST_SOURCES" in os.environ:
        return
    spec = importlib.util.spec_from_file_location("dflash_cargo_env", ROOT / "scripts" / "cargo-env.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    os.environ["DFLASH_RUST_SOURCES"] = mod.sources_hash(ROOT)
    os.environ.setdefault("DFLASH_GIT_COMMIT", mod.commit(ROOT))
    os.environ.setdefault("PYO3_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    os.environ.setdefault("PYO3_ENVIRONMENT_SIGNATURE", mod.pyo3_signature())


_set_cargo_env()


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _weights() -> dict[str, float]:
    try:
        data = json.loads(DURATIONS.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items() if isinstance(v, (int, float))} if isinstance(data, dict) else {}


def _check_real_process_markers(items) -> None:
    for item in items:
        problem = warm_worker.marker_problem([m.args for m in item.iter_markers("real_process")])
        if problem:
            raise pytest.UsageError(f"`{item.nodeid}`: {problem}")


def pytest_collection_modifyitems(session, config, items):
    _check_real_process_markers(items)
    weights = _weights()
    if not weights:
        return
    first = {}
    for i, item in enumerate(items):
        first.setdefault(_file_of(item.nodeid), i)
    # a stable sort on the file's weight keeps each file's own order and the others' collection order
    items.sort(key=lambda item: (-weights.get(_file_of(item.nodeid), 0.0), first[_file_of(item.nodeid)]))


def _cpu_seconds() -> float:
    """User + system seconds of this process and of its children that have been waited for."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _phase_start(item) -> None:
    item._dflash_cpu0 = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    if os.environ.get(RECORD_ENV):
        _phase_start(item)
    warm_worker.enter_test(item.nodeid, [m.args for m in item.iter_markers("real_process")])
    yield


class _SharedFixtureSetups:
    """A module- or session-scoped fixture serves tests of both kinds: its launches are not held to one test's
    `real_process` marker. (A plugin, not a conftest hook: a conftest's hooks see only the nodes under its
    directory, and a session-scoped fixture is set up on the session.)"""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        shared = fixturedef.scope != "function"
        if shared:
            warm_worker.enter_shared_fixture()
        try:
            yield
        finally:
            if shared:
                warm_worker.leave_shared_fixture()


def pytest_configure(config):
    config.pluginmanager.register(_SharedFixtureSetups(), "dflash-shared-fixture-setups")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if os.environ.get(RECORD_ENV):
        _phase_start(item)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    if os.environ.get(RECORD_ENV):
        _phase_start(item)
    yield
    warm_worker.leave_test()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    cpu0 = getattr(item, "_dflash_cpu0", None)
    if os.environ.get(RECORD_ENV) and cpu0 is not None:
        # user_properties travel with the report from an xdist worker to the controller
        outcome.get_result().user_properties.append(("dflash_cpu_s", _cpu_seconds() - cpu0))


def pytest_runtest_logreport(report):
    if os.environ.get(RECORD_ENV):
        key = _file_of(report.nodeid)
        _recorded[key] = _recorded.get(key, 0.0) + float(getattr(report, "duration", 0.0) or 0.0)
        cpu = sum(float(v) for k, v in getattr(report, "user_properties", ()) if k == "dflash_cpu_s")
        _recorded_cpu[key] = _recorded_cpu.get(key, 0.0) + cpu


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get(RECORD_ENV)
    if not out or hasattr(session.config, "workerinput"):  # an xdist worker: the controller writes
        return
    if _recorded:
        doc = {k: round(v, 1) for k, v in sorted(_recorded.items(), key=lambda kv: -kv[1])}
        Path(out).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        cpu = {
            k: {"wall_s": round(v, 1), "cpu_s": round(_recorded_cpu.get(k, 0.0), 1),
                "cpu_per_wall": round(_recorded_cpu.get(k, 0.0) / v, 2) if v > 0 else None}
            for k, v in sorted(_recorded.items(), key=lambda kv: -kv[1])
        }
        Path(out + ".cpu.json").write_text(json.dumps(cpu, indent=1) + "\n", encoding="utf-8")
