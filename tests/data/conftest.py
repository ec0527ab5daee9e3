"""Fixtures for the data tests: the tiny tokenizer and a target dir holding only tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from dflash_worker.testing.tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tokenizer_only_target(tmp_path_factory, tiny_tokenizer) -> Path:
    """A target dir with tokenizer, chat template and config.json, and no weights at all."""
    from dflash_worker.testing.tokenizer import save_tiny_tokenizer

    d = tmp_path_factory.mktemp("tok_target")
    save_tiny_tokenizer(d, tiny_tokenizer)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": len(tiny_tokenizer)}))
    return d


def write_jsonl(path: Path, rows: list) -> Path:
    """Write rows (dicts are JSON-encoded, bytes/str written raw) one per line."""
    with open(path, "wb") as f:
        for r in rows:
            if isinstance(r, bytes):
                f.write(r + b"\n")
            elif isinstance(r, str):
                f.write(r.encode() + b"\n")
            else:
                f.write(json.dumps(r, ensure_ascii=False).encode() + b"\n")
    return path
