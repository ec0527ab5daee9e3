"""`evaluate` reports what speculative generation measures, per prompt, for both drafts."""

from __future__ import annotations

import json

import pytest
import torch
from prewarmed import worker_cli

from dflash_worker.evaluate.report import render_markdown, step_stats, summarize, verdict
from dflash_worker.recipe import load_recipe
from dflash_worker.stop_tokens import stop_token_ids
from dflash_worker.train import train


@pytest.fixture(scope="module")
def evaluated(pipeline):
    res = train(load_recipe(pipeline.recipe("eval-run", steps=4, val_every=2, checkpoint_every=2, lr=1e-2)))
    out = pipeline.root / "eval-report"
    proc = worker_cli("evaluate", "--run", res.run_dir, "--split", "val", "--max-prompts", "3", "--output", out, "--json", timeout=300)
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
    stops = stop_token_ids(pipeline.target, tok)
    assert report["stop_token_ids"] == stops == [tok.convert_tokens_to_ids("<|im_end|>")]
    assert report["data"] == str(pipeline.data) and report["data_source"] == "run"
    assert [p.id for p in prompts] == [r["id"] for r in report["per_prompt"]]
    for ex, row in zip(prompts, report["per_prompt"]):
        ids = torch.tensor([render_prompt(tok, ex.prompt_messages, thinking="off")])
        for name, draft in drafts.items():
            got = speculative_generate(draft, target, ids, max_new_tokens=report["max_new_tokens"], stop_token_ids=stops)
            assert row[name]["acceptance_lengths"] == got.acceptance_lengths
            assert row[name]["tau"] == step_stats(got.acceptance_lengths, report["block_size"])["tau"]
        assert row["verdict"] == verdict(row["trained"]["tau"], row["baseline"]["tau"], report["tie_tolerance"])
    assert report["greedy_outputs_identical"] is True  # kept key: the two drafts agree with each other
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
    proc = worker_cli("evaluate", "--run", tmp_path, timeout=120)
    assert proc.returncode == 1 and "selection.json" in proc.stderr


def test_lossless_against_teacher_greedy(pipeline, evaluated):
    from dflash_worker.data import PreparedData, load_tokenizer, render_prompt
    from dflash_worker.evaluate import greedy_generate
    from dflash_worker.weights import load_model

    res, out, report = evaluated
    tok = load_tokenizer(pipeline.target)
    target = load_model(pipeline.target, dtype=torch.float32)
    prompts = [ex for ex in PreparedData(pipeline.data).iter_split("val")][:3]
    for ex, row in zip(prompts, report["per_prompt"]):
        ids = torch.tensor([render_prompt(tok, ex.prompt_messages, thinking="off")])
        teacher = greedy_generate(target, ids, max_new_tokens=report["max_new_tokens"], stop_token_ids=report["stop_token_ids"])
        assert row["teacher_output_tokens"] == teacher.shape[1] - ids.shape[1]
        assert row["baseline"]["output_tokens"] == row["trained"]["output_tokens"] == row["teacher_output_tokens"]
        assert row["matches_teacher"] == {"baseline": True, "trained": True} and row["lossless"] is True
    assert report["lossless"] is True and report["lossless_mismatches"] == []
    md = (out / "report.md").read_text()
    assert "Lossless check: **passed**" in md and "Greedy outputs identical" not in md


def test_headline_and_verdict_are_pooled(evaluated):
    res, out, report = evaluated
    b, t = report["baseline"], report["trained"]
    for name, o in (("baseline", b), ("trained", t)):
        lengths = [a for r in report["per_prompt"] for a in r[name]["acceptance_lengths"]]
        assert o["tau_pooled"] == o["pooled"]["tau"] == sum(lengths) / len(lengths) == o["committed_tokens"] / o["verify_steps"]
    assert report["verdict"] == verdict(t["tau_pooled"], b["tau_pooled"], report["tie_tolerance"])
    assert report["verdict_basis"] == "tau_pooled"
    assert report["verdict_per_prompt_mean"] == verdict(t["tau_mean"], b["tau_mean"], report["tie_tolerance"])
    headline = (out / "report.md").read_text().splitlines()[2]
    assert headline.startswith("**Acceptance length tau (pooled")
    assert f"baseline {b['tau_pooled']:.3f} -> trained {t['tau_pooled']:.3f}**" in headline


