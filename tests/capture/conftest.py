"""Fixtures for capture tests: tiny dense and MoE targets sharing the tiny tokenizer, a draft config, prepared data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

LAYER_IDS = [0, 2]


@pytest.fixture(scope="session")
def cap_tokenizer():
    from dflash_worker.testing.tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def targets(tmp_path_factory, cap_tokenizer) -> dict[str, Path]:
    from dflash_worker.testing.tokenizer import save_tiny_target_with_tokenizer

    out = {}
    for family in ("qwen3", "qwen3_moe"):
        d = tmp_path_factory.mktemp(f"target_{family}")
        save_tiny_target_with_tokenizer(d, family=family, tokenizer=cap_tokenizer)
        out[family] = d
    return out


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory, targets) -> Path:
    """A real DFlash2 draft (capture validates the target/draft pair before loading weights);
    the dense and MoE tiny targets share hidden size, layer count and vocab, so it fits both."""
    from transformers import AutoConfig

    from dflash_worker.testing.tiny import save_tiny_dflash2_draft

    d = tmp_path_factory.mktemp("draft")
    save_tiny_dflash2_draft(d, AutoConfig.from_pretrained(targets["qwen3"]), target_layer_ids=LAYER_IDS)
    return d


@pytest.fixture(scope="session")
def prepared_dir(tmp_path_factory) -> Path:
    from dflash_worker.data import prepare_data
    from dflash_worker.testing.tokenizer import corpus_lines

    d = tmp_path_factory.mktemp("prepared")
    lines = corpus_lines(28, seed=7)
    rows = []
    for i in range(0, 28, 2):
        if i % 4 == 0:
            rows.append({"prompt": lines[i], "response": lines[i + 1]})
        else:
            rows.append({"messages": [{"role": "user", "content": lines[i]},
                                      {"role": "assistant", "content": lines[i + 1], "reasoning_content": lines[i][:20]}]})
    src = d / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare_data([src], d / "prepared", seed=1, val_fraction=0.2, test_fraction=0.1)
    return d / "prepared"


def write_recipe(path: Path, *, target: Path, draft: Path, data: Path, output: Path, family: str = "qwen3",
                 thinking: str = "on", max_length: int = 256, **capture) -> Path:
    """A recipe TOML at `path`; `capture` entries override the [capture] defaults used in tests."""
    cap = {"dtype": "float32", "shard_examples": 4, "device": "cpu"} | capture
    def val(v):
        return json.dumps(v) if not isinstance(v, bool) else ("true" if v else "false")
    body = (
        f'[model]\ntarget = "{target}"\ndraft = "{draft}"\nfamily = "{family}"\n\n'
        f'[data]\ndir = "{data}"\nthinking = "{thinking}"\nmax_length = {max_length}\n\n'
        f'[capture]\noutput = "{output}"\n' + "".join(f"{k} = {val(v)}\n" for k, v in cap.items() if v is not None)
    )
    path.write_text(body)
    return path


def payload(d: Path) -> dict[str, bytes]:
    """Every shard and sidecar of a capture dir, by name (the manifest has run facts, so it is left out)."""
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name.startswith("shard-")}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Run capture tests on one intra-op thread (restored afterwards).

    On a small shared CPU box, OpenMP threads that spin while other processes hold
    the cores make tiny forwards ~10x slower. Byte-identity claims compare runs at
    the same thread count; subprocesses get OMP_NUM_THREADS=1 for the same reason.
    """
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def one_thread_env() -> dict:
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1"}
