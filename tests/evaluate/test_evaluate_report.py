"""`evaluate` reports what speculative generation measures, per prompt, for both drafts."""

from __future__ import annotations

import json

import pytest
import torch
from prewarmed import worker_cli

from dflash_worker.evaluate.breakdown import no_verify
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
    return res, out, json.loads(proc.stdout), proc.stderr


def test_acceptance_equals_speculate_on_same_prompts(pipeline, evaluated):
    from dflash_worker.data import PreparedData, load_tokenizer, render_prompt
    from dflash_worker.evaluate import speculative_generate
    from dflash_worker.model import load_draft
    from dflash_worker.weights import load_model

    res, out, report, _ = evaluated
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

    res, out, report, _ = evaluated
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
    res, out, report, _ = evaluated
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
    rows = [{"id": f"p{i}", "prompt_tokens": 9, "thinking": "off", "baseline": step_stats(b, 4) | {"acceptance_lengths": b},
             "trained": step_stats(t, 4) | {"acceptance_lengths": t}, "verdict": "tied", "lossless": True}
            for i, (b, t) in enumerate(zip(lengths["baseline"], lengths["trained"]))]
    b, t = summarize(rows, "baseline", 4), summarize(rows, "trained", 4)
    return {"run": "r", "split": "test", "prompts": len(rows), "baseline": b, "trained": t, "selection_step": 1,
            "verdict": verdict(t["tau_pooled"], b["tau_pooled"], 0.02), "tie_rule": "rule", "tie_tolerance": 0.02,
            "verdict_counts": {"improved": 0, "tied": len(rows), "regressed": 0}, "temperature": 0.0, "max_new_tokens": 8,
            "data": "d", "data_source": "run", "stop_token_ids": [1], "stop_token_rule": "rule", "lossless": True,
            "lossless_reference": "teacher", "lossless_mismatches": [], "per_prompt": rows, "no_verify": no_verify(rows)}


def test_the_report_says_when_the_export_is_an_interpolated_point_or_the_released_draft():
    from dflash_worker.evaluate.breakdown import summary_lines

    line = "interpolated export: alpha 0.25 from the released draft toward step 8; ..."
    r = _synthetic_report({"baseline": [[2, 1]], "trained": [[3, 1]]}) | {"selection_step": 8, "interpolation_alpha": 0.25,
                                                                          "selection_note": line}
    md = render_markdown(r)
    assert f"Selection: {line}." in md and "| trained (step 8, alpha 0.25) |" in md
    assert summary_lines(r)[0] == f"evaluate: {line}"  # what `evaluate` prints after its headline
    plain = _synthetic_report({"baseline": [[2, 1]], "trained": [[3, 1]]})
    assert "Selection:" not in render_markdown(plain) and not summary_lines(plain)[0].startswith("evaluate: interpolated")


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

    res, _, _, _ = evaluated
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

    res, _, _, _ = evaluated
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


def test_the_report_carries_the_context_buckets_and_the_thinking_modes(evaluated):
    res, out, report, stderr = evaluated
    assert report["no_verify"]["prompts"] == 0 and report["scored_prompts"] == report["prompts"] == 3
    assert report["context_filter"] is None
    for name in ("baseline", "trained"):
        o = report[name]
        # every tiny prompt and answer stays under 1k tokens: all steps in 0-1k, the other buckets empty (not zero)
        assert [b["bucket"] for b in o["buckets"]] == ["0-1k", "1k-4k", "4k-16k", "16k+"]
        first, *rest = o["buckets"]
        assert (first["steps"], first["committed_tokens"], first["tau"]) == (o["verify_steps"], o["committed_tokens"], o["tau_pooled"])
        assert all(b["steps"] == 0 and b["tau"] is None for b in rest)
        # the run's recipe renders every prompt with thinking off: one mode, equal to the pooled figure
        assert o["modes"] == {"off": {"prompts": 3, "no_verify_prompts": 0, "steps": o["verify_steps"],
                                      "committed_tokens": o["committed_tokens"], "tau": o["tau_pooled"]}}
    assert all(r["thinking"] == "off" and r["prompt_tokens"] > 0 for r in report["per_prompt"])
    md = (out / "report.md").read_text()
    b, t = report["baseline"], report["trained"]
    assert f"| 0-1k | {b['tau_pooled']:.3f} | {b['verify_steps']} | {t['tau_pooled']:.3f} | {t['verify_steps']} |" in md
    assert "| 16k+ | empty | 0 | empty | 0 |" in md
    assert f"| off | 3 | {b['tau_pooled']:.3f} | {t['tau_pooled']:.3f} |" in md
    assert (f"evaluate: per thinking mode, acceptance length (pooled) baseline -> trained: off {b['tau_pooled']:.3f} -> "
            f"{t['tau_pooled']:.3f} (3 prompts)") in stderr
    assert "evaluate: per context bucket (anchor position, tokens), baseline -> trained: 0-1k " in stderr
    assert "1k-4k empty; 4k-16k empty; 16k+ empty" in stderr


