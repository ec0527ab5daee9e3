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
