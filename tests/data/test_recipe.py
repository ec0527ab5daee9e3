"""Recipe parsing: typed sections, unknown keys named with the file, relative paths, fingerprints."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_worker.errors import ConfigError
from dflash_worker.recipe import SECTIONS, load_recipe

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "recipe.toml"

MINIMAL = """
[model]
target = "t"
draft = "/abs/d"
family = "qwen3_moe"
[data]
dir = "data/p"
thinking = "on"
"""


def test_example_recipe_loads_and_resolves_relative_paths():
    r = load_recipe(EXAMPLE)
    assert r.model.target == EXAMPLE.parent / "models" / "Qwen3-8B"
    assert r.capture is not None and r.capture.shard_examples == 256 and r.capture.splits == ("train", "val")
    d = r.resolved()
    assert set(d) == {"model", "data", "capture", "train", "export", "evaluate"}
    assert d["capture"]["splits"] == ["train", "val"] and isinstance(d["model"]["target"], str)
    assert r.train.scope == "full" and r.train.output == EXAMPLE.parent / "runs" / "my-draft" / "train"
    assert r.export.format == "bf16" and r.evaluate.split == "test"


def test_minimal_recipe_defaults_and_fingerprint(tmp_path):
    p = tmp_path / "r.toml"
    p.write_text(MINIMAL)
    r = load_recipe(p)
    assert r.model.target == tmp_path / "t" and r.model.draft == Path("/abs/d")
    assert r.data.max_length == 4096 and r.capture is None
    with pytest.raises(ConfigError, match=r"no `\[capture\]` section"):
        r.require("capture")
    f1 = r.fingerprint()
    assert len(f1) == 64 and f1 == load_recipe(p).fingerprint()
    p.write_text(MINIMAL.replace('thinking = "on"', 'thinking = "off"'))
    assert load_recipe(p).fingerprint() != f1


@pytest.mark.parametrize(
    "extra, match",
    [
        ("[serve]\nport = 1\n", r"unknown section `\[serve\]`"),
        ("[capture]\noutput = \"o\"\nshard_size = 3\n", r"unknown key `shard_size` in `\[capture\]`"),
        ("[capture]\noutput = \"o\"\ndtype = \"int8\"\n", r"`\[capture\].dtype` is `int8`"),
        ("[capture]\noutput = \"o\"\nmax_new_tokens = true\n", "must be int"),
        ("[capture]\noutput = \"o\"\nshard_examples = 2\nshard_tokens = 5\n", "both"),
        ("[capture]\noutput = \"o\"\ntop_p = 0\n", "top_p"),
        ("[capture]\noutput = \"o\"\ndevice = \"tpu\"\n", "device"),
        ("[capture]\noutput = \"o\"\nsplits = [\"train\", \"train\"]\n", "repeats"),
    ],
)
def test_bad_recipes_name_key_and_file(tmp_path, extra, match):
    p = tmp_path / "bad.toml"
    p.write_text(MINIMAL + extra)
    with pytest.raises(ConfigError, match=match) as exc:
        load_recipe(p)
    assert "bad.toml" in str(exc.value)


def test_missing_and_wrong_sections(tmp_path):
    p = tmp_path / "r.toml"
    p.write_text(MINIMAL.replace('thinking = "on"\n', ""))
    with pytest.raises(ConfigError, match="missing `thinking`"):
        load_recipe(p)
    p.write_text('[model]\ntarget = "t"\ndraft = "d"\nfamily = "llama"\n[data]\ndir = "x"\nthinking = "on"\n')
    with pytest.raises(ConfigError, match="family"):
        load_recipe(p)
    p.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_recipe(p)
    with pytest.raises(ConfigError, match="cannot read"):
        load_recipe(tmp_path / "nope.toml")


def test_later_sections_plug_in_without_breaking(tmp_path, monkeypatch):
    from dataclasses import dataclass

    @dataclass(frozen=True, kw_only=True)
    class TrainConfig:
        lr: float = 1e-4

    monkeypatch.setitem(SECTIONS, "train", TrainConfig)
    p = tmp_path / "r.toml"
    p.write_text(MINIMAL + "[train]\nlr = 0.5\n")
    r = load_recipe(p)
    assert r.train == TrainConfig(lr=0.5)
    assert r.resolved()["train"] == {"lr": 0.5}



def test_from_scratch_preset_fills_what_the_table_leaves_out(tmp_path):
    p = tmp_path / "r.toml"
    p.write_text(MINIMAL + '[train]\npreset = "from_scratch"\nsteps = 1000\n')
    t = load_recipe(p).train
    assert (t.preset, t.scope, t.lr, t.warmup_steps, t.schedule, t.min_lr_ratio, t.weight_decay) == (
        "from_scratch", "full", 6e-4, 40, "cosine", 0.1, 0.01)
    # the filled values are what manifests record, so two spellings of one recipe fingerprint alike
    spelled = MINIMAL + (
        '[train]\npreset = "from_scratch"\nscope = "full"\nsteps = 1000\nlr = 6e-4\nwarmup_steps = 40\n'
        'schedule = "cosine"\nmin_lr_ratio = 0.1\nweight_decay = 0.01\n')
    (tmp_path / "s.toml").write_text(spelled)
    assert load_recipe(tmp_path / "s.toml").fingerprint() == load_recipe(p).fingerprint()
    assert load_recipe(p).resolved()["train"]["preset"] == "from_scratch"
    # what the table sets wins; a short run still warms up for one step
    p.write_text(MINIMAL + '[train]\npreset = "from_scratch"\nsteps = 10\nlr = 3e-3\nschedule = "linear"\n')
    t = load_recipe(p).train
    assert (t.lr, t.schedule, t.warmup_steps) == (3e-3, "linear", 1)
    # without a preset nothing changes: `scope` is still required
    p.write_text(MINIMAL + '[train]\nsteps = 10\n')
    with pytest.raises(ConfigError, match="is missing `scope`"):
        load_recipe(p)


def test_keep_general_preset_fills_the_adopted_adaptation(tmp_path):
    """`preset = "keep_general"`: the recipe bench/effectiveness.py adopted (docs/effectiveness.md)."""
    from dflash_worker.recipe import KEEP_GENERAL

    p = tmp_path / "r.toml"
    p.write_text(MINIMAL + '[train]\npreset = "keep_general"\nsteps = 2000\n')
    t = load_recipe(p).train
    assert (t.scope, t.lr, t.replay_kd, t.general_tolerance, t.guard_patience) == ("full", 5e-4, 10.0, 0.02, 4)
    assert {k: getattr(t, k) for k in KEEP_GENERAL} == KEEP_GENERAL
    assert (t.warmup_steps, t.val_every, t.checkpoint_every) == (100, 25, 25)  # 5% warmup; validated at least every 25
    # a short run validates 8 times, and at least every step
    for steps, every in ((200, 25), (80, 10), (4, 1)):
        p.write_text(MINIMAL + f'[train]\npreset = "keep_general"\nsteps = {steps}\n')
        t = load_recipe(p).train
        assert (t.val_every, t.checkpoint_every, t.warmup_steps) == (every, every, max(1, steps // 20)), steps
    # what the table sets wins, and the filled values are what the fingerprint sees
    p.write_text(MINIMAL + '[train]\npreset = "keep_general"\nsteps = 200\nreplay_kd = 30.0\nval_every = 5\n')
    t = load_recipe(p).train
    assert (t.replay_kd, t.val_every, t.checkpoint_every, t.general_tolerance) == (30.0, 5, 25, 0.02)
    spelled = MINIMAL + (
        '[train]\npreset = "keep_general"\nscope = "full"\nsteps = 200\nlr = 5e-4\nreplay_kd = 30.0\n'
        'general_tolerance = 0.02\nguard_patience = 4\nwarmup_steps = 10\nval_every = 5\ncheckpoint_every = 25\n')
    (tmp_path / "s.toml").write_text(spelled)
    assert load_recipe(tmp_path / "s.toml").fingerprint() == load_recipe(p).fingerprint()


@pytest.mark.parametrize(
    "table, match",
    [
        ('preset = "from_scratch"\nscope = "selector"', r"trains every tensor of a fresh draft, but `scope` is `selector`"),
        ('preset = "keep_general"\nscope = "recall"', r"is measured with scope `full`, but `scope` is `recall`"),
        ('preset = "warm"\nscope = "full"', r"`\[train\].preset` is `warm`"),
        ('preset = 1\nscope = "full"', r"`\[train\].preset` must be str"),
    ],
)
def test_bad_presets_are_refused_with_the_file(tmp_path, table, match):
    p = tmp_path / "r.toml"
    p.write_text(MINIMAL + "[train]\n" + table + "\n")
    with pytest.raises(ConfigError, match=match) as info:
        load_recipe(p)
    assert str(p) in str(info.value)
