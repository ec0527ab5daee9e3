"""Fixtures for checkpoint tests: tiny real transformers targets saved as sharded safetensors."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest


def write_raw(path: Path, header: dict | bytes | str, data: bytes = b"", *, length: int | None = None) -> Path:
    """Write a safetensors-shaped file from a header (dict, str or raw bytes) and data bytes.

    `length` overrides the 8-byte length prefix (to build hostile files).
    """
    if isinstance(header, dict):
        raw = json.dumps(header).encode()
    elif isinstance(header, str):
        raw = header.encode()
    else:
        raw = header
    n = len(raw) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """factory(family, dtype, tied, max_shard_size) -> (path, saved model); cached per session."""
    from dflash_worker.testing import save_tiny_target

    cache: dict = {}

    def make(family: str = "qwen3", dtype: str = "float32", tied: bool = False, max_shard_size="64KB"):
        key = (family, dtype, tied, max_shard_size)
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{family}-{dtype}-{'tied' if tied else 'untied'}")
            model = save_tiny_target(
                path, family=family, dtype=dtype, max_shard_size=max_shard_size, tie_word_embeddings=tied, seed=len(cache)
            )
            cache[key] = (path, model)
        return cache[key]

    return make