def _prepared(tmp_path, name: str, prompts: list[str]):
    from dflash_worker.data import PreparedData, prepare_data

    rows = tmp_path / f"{name}.jsonl"
    rows.write_text("".join(json.dumps({"prompt": p, "response": "gamma delta"}) + "\n" for p in prompts))
    data = tmp_path / f"{name}-data"
    prepare_data([rows], data, seed=3, val_fraction=0.0, test_fraction=0.99)
    return data, list(PreparedData(data).iter_split("test"))


WORDS8 = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]


def test_a_prompt_whose_teacher_stops_at_once_is_counted_apart(pipeline, evaluated, tmp_path, monkeypatch):
    from dflash_worker import stop_tokens
    from dflash_worker.data import load_tokenizer, render_prompt
    from dflash_worker.evaluate import greedy_generate
    from dflash_worker.evaluate.report import evaluate_run
    from dflash_worker.weights import load_model

    res, _, _, _ = evaluated
    # the tiny teacher's first token depends on the prompt's length and text: these three differ
    data, examples = _prepared(tmp_path, "stops", [" ".join(WORDS8 * 20), "hello " * 50, "x"])
    tok = load_tokenizer(pipeline.target)
    target = load_model(pipeline.target, dtype=torch.float32)
    first = {ex.id: int(greedy_generate(target, torch.tensor([render_prompt(tok, ex.prompt_messages, thinking="off")]),
                                        max_new_tokens=1)[0, -1]) for ex in examples}
    stopper = next(i for i in first if list(first.values()).count(first[i]) == 1)
    token = first[stopper]
    stops = stop_token_ids(pipeline.target, tok)
    assert token not in stops
    # that prompt's first token becomes a stop token: it makes no verify step, the others do
    monkeypatch.setattr(stop_tokens, "stop_token_ids", lambda *a, **k: [*stops, token])
    report = evaluate_run(res.run_dir, split="test", data_dir=data, out_dir=tmp_path / "stops-report")
    rows = {r["id"]: r for r in report["per_prompt"]}
    assert rows[stopper]["baseline"]["acceptance_lengths"] == rows[stopper]["trained"]["acceptance_lengths"] == []
    assert report["no_verify"]["left_out"] == [{"id": stopper, "reason": f"the teacher's first token is a stop token (`{token}`)"}]
    kept = [r for i, r in rows.items() if i != stopper]
    assert all(r["baseline"]["acceptance_lengths"] and r["trained"]["acceptance_lengths"] for r in kept)
    assert (report["no_verify"]["prompts"], report["scored_prompts"], report["prompts"]) == (1, 2, 3)
    for name in ("baseline", "trained"):
        assert report[name]["tau_mean"] == sum(r[name]["tau"] for r in kept) / 2  # no tau 0 averaged in
        assert report[name]["verify_steps"] == sum(len(r[name]["acceptance_lengths"]) for r in kept)
    assert sum(report["verdict_counts"].values()) == 2
    md = (tmp_path / "stops-report" / "report.md").read_text()
    assert f"Prompts with no verify step: 1 of 3, left out of the per-prompt figures: `{stopper}` (the teacher's first token" in md
    assert f"| `{stopper}` | {rows[stopper]['prompt_tokens']} | off | - | - | no verify step |" in md


