"""Fixtures for family tests: tiny real targets (sharded safetensors) and DFlash2 drafts written here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def targets(tmp_path_factory):
    """{"qwen3": path, "qwen3_moe": path} of tiny bf16 targets saved by `save_pretrained`."""
    from dflash_worker.testing import save_tiny_target

    out = {}
    for fam in ("qwen3", "qwen3_moe"):
        p = tmp_path_factory.mktemp(f"target-{fam}")
        save_tiny_target(p, family=fam, dtype="bfloat16")
        out[fam] = p
    return out


def rewrite_target(src: Path, dst: Path, *, drop=(), add=None, config=None) -> Path:
    """Copy target `src` into `dst` as one model.safetensors, dropping/adding tensors and updating config.json."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir(parents=True)
    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for k in f.keys():
                if k not in drop:
                    tensors[k] = f.get_tensor(k)
    tensors.update(add or {})
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# --------------------------------------------------------------------------- Qwen3.5 wrappers

# Qwen3.5 targets as released: transformers' own multimodal wrapper (`save_pretrained`, vision tower
# present) plus an `mtp.*` shard; MoE experts stored individually (as `save_pretrained` writes them)
# or packed. Keys: "qwen3_5", "qwen3_5_moe/individual", "qwen3_5_moe/packed".
QWEN3_5_TARGETS = {
    "qwen3_5": ("qwen3_5", "individual"),
    "qwen3_5_moe/individual": ("qwen3_5_moe", "individual"),
    "qwen3_5_moe/packed": ("qwen3_5_moe", "packed"),
}


@pytest.fixture(scope="session")
def qwen3_5_targets(tmp_path_factory):
    """{key: (path, wrapper config)} of tiny bf16 Qwen3.5 wrapper targets with `mtp.*` tensors."""
    from dflash_worker.testing import save_tiny_target

    out = {}
    for key, (family, layout) in QWEN3_5_TARGETS.items():
        p = tmp_path_factory.mktemp("target-" + key.replace("/", "-"))
        model = save_tiny_target(p, family=family, dtype="bfloat16", expert_layout=layout, mtp=True)
        out[key] = (p, model.config)
    return out


@pytest.fixture(scope="session")
def deep_qwen3_5_targets(tmp_path_factory):
    """{family: path} of 12-layer Qwen3.5 wrapper targets (transformers' 3:1 linear/full pattern)
    with the tiny tokenizer, a vocabulary padded 8 rows past it and rope_theta 5e6, for `init-draft`."""
    from dflash_worker.testing.tokenizer import save_tiny_target_with_tokenizer

    out = {}
    for family in ("qwen3_5", "qwen3_5_moe"):
        p = tmp_path_factory.mktemp(f"deep-{family}") / "target"
        _, tok = save_tiny_target_with_tokenizer(
            p, family=family, num_hidden_layers=12, vocab_size=392, expert_layout="packed",
            rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.25},
        )
        assert len(tok) == 384
        out[family] = p
    return out
