"""Which checkpoint a run selects, and the general-domain guard: pure functions of the validation history.

A validation entry (`validate.Validator.validate`) is a dict with ``step``, the `VAL_KEYS` of the own
rows and, with general val rows, ``general`` (the same keys on those rows); ``blocks == 0`` means
nothing was scored. The functions here read such lists and never touch a model or a file, so each
rule is testable on plain lists (tests/train/test_selection.py).

Selection rule: the validated checkpoint with the highest mean matching
proposals on the validation split (ties: the earliest step). A checkpoint is
committed at every validation step and the best one is never pruned. Without
a validation split (or with ``val_every = 0`` and no val examples) the last
step is selected.

General-domain guard: when the capture's val split holds general rows
(`prepare-data --replay-val-fraction`, listed in the capture manifest's
``data.replay.val_ids``), validation measures the own rows and the general
rows apart (the first `val_examples` of each), and the run measures the
released draft on the general rows once, before the first update, through the
same export-values path (``released_general``, kept in every checkpoint). The
rule then becomes: among validated checkpoints whose general matching
proposals are at least ``(1 - [train].general_tolerance) x`` the released
draft's, the highest own matching proposals (ties: the earliest step). A
fresh guarded run commits a checkpoint at step 0 (the released draft as
loaded, never pruned) after measuring it, own rows too
(``released_general.own``); when no trained checkpoint passes, that one is
selected: the export is the released draft, ``selection.json``'s
``guard.passed`` is false and a warning says so. (A run resumed from
checkpoints written before step 0 was committed falls back to the checkpoint
with the highest general matching proposals.)
``guard`` lists every validated step and whether the guard rejected it. With
``[train].guard_patience = P > 0`` the run stops once the guard rejected P
validations in a row (training further only forgets more), selects and
exports as above, and ``selection.json``'s ``guard.stopped_at`` names the step
(None when the run trained every step). Without general rows nothing of this
exists: validation, metrics and ``selection.json`` are what they were.

Thinking modes: when each val row's thinking mode is known (``[data].thinking = "per_row"``), a
validation entry and the released baseline also carry ``modes``: the `VAL_KEYS` over the scored
val rows (own and general) of each mode. The guard then also guards each mode the released draft
served (a mode it was measured on, ``blocks > 0``): a checkpoint is rejected when any such mode's
matching proposals fall below ``(1 - general_tolerance) x`` the released draft's on that mode,
even if its pooled and general figures rose (a draft adapted on one mode must not lose the
other). The report names each checkpoint's modes below their floor (``modes_below``).

Interpolation: with ``[train].interpolate = "auto"`` a guarded run may export a point between the
released draft and its best own-domain checkpoint instead (`train.interpolate`, which scores the points
with `guarded`); ``selection.json`` then carries ``interpolation``, and `outcome` is the one line
`train` and `evaluate` print when the export is such a point or the released draft itself.
"""

from __future__ import annotations

from typing import Any

# The measures of one validation that the history, the metrics line (``val``, ``val_general``) and
# ``selection.json`` keep.
VAL_KEYS = ("matching_proposals", "ce", "selector_ce", "blocks", "reached", "covered", "selected")

RULE = ("highest validation matching proposals (mean accepted tokens per block against the "
        "teacher's continuation), earliest step on ties; the last step when nothing was validated")
GUARDED_RULE = ("highest own-domain validation matching proposals among the checkpoints whose general-domain "
                "matching proposals are at least (1 - tolerance) x the released draft's, earliest step on ties; "
                "when none is, the released draft itself (step 0; `guard.passed` false)")
MODES_RULE = ("; each thinking mode the released draft served is guarded the same way: a checkpoint whose matching "
              "proposals on any such mode fall below (1 - tolerance) x the released draft's on it is rejected")


def guard_report(
    history: list[dict[str, Any]],
    released: dict[str, Any] | None,
    *,
    tolerance: float,
    patience: int,
    stopped_at: int | None,
) -> dict[str, Any] | None:
    """The general-domain guard over `history` (module docstring), as ``selection.json`` records it;
    None when the run has no released general baseline (`released`: no general val rows). With
    per-mode figures (``modes``) each mode the released draft served is guarded too."""
    if released is None or not released.get("blocks"):
        return None
    floor = (1.0 - tolerance) * released["matching_proposals"]
    floors = mode_floors(released, tolerance)
    steps = [{"step": v["step"], **guarded(v, floor, floors)} for v in history if v.get("blocks", 0) > 0]
    extra = {} if not floors else {"modes": {m: {"released_matching_proposals": released["modes"][m]["matching_proposals"],
                                                 "released_blocks": released["modes"][m]["blocks"], "floor": f}
                                             for m, f in floors.items()}}
    return {
        "tolerance": tolerance,
        "released_general_matching_proposals": released["matching_proposals"],
        "released_general_blocks": released["blocks"],
        "floor": floor,
        "passed": any(not c["rejected"] for c in steps),
        "rejected_steps": [c["step"] for c in steps if c["rejected"]],
        "patience": patience,
        "stopped_at": stopped_at,
        "checkpoints": steps,
        **extra,
    }


