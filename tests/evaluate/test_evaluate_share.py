"""`evaluate.report._evaluate_share`: which prompts a rank evaluates, the progress it reports, and the
gathered rows, with the per-prompt work replaced by a stand-in (the real run is test_evaluate_report.py)."""

from __future__ import annotations

import pytest

from dflash_worker import dist
from dflash_worker.evaluate import report

PROMPTS = [report._Prompt(f"p{i}", [i, i + 1], "off") for i in range(7)]


@pytest.fixture
def evaluated(monkeypatch) -> list[int]:
    """The prompt indices `_evaluate_prompt` is called with, in order."""
    seen: list[int] = []

    def fake(models, i, prompt):
        assert prompt == PROMPTS[i]
        seen.append(i)
        return {"id": prompt.id}

    monkeypatch.setattr(report, "_evaluate_prompt", fake)
    return seen


def test_one_rank_evaluates_its_share_in_order_reporting_progress(evaluated) -> None:
    events = []
    share = [1, 3, 5]
    pairs = report._evaluate_share(None, PROMPTS, share, dist.Ranks(), events.append)
    assert evaluated == share
    assert pairs == [(1, {"id": "p1"}), (3, {"id": "p3"}), (5, {"id": "p5"})]
    assert [(e.phase, e.step, e.total_steps) for e in events] == [("evaluate", 1, 3), ("evaluate", 2, 3), ("evaluate", 3, 3)]


def test_a_rank_takes_every_world_th_prompt_of_the_share_and_rows_come_back_in_prompt_order(evaluated, monkeypatch) -> None:
    share = [0, 2, 3, 4, 6]
    # Rank 1 of 2 evaluates share[1] and share[3]; rank 0's rows arrive through the gather.
    monkeypatch.setattr(dist, "gather", lambda ranks, local: [[(6, {"id": "p6"}), (0, {"id": "p0"}), (3, {"id": "p3"})], local])
    events = []
    pairs = report._evaluate_share(None, PROMPTS, share, dist.Ranks(rank=1, world=2), events.append)
    assert evaluated == [2, 4]
    assert [i for i, _ in pairs] == share
    assert [e.step for e in events] == [2, 4]  # counted over all ranks, capped at the share


def test_rows_lost_in_the_gather_are_an_error(evaluated, monkeypatch) -> None:
    monkeypatch.setattr(dist, "gather", lambda ranks, local: [local[:1]])
    with pytest.raises(RuntimeError, match="evaluation gathered 1 rows for 2 prompts over 1 ranks"):
        report._evaluate_share(None, PROMPTS, [0, 1], dist.Ranks(), lambda e: None)