def _synthetic_report(lengths: dict[str, list[list[int]]]) -> dict:
    rows = [{"id": f"p{i}", "baseline": step_stats(b, 4) | {"acceptance_lengths": b},
             "trained": step_stats(t, 4) | {"acceptance_lengths": t}, "verdict": "tied", "lossless": True}
            for i, (b, t) in enumerate(zip(lengths["baseline"], lengths["trained"]))]
    b, t = summarize(rows, "baseline", 4), summarize(rows, "trained", 4)
    return {"run": "r", "split": "test", "prompts": len(rows), "baseline": b, "trained": t, "selection_step": 1,
            "verdict": verdict(t["tau_pooled"], b["tau_pooled"], 0.02), "tie_rule": "rule", "tie_tolerance": 0.02,
            "verdict_counts": {"improved": 0, "tied": len(rows), "regressed": 0}, "temperature": 0.0, "max_new_tokens": 8,
            "data": "d", "data_source": "run", "stop_token_ids": [1], "stop_token_rule": "rule", "lossless": True,
            "lossless_reference": "teacher", "lossless_mismatches": [], "per_prompt": rows}


def test_pooled_differs_from_per_prompt_mean_and_leads():
    # a long answer at tau 1 and a short one at tau 4: pooled 8/5 = 1.6, per-prompt mean 2.5
    r = _synthetic_report({"baseline": [[1, 1, 1, 1], [4]], "trained": [[1, 1, 1, 1], [4]]})
    assert r["baseline"]["tau_pooled"] == 1.6 and r["baseline"]["tau_mean"] == 2.5
    headline = render_markdown(r).splitlines()[2]
    assert "baseline 1.600 -> trained 1.600**" in headline and headline.index("1.600") < headline.index("2.500")
    # the verdict follows pooled tau: trained better per prompt on average but worse pooled
    r = _synthetic_report({"baseline": [[2, 2, 2, 2], [2]], "trained": [[1, 1, 1, 1, 1, 1], [4]]})
    assert r["trained"]["tau_mean"] > r["baseline"]["tau_mean"] and r["verdict"] == "regressed"


def test_lossless_check_names_the_differing_prompt(pipeline, evaluated, monkeypatch):
    from dflash_worker.evaluate import speculate
    from dflash_worker.evaluate.report import evaluate_run

    res, _, _ = evaluated
    real, calls = speculate.greedy_generate, []

    def altered(*args, **kwargs):  # the teacher's greedy output for the first prompt gains a different last token
        out = real(*args, **kwargs).clone()
        calls.append(1)
        if len(calls) == 1:
            out[0, -1] = (out[0, -1] + 1) % 50
        return out

    monkeypatch.setattr(speculate, "greedy_generate", altered)
    out = pipeline.root / "eval-altered"
    report = evaluate_run(res.run_dir, split="val", out_dir=out, max_prompts=2)
    first = report["per_prompt"][0]["id"]
    assert report["lossless"] is False
    assert report["lossless_mismatches"] == [{"id": first, "drafts": ["baseline", "trained"]}]
    assert report["per_prompt"][1]["lossless"] is True
    assert "Lossless check: **FAILED**: outputs differ from" in (out / "report.md").read_text()
    assert f"`{first}` (baseline, trained)" in (out / "report.md").read_text()


def test_evaluate_on_another_prepared_dir(pipeline, evaluated, tmp_path):
    from dflash_worker.data import PreparedData, prepare_data

    res, _, _ = evaluated
    rows = tmp_path / "held.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"held{i} alpha beta", "response": "gamma delta"}) + "\n" for i in range(6)))
    data = tmp_path / "held-data"
    prepare_data([rows], data, seed=3, val_fraction=0.0, test_fraction=0.9)
    want = [ex.id for ex in PreparedData(data).iter_split("test")][:2]
    assert want
    out = tmp_path / "report"
    proc = worker_cli("evaluate", "--run", res.run_dir, "--data", data, "--split", "test", "--max-prompts", "2", "--output", out, "--json",
                      timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["data"] == str(data) and report["data_source"] == "--data" and report["split"] == "test"
    assert [r["id"] for r in report["per_prompt"]] == want
    assert f"Data: `{data}` (from --data)" in (out / "report.md").read_text()
    assert "acceptance length (pooled)" in proc.stderr and "lossless" in proc.stderr
