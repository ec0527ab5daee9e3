"""The launchers' one rule (tests/launchers.py, tests/warm_worker.py): a warm stand-in only where the call says
`warm=True`, and a launch that disagrees with the test's `real_process` marker fails the test. Each check is
shown failing here, before any process starts (the check comes first in every launch)."""

from __future__ import annotations

import pytest
import warm_worker
from launchers import Coordinator, RunManager
from warm_worker import RealProcessError, choose, enabled, marker_problem

needs_warm = pytest.mark.skipif(not enabled(), reason="DFLASH_TEST_WARM_WORKERS=0: every launch is real, nothing to check")


@needs_warm
def test_an_unmarked_test_that_starts_the_native_client_fails(tmp_path):
    with pytest.raises(RealProcessError, match=r"starts the native client .* as a real process but is not marked `real_process\(\"native_client\"\)`"):
        RunManager(tmp_path / "work", "--local")
    assert not (tmp_path / "work").exists()


@needs_warm
def test_an_unmarked_test_that_starts_the_coordinator_s_console_script_fails(tmp_path):
    coord = Coordinator(tmp_path / "coord")
    with pytest.raises(RealProcessError, match=r"hint: pass `warm=True` to the launcher, or mark the test"):
        coord.start()
    assert coord.proc is None


@needs_warm
@pytest.mark.real_process("native_client")
def test_a_test_marked_for_the_native_client_cannot_run_it_warm(tmp_path):
    with pytest.raises(RealProcessError, match=r"is marked `real_process\(\"native_client\"\)` but starts the native client .* warm stand-in"):
        RunManager(tmp_path / "work", "--local", warm=True)


@needs_warm
@pytest.mark.real_process("coordinator")
def test_a_test_marked_for_the_coordinator_cannot_serve_it_warm(tmp_path):
    coord = Coordinator(tmp_path / "coord", warm=True)
    with pytest.raises(RealProcessError, match=r"hint: drop `warm=True` from that launch"):
        coord.start()
    assert coord.proc is None


@needs_warm
@pytest.mark.real_process("coordinator")
def test_the_marker_names_kinds_one_by_one(tmp_path):
    """Marked for the coordinator, a test still starts the native client only warm, and the coordinator only real."""
    assert choose(True, "native_client") is True
    assert choose(False, "coordinator") is False
    with pytest.raises(RealProcessError, match="native_client"):
        choose(False, "native_client")


@pytest.fixture(scope="session")
def _shared_setups_seen_by_a_session_fixture() -> int:
    return warm_worker._shared_setups


@pytest.fixture
def _shared_setups_seen_by_a_test_fixture() -> int:
    return warm_worker._shared_setups


def test_session_fixtures_are_shared_and_function_fixtures_the_test_s(
    _shared_setups_seen_by_a_session_fixture, _shared_setups_seen_by_a_test_fixture
):
    """tests/conftest.py marks a session-scoped fixture's setup as shared (set up on the session, outside tests/)."""
    assert (_shared_setups_seen_by_a_session_fixture, _shared_setups_seen_by_a_test_fixture) == (1, 0)
    assert warm_worker._shared_setups == 0


def test_launches_outside_a_test_or_in_a_shared_fixture_are_not_checked(monkeypatch):
    monkeypatch.setattr(warm_worker, "_running", None)
    assert choose(False, "native_client") is False
    monkeypatch.setattr(warm_worker, "_running", ("t", frozenset()))
    warm_worker.enter_shared_fixture()
    try:
        assert choose(False, "coordinator") is False
    finally:
        warm_worker.leave_shared_fixture()
    if enabled():
        with pytest.raises(RealProcessError):
            choose(False, "coordinator")


def test_every_launch_is_real_when_warm_workers_are_off(monkeypatch):
    monkeypatch.setenv("DFLASH_TEST_WARM_WORKERS", "0")
    assert choose(True, "native_client") is False and choose(False, "coordinator") is False


def test_a_marker_must_name_known_kinds():
    assert marker_problem([("native_client",), ("coordinator", "native_client")]) is None
    assert "takes one or more of `native_client`, `coordinator`" in marker_problem([()])
    assert "got `('docker',)`" in marker_problem([("docker",)])
    with pytest.raises(KeyError):
        choose(True, "docker")
