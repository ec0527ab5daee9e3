"""Reuse the training tests' tiny pipeline (one per session, shared through `tests/train/pipeline.py`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "train"))

from pipeline import shared_pipeline  # noqa: E402


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory):
    return shared_pipeline(tmp_path_factory)
