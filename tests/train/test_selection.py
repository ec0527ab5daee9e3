"""The selection rule and the general-domain guard (`train.selection`) on plain validation histories:
no model, no run directory."""

from __future__ import annotations

from dflash_worker.train import selection
from dflash_worker.train.selection import VAL_KEYS


def _v(step: int, mp: float, general: float | None = None, blocks: int = 8, general_blocks: int = 8) -> dict:
    """A validation entry as `Validator.validate` writes it (only the keys selection reads, plus `ce`)."""
    entry = {"step": step, "matching_proposals": mp, "blocks": blocks, "ce": 1.0 / (step + 1)}
    if general is not None:
        entry["general"] = {"matching_proposals": general, "blocks": general_blocks}
    return entry


RELEASED = {"step": 0, "examples": 4, "matching_proposals": 2.0, "blocks": 8, "ce": 0.5, "selector_ce": None,
            "reached": 1, "covered": 1, "selected": 1, "own": {"matching_proposals": 1.5, "blocks": 8, "ce": 0.7}}


def _guard(history, released=RELEASED, tolerance=0.1, patience=0, stopped_at=None):
    return selection.guard_report(history, released, tolerance=tolerance, patience=patience, stopped_at=stopped_at)


def test_the_highest_matching_proposals_win_and_ties_go_to_the_earliest_step():
    history = [_v(2, 1.0), _v(4, 3.0), _v(6, 3.0), _v(8, 2.5)]
    assert selection.best(history, None, None, released_committed=False)["step"] == 4
    assert selection.best(list(reversed(history)), None, None, released_committed=False)["step"] == 4


def test_validations_that_scored_nothing_are_never_selected():
    history = [_v(2, 1.0), _v(4, 9.0, blocks=0)]
    assert selection.best(history, None, None, released_committed=False)["step"] == 2


def test_without_a_validation_the_last_step_is_selected():
    for history in ([], [_v(3, 5.0, blocks=0)]):
        chosen = selection.best(history, None, None, released_committed=False)
        assert chosen is None
        assert selection.selected_step(chosen, 12) == 12
    assert selection.selected_step(_v(4, 1.0), 12) == 4


def test_no_released_baseline_means_no_guard():
    history = [_v(2, 1.0, general=0.1)]
    assert _guard(history, released=None) is None
    assert _guard(history, released={**RELEASED, "blocks": 0}) is None


def test_the_guard_rejects_checkpoints_below_the_floor_and_selects_among_the_rest():
    # floor = (1 - 0.1) x 2.0 = 1.8
    history = [_v(2, 1.0, general=1.9), _v(4, 2.0, general=1.8), _v(6, 5.0, general=1.79), _v(8, 4.0, general=None)]
    guard = _guard(history)
    assert guard["floor"] == (1 - 0.1) * 2.0
    assert [(c["step"], c["rejected"]) for c in guard["checkpoints"]] == [(2, False), (4, False), (6, True), (8, True)]
    assert guard["rejected_steps"] == [6, 8] and guard["passed"] is True
    assert guard["released_general_matching_proposals"] == 2.0 and guard["released_general_blocks"] == 8
    # step 6 has the best own score, but forgot the general domain: the best kept one is step 4
    assert selection.best(history, guard, RELEASED, released_committed=True)["step"] == 4
    # the same history unguarded selects step 6
    assert selection.best(history, None, None, released_committed=False)["step"] == 6


def test_general_rows_that_scored_nothing_are_rejected():
    guard = _guard([_v(2, 1.0, general=5.0, general_blocks=0)])
    assert guard["checkpoints"][0]["rejected"] is True and guard["passed"] is False


def test_when_nothing_passes_the_released_draft_is_selected():
    history = [_v(2, 3.0, general=1.0), _v(4, 4.0, general=1.2)]
    guard = _guard(history)
    assert guard["passed"] is False
    chosen = selection.best(history, guard, RELEASED, released_committed=True)
    assert chosen["step"] == 0
    assert chosen["matching_proposals"] == 1.5 and chosen["ce"] == 0.7  # the released draft's own rows
    assert chosen["general"] == {k: RELEASED.get(k) for k in VAL_KEYS}
    assert selection.selected_step(chosen, 4) == 0


