"""The general-domain guard's tiny world (tests/train/test_general_guard.py, test_interpolate.py).

A tiny target, and a draft "released" by training it here on general rows (words in `WORDS` order).
The own domain spells every word backwards, so fitting it overwrites what the released draft
learned: a run adapting to it gains own acceptance while its general acceptance falls far below the
released draft's within a few steps. The own data holds general rows out into val
(`prepare-data --replay-val-fraction`), which the guard measures.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline import _toml

from dflash_worker.recipe import load_recipe, recipe_from_dict
from dflash_worker.testing.world import WORDS, write_rows
from dflash_worker.train import train

# the tiny world measures acceptance on 16 general rows x 4 blocks: one block moves it by ~1.5%,
# so the guard run tolerates 10% (the recipe default, 3%, is for real validation sets)
TOLERANCE = 0.1


@dataclass
class GuardWorld:
    """The built world: `recipe` writes an adapting run's recipe (its `[train]` defaults, then `train_kw`)."""

    root: Path
    base: dict  # model/data/capture sections of the adapting runs
    general: Path  # the general rows (the replay file)
    own: Path

    def recipe(self, run: str, **train_kw) -> Path:
        raw = dict(self.base)
        raw["train"] = {"scope": "full", "steps": 24, "lr": 3e-3, "warmup_steps": 16, "blocks_per_sequence": 4,
                        "val_every": 2, "checkpoint_every": 2, "val_examples": 16, "device": "cpu",
                        "output": str(self.root / run), **train_kw}
        path = self.root / f"{run}.toml"
        path.write_text(_toml(raw))
        return path


def build(root: Path) -> GuardWorld:
    """The world of the module docstring under `root`: the released draft trained there, the own data captured."""
    from dflash_worker.capture import run_capture
    from dflash_worker.data import prepare_data
    from dflash_worker.testing.world import build_world

    w = build_world(root / "world", examples=4)
    general = write_rows(root / "general.jsonl", examples=60, seed=1, tag="g")
    own = write_rows(root / "own.jsonl", examples=60, seed=2, words=[x[::-1] for x in WORDS], tag="o")

    def sections(draft: Path, data: Path, capture: Path) -> dict:
        return {"model": {"target": str(w.target), "draft": str(draft), "family": "qwen3"},
                "data": {"dir": str(data), "thinking": "off", "max_length": 256},
                "capture": {"output": str(capture), "dtype": "float32", "splits": ["train", "val"], "device": "cpu"}}

    # the released draft: trained on the general rows only, exported in the released layout (BF16)
    prepare_data([general], root / "general-data", seed=0, val_fraction=0.2, test_fraction=0.0)
    rel = sections(w.draft, root / "general-data", root / "general-capture")
    run_capture(recipe_from_dict(rel, base=root))
    rel["train"] = {"scope": "full", "steps": 200, "lr": 3e-3, "warmup_steps": 1, "blocks_per_sequence": 4,
                    "val_every": 200, "checkpoint_every": 200, "val_examples": 8, "device": "cpu",
                    "output": str(root / "release")}
    (root / "release.toml").write_text(_toml(rel))
    assert train(load_recipe(root / "release.toml")).status == "completed"

    # the own data, with general rows held out into val (and, at this fraction, none mixed into train)
    m = prepare_data([own], root / "own-data", seed=0, val_fraction=0.25, test_fraction=0.0, replay=[general],
                     replay_fraction=0.01, replay_val_fraction=0.25)
    assert m["replay"]["rows"] == 0 and m["replay"]["val_rows"] == 15
    base = sections(root / "release" / "export", root / "own-data", root / "own-capture")
    run_capture(recipe_from_dict(base, base=root))
    return GuardWorld(root, base, general, own)
