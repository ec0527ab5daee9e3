"""Fixtures of the training tests: one tiny real pipeline (target, draft, data, capture) per session, and
one general-domain guard world (`guard_world.build`) per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from guard_world import GuardWorld, build  # noqa: E402
from pipeline import shared_pipeline  # noqa: E402


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory):
    return shared_pipeline(tmp_path_factory)


@pytest.fixture(scope="session")
def guard_world(tmp_path_factory) -> GuardWorld:
    return build(tmp_path_factory.mktemp("guard"))