def test_without_a_released_checkpoint_the_fallback_is_the_highest_general_earliest_on_ties():
    history = [_v(2, 3.0, general=1.0), _v(4, 4.0, general=1.5), _v(6, 5.0, general=1.5), _v(8, 6.0)]
    guard = _guard(history)
    assert guard["passed"] is False
    assert selection.best(history, guard, RELEASED, released_committed=False)["step"] == 4


def test_patience_stops_after_that_many_rejections_in_a_row():
    kept, lost = 1.9, 1.0
    assert not selection.guard_exhausted(_guard([_v(2, 1.0, lost)]), 2)  # fewer validations than the patience
    assert selection.guard_exhausted(_guard([_v(2, 1.0, lost), _v(4, 1.0, lost)]), 2)
    assert not selection.guard_exhausted(_guard([_v(2, 1.0, lost), _v(4, 1.0, kept)]), 2)
    assert selection.guard_exhausted(_guard([_v(2, 1.0, kept), _v(4, 1.0, lost), _v(6, 1.0, lost)]), 2)
    assert not selection.guard_exhausted(_guard([_v(2, 1.0, lost), _v(4, 1.0, kept), _v(6, 1.0, lost)]), 2)
    assert not selection.guard_exhausted(_guard([_v(2, 1.0, lost)]), 0)  # 0: off
    assert not selection.guard_exhausted(None, 1)  # no guard
    guard = _guard([_v(2, 1.0, lost)], patience=3, stopped_at=2)
    assert guard["patience"] == 3 and guard["stopped_at"] == 2


def test_pruning_keeps_the_best_checkpoint_and_the_released_one():
    assert selection.protected_steps(None, None) == set()
    assert selection.protected_steps(_v(6, 1.0), None) == {6}
    assert selection.protected_steps(_v(6, 1.0), RELEASED) == {0, 6}
    assert selection.protected_steps(None, RELEASED) == {0}


def test_the_record_names_the_rule_and_the_history():
    history = [_v(2, 1.0, general=1.9), _v(4, 2.0, general=1.0)]
    plain = selection.record(history[1], None, history, step=4, checkpoint="step-00000004",
                             checkpoint_manifest_sha256="ab", total_steps=4)
    assert plain["rule"] == selection.RULE and "guard" not in plain
    assert plain["history"] == [{"step": 2, "matching_proposals": 1.0}, {"step": 4, "matching_proposals": 2.0}]
    assert (plain["step"], plain["checkpoint"], plain["validation"]["step"]) == (4, "step-00000004", 4)
    guard = _guard(history)
    guarded = selection.record(history[0], guard, history, step=2, checkpoint="step-00000002",
                               checkpoint_manifest_sha256="cd", total_steps=4)
    assert guarded["rule"] == selection.GUARDED_RULE and guarded["guard"] is guard
    assert [h["general_matching_proposals"] for h in guarded["history"]] == [1.9, 1.0]


def _note(history, guard, released=RELEASED, released_committed=True):
    """`guard_note` of the selection.json record the run writes for `history` under `guard`."""
    chosen = selection.best(history, guard, released, released_committed=released_committed)
    rec = selection.record(chosen, guard, history, step=chosen["step"], checkpoint="c", checkpoint_manifest_sha256="m",
                           total_steps=history[-1]["step"])
    return selection.guard_note(rec, released_committed=released_committed)


def test_the_guard_note_warns_only_when_nothing_passed():
    history = [_v(2, 1.0, general=1.9), _v(4, 2.0, general=1.0)]
    note, warning = _note(history, _guard(history))
    assert note == "; the general-domain guard rejected steps: 4" and warning is None
    failed = [_v(2, 1.0, general=1.0)]
    note, warning = _note(failed, _guard(failed))
    assert "guard.passed` false" in note
    assert warning.startswith("the export is the released draft (it adapts nothing): no checkpoint kept general-domain validation "
                              "matching proposals within 10% of the released draft's (2.0000)\nhint: ")
    assert warning.endswith("or `[train].interpolate = \"auto\"`")
    _, warning = _note(failed, _guard(failed), released_committed=False)
    assert warning.startswith("no checkpoint kept general-domain matching proposals within 10%")
    assert "selected the one with the highest general acceptance instead" in warning


