"""`evaluate.breakdown` and the report's use of it on hand-built rows: prompts with no verify step
counted apart, each step attributed to its anchor's context bucket, pooled tau per thinking mode."""

from __future__ import annotations

import pytest

from dflash_worker.errors import ConfigError
from dflash_worker.evaluate import breakdown
from dflash_worker.evaluate.report import context_bounds, render_markdown, step_stats, summarize


def _row(pid: str, prompt_tokens: int, base: list[int], trained: list[int] | None = None, *, thinking: str = "off",
         stopped_on: int | None = None) -> dict:
    trained = base if trained is None else trained
    return {"id": pid, "prompt_tokens": prompt_tokens, "thinking": thinking, "verdict": "tied",
            "baseline": {**step_stats(base, 4), "acceptance_lengths": base, "stopped_on": stopped_on},
            "trained": {**step_stats(trained, 4), "acceptance_lengths": trained, "stopped_on": stopped_on}}


def test_anchor_positions_start_after_the_prompt_and_move_by_the_tokens_each_step_committed():
    assert breakdown.anchor_positions(1000, [10, 20, 5]) == [1000, 1010, 1030]
    assert breakdown.anchor_positions(7, []) == []


def test_bucket_edges_are_token_counts():
    got = [breakdown.bucket_of(p) for p in (0, 1023, 1024, 4095, 4096, 16383, 16384, 10**6)]
    assert got == ["0-1k", "0-1k", "1k-4k", "1k-4k", "4k-16k", "4k-16k", "16k+", "16k+"]
    with pytest.raises(ValueError):
        breakdown.bucket_of(-1)


def test_each_step_counts_in_the_bucket_of_its_anchor_and_empty_buckets_are_empty_not_zero():
    # prompt of 1020 tokens: anchors 1020 (0-1k, 3 tokens), 1023 (0-1k, 2), 1025 (1k-4k, 4), 1029 (1k-4k, 1)
    rows = [_row("a", 1020, [3, 2, 4, 1], [1, 1, 1, 1]),
            # a 5000-token prompt: anchors 5000, 5002 (4k-16k)
            _row("b", 5000, [2, 2], [4, 2])]
    base = {b["bucket"]: b for b in breakdown.by_bucket(rows, "baseline")}
    assert [b["bucket"] for b in breakdown.by_bucket(rows, "baseline")] == ["0-1k", "1k-4k", "4k-16k", "16k+"]
    assert (base["0-1k"]["steps"], base["0-1k"]["committed_tokens"], base["0-1k"]["tau"]) == (2, 5, 2.5)
    assert (base["1k-4k"]["steps"], base["1k-4k"]["tau"]) == (2, 2.5)
    assert (base["4k-16k"]["steps"], base["4k-16k"]["tau"]) == (2, 2.0)
    assert (base["16k+"]["steps"], base["16k+"]["tau"], base["16k+"]["committed_tokens"]) == (0, None, 0)
    trained = {b["bucket"]: b for b in breakdown.by_bucket(rows, "trained")}
    # the trained draft committed fewer tokens per step, so its anchors stay in 0-1k longer: 1020..1023
    assert (trained["0-1k"]["steps"], trained["1k-4k"]["steps"], trained["4k-16k"]["tau"]) == (4, 0, 3.0)
    assert trained["1k-4k"]["tau"] is None
    # every step is in exactly one bucket
    assert sum(b["steps"] for b in base.values()) == 6 and sum(b["committed_tokens"] for b in base.values()) == 14
    md = "\n".join(breakdown.markdown(_report(rows)))
    assert "| 16k+ | empty | 0 | empty | 0 |" in md and "| 1k-4k | 2.500 | 2 | empty | 0 |" in md


def _report(rows: list[dict]) -> dict:
    b, t = summarize(rows, "baseline", 4), summarize(rows, "trained", 4)
    scored = [r for r in rows if breakdown.made_steps(r)]
    return {"run": "r", "split": "test", "prompts": len(rows), "baseline": b, "trained": t, "selection_step": 1,
            "verdict": "tied", "tie_rule": "rule", "tie_tolerance": 0.02,
            "verdict_counts": {"improved": 0, "tied": len(scored), "regressed": 0}, "temperature": 0.0, "max_new_tokens": 8,
            "data": "d", "data_source": "run", "stop_token_ids": [1], "stop_token_rule": "rule", "lossless": None,
            "no_verify": breakdown.no_verify(rows), "context_filter": None, "per_prompt": rows}


def test_a_prompt_with_no_verify_step_is_counted_apart_and_left_out_of_the_per_prompt_mean():
    # the issue's shape: half the prompts stopped at once; averaged in as tau 0 they halved the mean
    rows = [_row("stops", 12, [], stopped_on=7), _row("p1", 12, [1, 1]), _row("none", 12, []), _row("p2", 12, [2, 2])]
    s = summarize(rows, "baseline", 4)
    assert s["tau_mean"] == (1.0 + 2.0) / 2  # not (0 + 1 + 0 + 2) / 4
    assert s["tau_pooled"] == 6 / 4 and s["verify_steps"] == 4  # pooled unchanged: no step, no token
    nv = breakdown.no_verify(rows)
    assert nv["prompts"] == 2
    assert nv["left_out"] == [{"id": "stops", "reason": "the teacher's first token is a stop token (`7`)"},
                              {"id": "none", "reason": "`max_new_tokens` ended the generation at its first token"}]
    md = render_markdown(_report(rows))
    assert "Prompts with no verify step: 2 of 4, left out of the per-prompt figures: `stops` (the teacher's first token" in md
    assert "| `stops` | 12 | off | - | - | no verify step | - |" in md
    assert "per-prompt mean: baseline 1.500 -> trained 1.500" in md
    lines = breakdown.summary_lines(_report(rows))
    assert lines[-1] == ("evaluate: 2 of 4 prompts made no verify step (the generation ended at the first token), "
                         "left out of the per-prompt figures")


def test_pooled_tau_per_thinking_mode_only_for_the_modes_present():
    rows = [_row("a", 10, [1, 1], [3, 3], thinking="on"), _row("b", 10, [2], [2], thinking="off"),
            _row("c", 10, [], thinking="on")]
    modes = summarize(rows, "trained", 4)["modes"]
    assert modes == {"off": {"prompts": 1, "no_verify_prompts": 0, "steps": 1, "committed_tokens": 2, "tau": 2.0},
                     "on": {"prompts": 2, "no_verify_prompts": 1, "steps": 2, "committed_tokens": 6, "tau": 3.0}}
    assert list(summarize(rows[1:2], "trained", 4)["modes"]) == ["off"]
    line = breakdown.summary_lines(_report(rows))[0]
    assert line == "evaluate: per thinking mode, acceptance length (pooled) baseline -> trained: off 2.000 -> 2.000 (1 prompts); " \
                   "on 1.000 -> 3.000 (2 prompts)"


@pytest.mark.parametrize(("lo", "hi", "message"), [
    (-1, None, "`--min-context` is `-1`, it must be a token count >= 0"),
    (None, -5, "`--max-context` is `-5`, it must be a token count >= 0"),
    (4096, 1024, "`--min-context` `4096` is above `--max-context` `1024`"),
])
def test_bad_context_bounds_are_refused(lo, hi, message):
    with pytest.raises(ConfigError, match=message):
        context_bounds(lo, hi)


def test_context_bounds_default_to_every_prompt():
    assert context_bounds(None, None) == (0, None)
    assert context_bounds(1024, 1024) == (1024, 1024)
    assert context_bounds(None, 0) == (0, 0)
