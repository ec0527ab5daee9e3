"""Fixtures: a coordinator process on 127.0.0.1 with its own SQLite file (tests/launchers.py), and providers for it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

try:
    import dflash_worker  # noqa: F401
except ImportError:  # not installed editable (yet): use the checkout's sources
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

# tests/tls_certs.py (the shared certificate factory) lives one level up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator_helpers import Provider
from launchers import Coordinator


@pytest.fixture
def start_coordinator(tmp_path):
    """Factory: start a coordinator (`launchers.Coordinator`) with `serve` flags `args`; stopped at teardown."""
    procs: list[Coordinator] = []

    def start(*args: str, lease_ttl: float = 30.0, workdir: Path | None = None, tls=None, warm: bool = False) -> Coordinator:
        """`tls`: the admin client's `ClientTls` for a coordinator started with `--tls-cert`; `warm=True`: served
        from a fork of the pre-warmed interpreter (else the console script runs: `real_process("coordinator")`)."""
        p = Coordinator(workdir or tmp_path / f"coord{len(procs)}", lease_ttl=lease_ttl, serve_args=args, tls=tls, warm=warm)
        procs.append(p)
        return p.start()

    yield start
    for p in procs:
        p.stop()


@pytest.fixture
def coordinator(start_coordinator) -> Coordinator:
    """A coordinator with the default flags, warm."""
    return start_coordinator(warm=True)


@pytest.fixture
def provider_factory(coordinator):
    """Factory: make a provider token through the admin API and a client for it."""
    made: list[Provider] = []

    def make(name="box", coord=None) -> Provider:
        c = coord or coordinator
        with c.admin() as admin:
            token = admin.create_provider(name)
        p = Provider(c.address, token)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()
