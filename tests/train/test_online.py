"""Online features (`[train].features = "online"`, issue 36): capture stores token ids only, training
computes the tap features with the frozen target inside the step through the component capture
calls (`capture.teacher.Teacher`). Same data, seed and dtype (float32 on CPU): the same bytes as
training on the cache; an interrupted and resumed online run equals an uninterrupted one."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dflash_worker.capture import open_capture, run_capture
from dflash_worker.errors import ConfigError, DataError
from dflash_worker.manifest import sha256_file
from dflash_worker.recipe import load_recipe, recipe_from_dict
from dflash_worker.train import StopFlags, train
from dflash_worker.train import checkpoint as ckpt

N = 4
KW = dict(steps=N, checkpoint_every=2, val_every=2, grad_accum=2, blocks_per_sequence=4, lr=5e-3)


@pytest.fixture(scope="module")
def online(pipeline):
    """The shared pipeline with a second, online capture of the same data (tokens only)."""
    base = copy.deepcopy(pipeline.recipe_base)
    base["capture"]["output"] = str(pipeline.root / "capture-online")
    run_capture(recipe_from_dict({**base, "train": {"scope": "full", "features": "online"}}, base=pipeline.root))
    return dataclasses.replace(pipeline, capture=pipeline.root / "capture-online", recipe_base=base)


def _final(run: Path) -> dict:
    path = run / ckpt.CHECKPOINTS / ckpt.step_name(N)
    sel = json.loads((run / "selection.json").read_text())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {
        "trainable_sha": sha256_file(path / "trainable.safetensors"),
        "optimizer": ckpt.load(path).optimizer,
        "export_weights_sha": sha256_file(run / sel["export"]["dir"] / "model.safetensors"),
        "history": sel["history"],
        "losses": [(m["step"], m["loss"], m["grad_norm"]) for m in metrics],
    }


def _same(a: dict, b: dict) -> None:
    assert a["trainable_sha"] == b["trainable_sha"]
    assert a["export_weights_sha"] == b["export_weights_sha"]
    assert a["history"] == b["history"] and a["losses"] == b["losses"]
    oa, ob = a["optimizer"], b["optimizer"]
    assert oa["param_groups"] == ob["param_groups"] and oa["state"].keys() == ob["state"].keys()
    for k in oa["state"]:
        for name, va in oa["state"][k].items():
            vb = ob["state"][k][name]
            assert torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb, (k, name)


def test_online_capture_stores_token_ids_only(pipeline, online):
    m = json.loads((online.capture / "manifest.json").read_text())
    assert m["features"] == "online" and m["key_inputs"]["features"] == "online"
    assert json.loads((pipeline.capture / "manifest.json").read_text())["features"] == "cache"
    for s in m["shards"]:
        with safe_open(str(online.capture / s["file"]), framework="pt") as f:
            assert sorted(f.keys()) == ["index", "input_ids", "loss_mask", "offsets"]
            assert json.loads(f.metadata()["dflash_capture"])["features"] == "online"
    per_token = m["totals"]["payload_bytes"] / m["totals"]["tokens"]
    assert per_token <= 16, per_token
    # the same tokens as the cache capture, example for example
    cached, tokens = list(open_capture(pipeline.capture)), list(open_capture(online.capture))
    assert [(e.split, e.id) for e in cached] == [(e.split, e.id) for e in tokens]
    for c, t in zip(cached, tokens):
        assert torch.equal(c.input_ids, t.input_ids) and torch.equal(c.loss_mask, t.loss_mask) and t.features is None


@pytest.fixture(scope="module")
def online_reference(online):
    train(load_recipe(online.recipe("online-ref", features="online", **KW)))
    return _final(online.root / "online-ref")


def test_online_training_equals_cache_training_byte_for_byte(pipeline, online_reference):
    train(load_recipe(pipeline.recipe("cache-ref", **KW)))
    _same(_final(pipeline.root / "cache-ref"), online_reference)


def test_online_resume_is_bit_identical(online, online_reference):
    recipe = online.recipe("online-resume", features="online", **KW)
    flags = StopFlags()
    flags.request_stop("test")  # stop (and commit) at the first step boundary, as a job runner does
    assert train(load_recipe(recipe), flags=flags).status == "stopped"
    assert train(load_recipe(recipe), resume=True).status == "completed"
    _same(online_reference, _final(online.root / "online-resume"))


def test_mode_and_capture_must_agree(pipeline, online):
    with pytest.raises(DataError, match="features = \\\\?\"online\\\\?\"") as err:
        train(load_recipe(online.recipe("mismatch-a", **KW)))
    assert "capture again" in str(err.value)
    with pytest.raises(DataError, match="was made with"):
        train(load_recipe(pipeline.recipe("mismatch-b", features="online", **KW)))


def test_unknown_features_value_is_refused_with_the_file_named(pipeline):
    path = pipeline.recipe("bad-features", features="disk")
    with pytest.raises(ConfigError, match="features") as err:
        load_recipe(path)
    assert str(path) in str(err.value) and "`online`" in str(err.value)


def test_checkpoints_from_before_the_key_resume_as_cache():
    from dflash_worker.errors import ResumeError
    from dflash_worker.train.resume import compare_for_resume

    saved = {"recipe_view": {"train.lr": 1.0}, "data_fingerprint": "d", "draft_fingerprint": {}}
    compare_for_resume(saved, {**saved, "recipe_view": {"train.lr": 1.0, "train.features": "cache"}})
    with pytest.raises(ResumeError, match="`train.features`"):
        compare_for_resume(saved, {**saved, "recipe_view": {"train.lr": 1.0, "train.features": "online"}})


def test_online_capture_divided_over_two_jobs_holds_token_ids_only(pipeline, tmp_path):
    """`--capture-shards 2` in online mode: each job writes its shards of token ids, the assembled
    capture is the bytes one process writes."""
    from dflash_worker.capture import CapturePart, assemble_capture

    raw = copy.deepcopy(pipeline.recipe_base)
    raw["train"] = {"scope": "full", "features": "online"}
    raw["capture"].update(output=str(tmp_path / "whole"), shard_examples=4)
    whole = run_capture(recipe_from_dict(raw, base=pipeline.root))
    import shutil

    (tmp_path / "parts").mkdir()
    for i in range(2):  # each job in its own dir, as the run-manager runs them; their shards meet after
        raw["capture"]["output"] = str(tmp_path / f"part-{i}")
        run_capture(recipe_from_dict(raw, base=pipeline.root), part=CapturePart(i, 2))
        for f in (tmp_path / f"part-{i}").glob("shard-*"):
            shutil.copy(f, tmp_path / "parts" / f.name)
    raw["capture"]["output"] = str(tmp_path / "parts")
    assembled = assemble_capture(recipe_from_dict(raw, base=pipeline.root))
    assert assembled["features"] == "online" and assembled["capture_key"] == whole["capture_key"]
    assert [s["sha256"] for s in assembled["shards"]] == [s["sha256"] for s in whole["shards"]]
    assert len(assembled["shards"]) > 2
    for s in assembled["shards"]:
        with safe_open(str(tmp_path / "parts" / s["file"]), framework="pt") as f:
            assert sorted(f.keys()) == ["index", "input_ids", "loss_mask", "offsets"]


@pytest.mark.slow
def test_two_online_gloo_ranks_equal_one_online_rank(online):
    """Multi-rank online: each rank loads the target and computes its own micro-batch's features;
    one micro-batch per rank gives the one-rank bytes (as `test_distributed` shows for the cache)."""
    from test_distributed import ONE_RANK, TORCHRUN, _export_sha, _recipe, _run, _samples, _trainable

    one, two = online.root / "online-d1", online.root / "online-d2"
    _run(ONE_RANK, _recipe(online, "online-d1", features="online"))
    _run(TORCHRUN, _recipe(online, "online-d2", features="online"))
    for step in (1, 2, 3):
        a, b = _trainable(one, step), _trainable(two, step)
        assert all(torch.equal(a[k], b[k]) for k in a), step
    assert _export_sha(one) == _export_sha(two) and _samples(one) == _samples(two)
