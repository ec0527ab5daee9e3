"""`evaluate` reports what speculative generation measures, per prompt, for both drafts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dflash_worker.evaluate.report import step_stats, verdict
from dflash_worker.recipe import load_recipe
from dflash_worker.train import train


@pytest.fixture(scope="module")
def evaluated(pipeline):
    res = train(load_recipe(pipeline.recipe("eval-run", steps=4, val_every=2, checkpoint_every=2, lr=1e-2)))
    out = pipeline.root / "eval-report"
    proc = subprocess.run([sys.executable, "-m", "dflash_worker.cli", "evaluate", "--run", str(res.run_dir), "--split", "val",
                           "--max-prompts", "3", "--output", str(out), "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return res, out, json.loads(proc.stdout)


def test_acceptance_equals_speculate_on_same_prompts(pipeline, evaluated):
    from dflash_worker.data import PreparedData, load_tokenizer, render_prompt
    from dflash_worker.evaluate import speculative_generate
    from dflash_worker.model import load_draft
    from dflash_worker.weights import load_model

    res, out, report = evaluated
    tok = load_tokenizer(pipeline.target)
    target = load_model(pipeline.target, dtype=torch.float32)
    drafts = {"baseline": load_draft(pipeline.draft, dtype=torch.float32), "trained": load_draft(res.export_dir, dtype=torch.float32)}
    prompts = [ex for ex in PreparedData(pipeline.data).iter_split("val")][:3]
    assert [p.id for p in prompts] == [r["id"] for r in report["per_prompt"]]
    for ex, row in zip(prompts, report["per_prompt"]):
        ids = torch.tensor([render_prompt(tok, ex.prompt_messages, thinking="off")])
        for name, draft in drafts.items():
            got = speculative_generate(draft, target, ids, max_new_tokens=report["max_new_tokens"], stop_token_ids=[tok.eos_token_id])
            assert row[name]["acceptance_lengths"] == got.acceptance_lengths
            assert row[name]["tau"] == step_stats(got.acceptance_lengths, report["block_size"])["tau"]
        assert row["verdict"] == verdict(row["trained"]["tau"], row["baseline"]["tau"], report["tie_tolerance"])
    assert report["greedy_outputs_identical"] is True  # lossless: both reproduce the teacher's greedy output
    assert (out / "report.md").read_text().startswith("# Evaluation")
    assert (out / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "report.json").read_text()) == report


def test_verdict_rule():
    assert verdict(2.0, 2.0, 0.02) == "tied"
    assert verdict(2.03, 2.0, 0.02) == "tied"
    assert verdict(2.05, 2.0, 0.02) == "improved"
    assert verdict(1.95, 2.0, 0.02) == "regressed"
    s = step_stats([1, 3, 2, 4], 4)
    assert s["tau"] == 2.5 and s["per_position"] == [0.75, 0.5, 0.25]


def test_evaluate_refuses_unfinished_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dflash_worker.cli", "evaluate", "--run", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "selection.json" in proc.stderr
