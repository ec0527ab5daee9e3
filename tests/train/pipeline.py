"""A whole tiny pipeline on disk for the train, export and evaluate tests.

Tiny Qwen3 target (with the tiny BPE tokenizer and Qwen3-style chat template),
a tiny DFlash2 draft released in BF16, prepared data (train/val/test) and a
teacher capture of train and val. Everything is real: real safetensors, real
prepare-data and capture runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Pipeline:
    root: Path
    target: Path
    draft: Path
    data: Path
    capture: Path
    recipe_base: dict

    def recipe(self, run: str = "run", **train) -> Path:
        """Write a recipe TOML with `[train]` overrides; returns its path."""
        import copy

        raw = copy.deepcopy(self.recipe_base)
        raw["train"] = {"scope": "full", "steps": 6, "lr": 3e-3, "blocks_per_sequence": 4, "val_every": 3,
                        "checkpoint_every": 2, "val_examples": 4, "device": "cpu", "warmup_steps": 1,
                        "output": str(self.root / run)}
        export = train.pop("export", None)
        raw["train"].update(train)
        if export:
            raw["export"] = export
        path = self.root / f"{run}.toml"
        path.write_text(_toml(raw))
        return path


def _toml(raw: dict) -> str:
    lines = []
    for section, table in raw.items():
        lines.append(f"[{section}]")
        for k, v in table.items():
            lines.append(f"{k} = {json.dumps(v)}")
        lines.append("")
    return "\n".join(lines)


def build_pipeline(root: Path, *, examples: int = 24, seed: int = 0) -> Pipeline:
    from dflash_worker.capture import run_capture
    from dflash_worker.data import prepare_data
    from dflash_worker.recipe import recipe_from_dict
    from dflash_worker.testing.world import build_world

    root = Path(root)
    world = build_world(root, examples=examples, seed=seed)
    data = root / "data"
    prepare_data([world.rows], data, seed=seed, val_fraction=0.2, test_fraction=0.2)
    capture = root / "capture"
    base = {
        "model": {"target": str(world.target), "draft": str(world.draft), "family": "qwen3"},
        "data": {"dir": str(data), "thinking": "off", "max_length": 256},
        "capture": {"output": str(capture), "dtype": "float32", "splits": ["train", "val"], "device": "cpu"},
    }
    run_capture(recipe_from_dict(base, base=root))
    return Pipeline(root, world.target, world.draft, data, capture, base)


_CACHE: dict[str, Pipeline] = {}


def shared_pipeline(tmp_path_factory) -> Pipeline:
    """One pipeline per pytest session, shared by the train, export and evaluate tests."""
    if "p" not in _CACHE:
        _CACHE["p"] = build_pipeline(tmp_path_factory.mktemp("pipeline"))
    return _CACHE["p"]
