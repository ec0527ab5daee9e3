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

WORDS = (
    "the draft model learns to predict the teacher tokens in each block after the anchor and "
    "the target verifies the block then accepts the longest matching prefix plus one bonus token"
).split()


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
    import random

    import torch

    from dflash_worker.capture import run_capture
    from dflash_worker.data import prepare_data
    from dflash_worker.model import DraftConfig, build_draft, save_draft
    from dflash_worker.recipe import recipe_from_dict
    from dflash_worker.testing.tiny_draft import tiny_dflash2_config
    from dflash_worker.testing.tokenizer import save_tiny_target_with_tokenizer

    root = Path(root)
    target = root / "target"
    save_tiny_target_with_tokenizer(target, seed=seed)
    cfg = tiny_dflash2_config(_target_config(target), block_size=4, selector_top_k=64)
    draft_model = build_draft(DraftConfig.from_dict(cfg), seed=seed)
    draft = root / "draft"
    save_draft(draft_model, draft, dtype=torch.bfloat16)

    rng = random.Random(seed)
    rows = []
    for i in range(examples):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 6)))
        # repetitive responses: the draft can learn them quickly
        start = rng.randrange(len(WORDS))
        response = " ".join(WORDS[(start + j) % len(WORDS)] for j in range(rng.randint(10, 16)))
        rows.append({"prompt": f"q{i} {prompt}", "response": response})
    src = root / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = root / "data"
    prepare_data([src], data, seed=seed, val_fraction=0.2, test_fraction=0.2)
    capture = root / "capture"
    base = {
        "model": {"target": str(target), "draft": str(draft), "family": "qwen3"},
        "data": {"dir": str(data), "thinking": "off", "max_length": 256},
        "capture": {"output": str(capture), "dtype": "float32", "splits": ["train", "val"], "device": "cpu"},
    }
    run_capture(recipe_from_dict(base, base=root))
    return Pipeline(root, target, draft, data, capture, base)


def _target_config(target: Path):
    from transformers import Qwen3Config

    raw = json.loads((target / "config.json").read_text())
    raw.pop("architectures", None)
    raw.pop("model_type", None)
    raw.pop("transformers_version", None)
    return Qwen3Config(**raw)


_CACHE: dict[str, Pipeline] = {}


def shared_pipeline(tmp_path_factory) -> Pipeline:
    """One pipeline per pytest session, shared by the train, export and evaluate tests."""
    if "p" not in _CACHE:
        _CACHE["p"] = build_pipeline(tmp_path_factory.mktemp("pipeline"))
    return _CACHE["p"]
