"""Fixtures of the training tests: one tiny real pipeline (target, draft, data, capture) per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from pipeline import shared_pipeline  # noqa: E402


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory):
    return shared_pipeline(tmp_path_factory)