def test_min_and_max_context_select_prompts_by_length_and_long_prompts_fill_their_bucket(pipeline, evaluated, tmp_path):
    from dflash_worker.data import load_tokenizer, render_prompt

    res, _, _, _ = evaluated
    # ~5.5 tokens a word with the tiny tokenizer: ~1.7k and ~5k tokens, and two short prompts
    data, examples = _prepared(tmp_path, "long", [" ".join(WORDS8[i % 8] + str(i % 5) for i in range(n)) for n in (300, 900)]
                               + ["short one alpha", "short two beta"])
    tok = load_tokenizer(pipeline.target)
    length = {ex.id: len(render_prompt(tok, ex.prompt_messages, thinking="off")) for ex in examples}
    mid = [i for i, n in length.items() if 1024 <= n < 4000]
    big = [i for i, n in length.items() if 4096 <= n < 16000]
    assert len(mid) == len(big) == 1, length
    out = tmp_path / "long-report"
    proc = worker_cli("evaluate", "--run", res.run_dir, "--data", data, "--split", "test", "--min-context", "1024",
                      "--output", out, "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    rows = {r["id"]: r for r in report["per_prompt"]}
    assert sorted(rows) == sorted(mid + big)
    assert report["context_filter"] == {"min_tokens": 1024, "max_tokens": None}
    for name in ("baseline", "trained"):
        buckets = {b["bucket"]: b for b in report[name]["buckets"]}
        # every step of a prompt stays in its prompt's bucket (64 new tokens move no anchor across an edge here)
        for label, ids in (("1k-4k", mid), ("4k-16k", big)):
            lengths = rows[ids[0]][name]["acceptance_lengths"]
            assert (buckets[label]["steps"], buckets[label]["committed_tokens"]) == (len(lengths), sum(lengths)) and lengths
        assert buckets["0-1k"]["tau"] is None and buckets["16k+"]["tau"] is None
    md = (out / "report.md").read_text()
    assert "Prompts selected by length: 1024 to any tokens." in md and "| 0-1k | empty | 0 | empty | 0 |" in md
    proc = worker_cli("evaluate", "--run", res.run_dir, "--data", data, "--split", "test", "--max-context", "1023",
                      "--output", tmp_path / "short-report", "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert sorted(r["id"] for r in json.loads(proc.stdout)["per_prompt"]) == sorted(set(length) - set(mid + big))


@pytest.mark.parametrize(("flags", "message"), [
    (("--min-context", "-1"), "`--min-context` is `-1`, it must be a token count >= 0"),
    (("--min-context", "4096", "--max-context", "1024"), "`--min-context` `4096` is above `--max-context` `1024`"),
    (("--min-context", "100000"), "has no prompts of 100000 to any tokens"),
])
def test_bad_or_empty_context_bounds_are_clear_errors(evaluated, flags, message):
    res, _, _, _ = evaluated
    proc = worker_cli("evaluate", "--run", res.run_dir, "--split", "val", *flags, timeout=300)
    assert proc.returncode == 1 and message in proc.stderr and "hint: " in proc.stderr, proc.stderr


def test_per_row_thinking_renders_each_prompt_in_its_mode_and_reports_tau_per_mode(pipeline, evaluated, tmp_path):
    import dataclasses

    from dflash_worker.data import PreparedData, load_tokenizer, prepare_data, render_prompt
    from dflash_worker.evaluate.breakdown import summary_lines
    from dflash_worker.evaluate.report import evaluate_run
    from dflash_worker.recipe import load_recipe

    res, _, _, _ = evaluated
    rows = tmp_path / "mixed.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"mixed{i} alpha beta gamma", "response": "delta epsilon", "thinking": i % 2 == 0})
                            + "\n" for i in range(6)))
    data = tmp_path / "mixed-data"
    prepare_data([rows], data, seed=5, val_fraction=0.0, test_fraction=0.99)
    examples = list(PreparedData(data).iter_split("test"))
    assert {ex.thinking for ex in examples} == {True, False}
    base = load_recipe(pipeline.recipe("eval-run", steps=4, val_every=2, checkpoint_every=2, lr=1e-2))
    recipe = dataclasses.replace(base, data=dataclasses.replace(base.data, thinking="per_row"))
    report = evaluate_run(res.run_dir, split="test", data_dir=data, recipe=recipe, out_dir=tmp_path / "mixed-report")
    tok = load_tokenizer(pipeline.target)
    by_id = {ex.id: ex for ex in examples}
    for row in report["per_prompt"]:
        ex = by_id[row["id"]]
        assert row["thinking"] == ("on" if ex.thinking else "off")
        # each prompt in its own mode: the length of the template's own rendering with that `enable_thinking`
        assert row["prompt_tokens"] == len(render_prompt(tok, ex.prompt_messages, thinking=ex.thinking))
    assert len({len(render_prompt(tok, examples[0].prompt_messages, thinking=t)) for t in (True, False)}) == 2  # modes differ
    for name in ("baseline", "trained"):
        modes = report[name]["modes"]
        assert sorted(modes) == ["off", "on"]
        for mode, m in modes.items():
            mine = [a for r in report["per_prompt"] if r["thinking"] == mode for a in r[name]["acceptance_lengths"]]
            assert (m["steps"], m["tau"]) == (len(mine), sum(mine) / len(mine))
            assert m["prompts"] == sum(1 for r in report["per_prompt"] if r["thinking"] == mode)
    b, t = report["baseline"]["modes"], report["trained"]["modes"]
    line = summary_lines(report)[0]  # what `evaluate` prints after its headline
    assert line == ("evaluate: per thinking mode, acceptance length (pooled) baseline -> trained: "
                    f"off {b['off']['tau']:.3f} -> {t['off']['tau']:.3f} ({b['off']['prompts']} prompts); "
                    f"on {b['on']['tau']:.3f} -> {t['on']['tau']:.3f} ({b['on']['prompts']} prompts)")
    md = (tmp_path / "mixed-report" / "report.md").read_text()
    assert f"| on | {b['on']['prompts']} | {b['on']['tau']:.3f} | {t['on']['tau']:.3f} |" in md