# Thinking modes (`[data].thinking = "per_row"`): the released draft served `on` at 3.0 and `off` at 1.0.
RELEASED_MODES = {**RELEASED, "modes": {"on": {"matching_proposals": 3.0, "blocks": 8}, "off": {"matching_proposals": 1.0, "blocks": 8},
                                        "never": {"matching_proposals": 0.0, "blocks": 0}}}


def _m(step: int, mp: float, general: float, on: float, off: float, on_blocks: int = 8) -> dict:
    return {**_v(step, mp, general=general), "modes": {"on": {"matching_proposals": on, "blocks": on_blocks},
                                                        "off": {"matching_proposals": off, "blocks": 8}}}


def test_a_checkpoint_is_rejected_when_one_mode_falls_while_the_pooled_figure_rises():
    # floors: on 0.9 x 3.0 = 2.7, off 0.9 x 1.0 = 0.9 (`never` scored nothing for the released draft: not guarded)
    history = [_m(2, 1.6, 1.9, on=2.9, off=1.2), _m(4, 2.4, 1.95, on=2.6, off=2.2), _m(6, 2.0, 1.9, on=2.7, off=1.5)]
    guard = _guard(history, released=RELEASED_MODES)
    # step 4: best pooled and general figures, and `off` doubled, but `on` fell to 2.6 < 2.7
    assert [(c["step"], c["rejected"], c["modes_below"]) for c in guard["checkpoints"]] == [(2, False, []), (4, True, ["on"]),
                                                                                           (6, False, [])]
    assert guard["modes"] == {"off": {"released_matching_proposals": 1.0, "released_blocks": 8, "floor": 0.9 * 1.0},
                              "on": {"released_matching_proposals": 3.0, "released_blocks": 8, "floor": 0.9 * 3.0}}
    assert guard["checkpoints"][1]["modes"] == {"off": 2.2, "on": 2.6}
    assert selection.best(history, guard, RELEASED_MODES, released_committed=True)["step"] == 6
    # without per-mode figures the same history selects step 4
    assert selection.best(history, _guard(history), RELEASED, released_committed=True)["step"] == 4
    note, warning = _note(history, guard, released=RELEASED_MODES)
    assert note == "; the general-domain guard rejected steps: 4 (thinking on fell)" and warning is None
    rec = selection.record(history[2], guard, history, step=6, checkpoint="step-00000006", checkpoint_manifest_sha256="ef",
                           total_steps=6)
    assert rec["rule"] == selection.GUARDED_RULE + selection.MODES_RULE
    assert rec["history"][1]["modes_matching_proposals"] == {"on": 2.6, "off": 2.2}


def test_a_mode_that_scored_nothing_is_rejected_and_when_no_checkpoint_keeps_every_mode_the_released_draft_is_selected():
    history = [_m(2, 2.0, 1.9, on=3.5, off=0.5), _m(4, 2.5, 1.9, on=9.0, off=1.0, on_blocks=0)]
    guard = _guard(history, released=RELEASED_MODES)
    assert [c["modes_below"] for c in guard["checkpoints"]] == [["off"], ["on"]] and guard["passed"] is False
    chosen = selection.best(history, guard, RELEASED_MODES, released_committed=True)
    assert chosen["step"] == 0 and chosen["modes"] == RELEASED_MODES["modes"]
    _, warning = _note(history, guard, released=RELEASED_MODES)
    assert warning.startswith("the export is the released draft (it adapts nothing): no checkpoint kept general-domain validation "
                              "matching proposals, and on each thinking mode it served (off, on), within 10% of the released draft's")


def test_without_per_mode_figures_the_guard_is_what_it_was():
    history = [_v(2, 1.0, general=1.9)]
    guard = _guard(history)
    assert "modes" not in guard and "modes_below" not in guard["checkpoints"][0]
    assert selection.record(history[0], guard, history, step=2, checkpoint="c", checkpoint_manifest_sha256="a",
                            total_steps=2)["rule"] == selection.GUARDED_RULE
    assert selection.mode_floors(RELEASED, 0.1) == {}
    assert "thinking" not in selection.released_note(RELEASED, 0.1)
    assert selection.released_note(RELEASED_MODES, 0.1).endswith(
        "; thinking `off`: 1.0000, kept at or above 0.9000; thinking `on`: 3.0000, kept at or above 2.7000")
