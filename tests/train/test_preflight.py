"""Preflight measures both phases as peaks and turns them into go / no-go."""

from __future__ import annotations

import json

import pytest
from pipeline import Pipeline
from prewarmed import worker_cli

from dflash_worker.recipe import load_recipe


def test_preflight_reports_peaks_and_verdict(pipeline, monkeypatch):
    from dflash_worker.train import preflight as pf

    recipe = load_recipe(pipeline.recipe("preflight"))
    report = pf.preflight(recipe, length=128)
    for phase in ("capture_peak", "optimization_peak"):
        assert report[phase]["kind"] == "peak" and report[phase]["bytes"] > 0
    assert report["verdict"] == "go"
    teacher = report["teacher"]
    assert teacher["family"] == "qwen3" and teacher["skipped_tensors"] == teacher["skipped_bytes"] == 0, teacher
    assert teacher["bytes_read"] == teacher["bytes"] > 0, teacher
    # both `[train].features` plans (issue 36): the cache's disk bytes from the capture's manifest,
    # the online plan's forward time and peak (target + draft + optimizer, at least the draft step's)
    plans, m = report["plans"], json.loads((pipeline.capture / "manifest.json").read_text())
    assert report["online_peak"]["kind"] == "peak" and report["online_peak"]["bytes"] > 0
    assert plans["tokens"] == m["totals"]["tokens"] and plans["tokens_basis"].startswith("counted")
    assert plans["cache"]["bytes_per_token"] == m["feature_dim"] * 4  # float32 capture
    assert plans["cache"]["disk_bytes"] == plans["tokens"] * plans["cache"]["bytes_per_token"]
    assert plans["online"]["bytes_per_token"] == 5 and plans["online"]["target_forward_seconds_per_sequence"] > 0
    assert plans["online"]["peak_memory_bytes"] == report["online_peak"]["bytes"]
    assert plans["recommended"] == "cache" and plans["recipe_features"] == "cache"
    monkeypatch.setattr(pf, "_device_memory", lambda dev: (1 << 20, "system memory"))
    small = pf.preflight(recipe, length=64)
    assert small["verdict"] == "no-go" and "exceeds" in small["reason"]


def test_preflight_plans_recommend_by_free_disk_then_memory(pipeline, monkeypatch):
    """cache when its bytes fit on disk; else online when its peak fits in memory; else neither."""
    from dflash_worker.train import preflight as pf

    recipe = load_recipe(pipeline.recipe("preflight-plans"))
    ids, peak = [1, 2], 1000
    monkeypatch.setattr(pf, "_free_disk", lambda path: 10**12)
    assert pf.plans(recipe, ids, 64, peak, 0.1, 10**6)["recommended"] == "cache"
    monkeypatch.setattr(pf, "_free_disk", lambda path: 10**5)  # the online tokens fit, the cache (~800 kB) does not
    p = pf.plans(recipe, ids, 64, peak, 0.1, 10**6)
    assert p["recommended"] == "online" and "exceeds" in p["reason"] and p["online"]["extra_forward_seconds"] == 0.1 * p["online"]["sequences"]
    assert pf.plans(recipe, ids, 64, 10**7, 0.1, 10**6)["recommended"] == "neither"


def test_preflight_cli_json(pipeline):
    res = worker_cli("preflight", "--recipe", pipeline.recipe("preflight-cli"), "--length", "64", "--json", timeout=300)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["verdict"] == "go"
    assert "capture peak" in res.stderr and "optimization peak" in res.stderr  # a log line beside the JSON
    plain = worker_cli("preflight", "--recipe", pipeline.recipe("preflight-cli"), "--length", "64", timeout=300)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.startswith("preflight: 64 tokens") and "optimization peak" in plain.stdout and "go:" in plain.stdout, plain.stdout
    assert "online peak" in plain.stdout and "    cache:  " in plain.stdout and "recommended: cache" in plain.stdout, plain.stdout
    assert json.loads(res.stdout)["plans"]["recommended"] == "cache"
    assert "\n  teacher:           qwen3, 4 layers x 64, " in plain.stdout and "skipped" not in plain.stdout, plain.stdout
    assert "capture peak" not in plain.stderr


@pytest.mark.slow
def test_preflight_measures_a_qwen3_5_moe_wrapper_as_its_text_tower(tmp_path):
    """The teacher preflight loads and reports is the text tower: geometry from `text_config`, bytes of
    `model.language_model.*` and `lm_head`; the vision tower and MTP heads are skipped unread and
    counted apart (they are in no peak)."""
    from dflash_worker.testing.world import build_world
    from dflash_worker.weights import list_tensors
    from dflash_worker.weights.checkpoint import read_text_config

    world = build_world(tmp_path / "world", family="qwen3_5_moe", expert_layout="packed")
    base = {
        "model": {"target": str(world.target), "draft": str(world.draft), "family": "qwen3_5_moe"},
        "data": {"dir": str(tmp_path / "data"), "thinking": "off", "max_length": 64},
        "capture": {"output": str(tmp_path / "capture"), "dtype": "float32", "device": "cpu"},
    }
    recipe = Pipeline(tmp_path, world.target, world.draft, tmp_path / "data", tmp_path / "capture", base).recipe("preflight")
    res = worker_cli("preflight", "--recipe", recipe, "--json", timeout=300)
    assert res.returncode == 0, res.stderr
    teacher = json.loads(res.stdout)["teacher"]

    tc = read_text_config(world.target)
    entries = list_tensors(world.target)
    outside = [e.nbytes for n, e in entries.items() if n.startswith(("model.visual.", "mtp."))]
    tower = [e.nbytes for n, e in entries.items() if n.startswith(("model.language_model.", "lm_head."))]
    assert len(tower) + len(outside) == len(entries), sorted(entries)
    assert teacher["family"] == "qwen3_5_moe" and teacher["expert_storage"] == "packed", teacher
    got = tuple(teacher[k] for k in ("num_hidden_layers", "hidden_size", "vocab_size", "num_experts", "num_experts_per_tok"))
    assert got == tuple(tc[k] for k in ("num_hidden_layers", "hidden_size", "vocab_size", "num_experts", "num_experts_per_tok"))
    assert teacher["bytes_read"] == teacher["bytes"] == sum(tower), teacher
    assert (teacher["skipped_tensors"], teacher["skipped_bytes"]) == (len(outside), sum(outside)) and outside, teacher
    line = f"qwen3_5_moe, {tc['num_hidden_layers']} layers x {tc['hidden_size']}, {tc['num_experts']} experts (top-{tc['num_experts_per_tok']})"
    assert line in res.stderr and "vision/MTP skipped unread" in res.stderr, res.stderr