def guarded(entry: dict[str, Any], floor: float, floors: dict[str, float]) -> dict[str, Any]:
    """What the guard records of validation `entry` (a checkpoint's, or an interpolated point's): its own
    and general matching proposals and whether it is ``rejected`` (general below `floor`, or scored
    nothing, or, with per-mode `floors`, any mode below its floor: ``modes_below``)."""
    g = entry.get("general") or {}
    below = modes_below(entry, floors)
    kept = bool(g.get("blocks")) and g["matching_proposals"] >= floor and not below
    out = {"matching_proposals": entry["matching_proposals"], "general_matching_proposals": g.get("matching_proposals"),
           "rejected": not kept}
    if floors:
        out["modes"] = {m: (entry.get("modes") or {}).get(m, {}).get("matching_proposals") for m in floors}
        out["modes_below"] = below
    return out


def released_entry(released: dict[str, Any]) -> dict[str, Any]:
    """The released draft's measurement (`Validator.measure_released`) as a validation entry of step 0:
    its own rows' figures, ``general`` its general rows', and its ``modes``; what selecting it records."""
    modes = {"modes": released["modes"]} if released.get("modes") else {}
    return {"step": 0, **(released.get("own") or {}), "general": {k: released.get(k) for k in VAL_KEYS}, **modes}


def mode_floors(released: dict[str, Any], tolerance: float) -> dict[str, float]:
    """Each thinking mode the released draft served (measured on, ``blocks > 0``) and its floor,
    ``(1 - tolerance) x`` the released draft's matching proposals on that mode; {} without modes."""
    modes = released.get("modes") or {}
    return {m: (1.0 - tolerance) * f["matching_proposals"] for m, f in sorted(modes.items()) if f.get("blocks")}


def modes_below(entry: dict[str, Any], floors: dict[str, float]) -> list[str]:
    """The modes of `floors` on which validation `entry` fell below the floor (or scored nothing)."""
    modes = entry.get("modes") or {}
    return [m for m, f in floors.items() if not (modes.get(m) or {}).get("blocks") or modes[m]["matching_proposals"] < f]


def guard_exhausted(guard: dict[str, Any] | None, patience: int) -> bool:
    """Whether `[train].guard_patience` (`patience`, 0: off) stops the run: the guard rejected the
    last `patience` validations, all of them."""
    if patience <= 0 or guard is None or len(guard["checkpoints"]) < patience:
        return False
    return all(c["rejected"] for c in guard["checkpoints"][-patience:])


def best(
    history: list[dict[str, Any]],
    guard: dict[str, Any] | None,
    released: dict[str, Any] | None,
    *,
    released_committed: bool,
) -> dict[str, Any] | None:
    """The selected validation entry: highest matching proposals, earliest step on ties; with the
    general-domain `guard`, among the checkpoints it keeps (none kept: the released draft, step 0,
    when the run committed it (`released_committed`), else, for runs from before it was committed,
    the highest general ones). None when nothing was validated."""
    scored = [v for v in history if v.get("blocks", 0) > 0]
    if not scored:
        return None
    if guard is None:
        return max(scored, key=lambda v: (v["matching_proposals"], -v["step"]))
    kept = {c["step"] for c in guard["checkpoints"] if not c["rejected"]}
    if kept:
        return max((v for v in scored if v["step"] in kept), key=lambda v: (v["matching_proposals"], -v["step"]))
    if released_committed:
        return released_entry(released or {})
    return max(scored, key=lambda v: ((v.get("general") or {}).get("matching_proposals", -1.0), -v["step"]))


def selected_step(chosen: dict[str, Any] | None, last_step: int) -> int:
    """The step a run selects: `best`'s, else (nothing validated) the last step trained."""
    return chosen["step"] if chosen else last_step


def protected_steps(chosen: dict[str, Any] | None, released: dict[str, Any] | None) -> set[int]:
    """Checkpoints pruning must keep: the best one, and step 0 (the released draft the guard falls
    back to) once the run measured a released baseline."""
    protect = {chosen["step"]} if chosen else set()
    if released is not None:
        protect.add(0)
    return protect


