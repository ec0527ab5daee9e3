"""The project's side of the SGLang and llama.cpp interop tests: a tiny world, a short training run and
its BF16 export, each made by the project's own code and commands, in the project's environment (`.venv`).

`build_export(root, kind)`: a tiny Qwen3 target with its tokenizer (python/dflash_worker/testing), a
"released" draft of `kind` (`dflash2`: the demo's draft, one sliding-window and one full-attention layer,
convolutions and a rank-8, top-64 candidate selector; `dflash`: DFlash v1, no convolutions or selector),
prepared data, a teacher capture, a 2-step `dflash-worker train` and `dflash-worker export --format bf16`.
The engines' tests read `Exported.export` with the engines' own code.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 4


@dataclass(frozen=True)
class Exported:
    root: Path
    target: Path
    draft: Path  # the "released" draft the run starts from
    run: Path
    export: Path  # written by `dflash-worker export --format bf16`

    def config(self) -> dict:
        return json.loads((self.export / "config.json").read_text())


def worker_cli(*argv: str | Path, timeout: float = 900) -> subprocess.CompletedProcess:
    """`dflash-worker ARGV` as a user runs it (`python -m dflash_worker.cli`); it must exit 0."""
    cmd = [sys.executable, "-m", "dflash_worker.cli", *map(str, argv)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if res.returncode != 0:
        raise AssertionError(f"`dflash-worker {' '.join(map(str, argv))}` exited {res.returncode}:\n{res.stderr[-4000:]}")
    return res


def _release_v1_draft(world) -> None:
    """Replace the world's released DFlash2 draft by a DFlash v1 draft with the same taps and block size."""
    import shutil

    import torch

    from dflash_worker.model import DraftConfig, build_draft, save_draft
    from dflash_worker.testing.tiny_draft import tiny_dflash_config
    from dflash_worker.testing.world import target_config

    cfg = tiny_dflash_config(target_config(world.target), block_size=BLOCK_SIZE)
    shutil.rmtree(world.draft)
    save_draft(build_draft(DraftConfig.from_dict(cfg), seed=0), world.draft, dtype=torch.bfloat16)


def build_export(root: Path, kind: str = "dflash2", *, steps: int = 2) -> Exported:
    """World, data, capture, `steps`-step `dflash-worker train`, then `dflash-worker export` to `root/export`."""
    from dflash_worker.capture import run_capture
    from dflash_worker.data import prepare_data
    from dflash_worker.recipe import recipe_from_dict
    from dflash_worker.testing.world import build_world

    if kind not in ("dflash2", "dflash"):
        raise ValueError(f"unknown draft kind `{kind}`")
    root = Path(root)
    world = build_world(root, examples=12, block_size=BLOCK_SIZE)
    if kind == "dflash":
        _release_v1_draft(world)
    data = root / "data"
    prepare_data([world.rows], data, seed=0, val_fraction=0.2, test_fraction=0.2)
    run = root / "run"
    raw = {
        "model": {"target": str(world.target), "draft": str(world.draft), "family": "qwen3"},
        "data": {"dir": str(data), "thinking": "off", "max_length": 256},
        "capture": {"output": str(root / "capture"), "dtype": "float32", "splits": ["train", "val"], "device": "cpu"},
        "train": {"scope": "full", "steps": steps, "lr": 3e-3, "blocks_per_sequence": 4, "val_every": steps,
                  "checkpoint_every": steps, "val_examples": 4, "device": "cpu", "warmup_steps": 1, "output": str(run)},
    }
    run_capture(recipe_from_dict(raw, base=root))
    worker_cli("train", "--recipe", _toml(raw, root / "recipe.toml"))
    export = root / "export"
    worker_cli("export", "--run", run, "--format", "bf16", "--output", export)
    return Exported(root, world.target, world.draft, run, export)


def _toml(raw: dict, path: Path) -> Path:
    """The recipe as TOML (tables of scalars and lists only; JSON spells those as TOML does)."""
    lines = []
    for section, table in raw.items():
        lines.append(f"[{section}]")
        lines.extend(f"{k} = {json.dumps(v)}" for k, v in table.items())
        lines.append("")
    path.write_text("\n".join(lines))
    return path