def record(
    chosen: dict[str, Any] | None,
    guard: dict[str, Any] | None,
    history: list[dict[str, Any]],
    *,
    step: int,
    checkpoint: str,
    checkpoint_manifest_sha256: str,
    total_steps: int,
    interpolation: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``selection.json`` before its export is added: the rule, the selected `step` and its `checkpoint`
    (directory name and manifest sha256), its validation entry (`chosen`), each validation's step and
    matching proposals (and, guarded, its general matching proposals), the `guard` report, and with
    `[train].interpolate = "auto"` the `interpolation` search (`train.interpolate.search`; its ``alpha``
    set: the export is that point, `chosen` its entry, `step` the checkpoint interpolated toward)."""
    rows = [{"step": v["step"], "matching_proposals": v["matching_proposals"]} for v in history]
    if guard is not None:
        for h, v in zip(rows, history, strict=True):
            h["general_matching_proposals"] = (v.get("general") or {}).get("matching_proposals")
            if "modes" in guard:
                h["modes_matching_proposals"] = {m: f.get("matching_proposals") for m, f in (v.get("modes") or {}).items()}
    return {
        "rule": RULE if guard is None else GUARDED_RULE + (MODES_RULE if "modes" in guard else ""),
        "step": step,
        "checkpoint": checkpoint,
        "checkpoint_manifest_sha256": checkpoint_manifest_sha256,
        "validation": chosen,
        "history": rows,
        "total_steps": total_steps,
        **({} if guard is None else {"guard": guard}),
        **({} if interpolation is None else {"interpolation": interpolation}),
    }


def outcome(record: dict[str, Any]) -> str | None:
    """One line on what a guarded selection (``selection.json`` `record`) exports when it is not simply the
    best kept checkpoint: an interpolated point (its alpha, and what it cost the own domain against the
    checkpoint), or the released draft itself because nothing kept the general domain within the
    tolerance; None otherwise (no guard, or a checkpoint the guard kept). `train` and `evaluate` print it."""
    guard, interp = record.get("guard"), record.get("interpolation") or {}
    if guard is None:
        return None
    tol, rel_general = guard["tolerance"], guard["released_general_matching_proposals"]
    if interp.get("alpha") is not None:
        v = record["validation"]
        own, ckpt_own, rel_own = v["matching_proposals"], interp["checkpoint_matching_proposals"], interp["released_matching_proposals"]
        gain = ckpt_own - rel_own
        kept = f", {(own - rel_own) / gain:.0%} of its gain" if gain > 0 else ""
        return (f"interpolated export: alpha {interp['alpha']:g} from the released draft toward step {interp['checkpoint_step']}; "
                f"own-domain validation matching proposals {own:.4f} (released {rel_own:.4f}, step {interp['checkpoint_step']} "
                f"{ckpt_own:.4f}: the interpolation cost {ckpt_own - own:.4f}{kept}), general {v['general']['matching_proposals']:.4f} "
                f"within {tol:.0%} of the released draft's {rel_general:.4f}")
    if guard["passed"] or record["step"] != 0:
        return None
    tried = f" and no interpolation ({len(interp['points']) - 2} points tried)" if interp.get("points") else ""
    return (f"the export is the released draft (it adapts nothing): no checkpoint{tried} kept general-domain validation "
            f"matching proposals{_modes_clause(guard)} within {tol:.0%} of the released draft's ({rel_general:.4f})")


def released_note(released: dict[str, Any], tolerance: float) -> str:
    """The message that reports the guard's baseline, the released draft's general acceptance."""
    floors = mode_floors(released, tolerance)
    modes = "".join(f"; thinking `{m}`: {released['modes'][m]['matching_proposals']:.4f}, kept at or above {f:.4f}"
                    for m, f in floors.items())
    return (
        f"released draft: general-domain matching proposals {released['matching_proposals']:.4f} on "
        f"{released['examples']} examples ({released['blocks']} blocks); the general-domain guard keeps checkpoints "
        f"at or above {(1.0 - tolerance) * released['matching_proposals']:.4f} (`general_tolerance` {tolerance}){modes}"
    )


def guard_note(record: dict[str, Any], released_committed: bool) -> tuple[str, str | None]:
    """(the guard's part of the result message, the warning to emit when nothing passed it, else None),
    for the guarded ``selection.json`` `record`."""
    guard = record["guard"]
    below = {c["step"]: c.get("modes_below") for c in guard["checkpoints"]}
    rejected = ", ".join(str(s) + (f" (thinking {', '.join(below[s])} fell)" if below.get(s) else "")
                         for s in guard["rejected_steps"]) or "none"
    if guard["passed"] or (record.get("interpolation") or {}).get("alpha") is not None:  # (interpolated: `outcome`, logged)
        return f"; the general-domain guard rejected steps: {rejected}", None
    hint = ("\nhint: lower `[train].lr`, validate earlier (`[train].val_every`), add replay rows "
            "(`prepare-data --replay-fraction`)" + (" or `[train].l2sp`" if "interpolation" in record
                                                     else ", `[train].l2sp`, or `[train].interpolate = \"auto\"`"))
    first = outcome(record) if released_committed else (
        f"no checkpoint kept general-domain matching proposals{_modes_clause(guard)} within {guard['tolerance']:.0%} of the "
        f"released draft's ({guard['released_general_matching_proposals']:.4f}); selected the one with the highest general "
        "acceptance instead")
    return "; no checkpoint passed the general-domain guard (selection.json `guard.passed` false)", f"{first}{hint}"


def _modes_clause(guard: dict[str, Any]) -> str:
    """With per-mode guarding, the words naming the thinking modes the guard also held; else ''."""
    return f", and on each thinking mode it served ({', '.join(guard['modes'])})," if guard.get("modes") else ""
