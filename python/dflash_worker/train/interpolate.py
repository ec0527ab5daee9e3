"""Interpolated exports (`[train].interpolate = "auto"`): weights on the line from the released draft to a checkpoint.

When the general-domain guard (`selection`) rejected the checkpoint with the highest own-domain
validation, the line of weights from the released draft (the guard's baseline, 0% general loss) to
that checkpoint may still pass through points inside the tolerance that keep part of its own gain.
After training, the run measures such points::

    theta(alpha) = (1 - alpha) * theta_released + alpha * theta_checkpoint

per trained tensor (tensors outside the scope are the released draft's either way), computed in
float32 on the CPU as ``released * (1 - alpha) + checkpoint * alpha`` (two rounded operations, the same
bytes on every run; `lerp`). ``theta_released`` is the released draft as training loads it
(`released_trainable`, what step 0 committed); ``theta_checkpoint`` the checkpoint's FP32 masters.

The search (`search`): alpha 0 is the released draft (kept by the guard by definition), alpha 1 the
checkpoint (rejected); `PASSES` bisection passes each validate ``theta(alpha)`` exactly as a checkpoint
is validated (`validate.Validator.validate`: own and general rows, each thinking mode, the export's
values) and keep the half of the interval whose low end the guard keeps. Of the points tried that the
guard keeps, the one with the highest own-domain matching proposals (ties: the smaller alpha) is
exported when it beats the guarded selection (the best kept checkpoint, else the released draft);
otherwise the selection stands and ``selection.json`` still lists the points tried. Alphas are
dyadic (k / 2^PASSES), so they and ``1 - alpha`` are exact in float32.

The export (`selected_trainable`) recomputes ``theta(alpha)`` from the selected checkpoint and the
released draft, so an export made again from ``selection.json`` has the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from . import checkpoint as ckpt
from .selection import guarded, mode_floors, released_entry

# Bisection passes per search: each is one validation of the own and general val rows.
PASSES = 6
RULE = ("the weights (1 - alpha) x released + alpha x checkpoint, for the checkpoint with the highest own-domain "
        "validation when the guard rejected it; alpha by bisection (the released draft at 0, the checkpoint at 1), "
        "each point validated like a checkpoint; the point the guard keeps with the highest own-domain matching "
        "proposals (ties: the smaller alpha) is exported when it beats the guarded selection")


def lerp(released: dict[str, torch.Tensor], trained: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """``theta(alpha)`` for every tensor of `trained`: float32 on the CPU, ``released * (1 - alpha) + trained * alpha``."""
    out = {}
    for name, t in trained.items():
        r = released[name].detach().to("cpu", torch.float32)
        out[name] = r * (1.0 - alpha) + t.detach().to("cpu", torch.float32) * alpha
    return out


def released_trainable(draft_dir: Path, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The released draft's values of the tensors `names` as training loads them (`model.load_draft`, FP32)."""
    from ..model import load_draft

    params = dict(load_draft(draft_dir, device="cpu", dtype=torch.float32).named_parameters())
    return {n: params[n].detach() for n in names}


def target(history: list[dict[str, Any]], guard: dict[str, Any] | None, committed: set[int]) -> dict[str, Any] | None:
    """The validation entry of the checkpoint to interpolate toward: the highest own-domain matching
    proposals among the trained validated checkpoints still `committed` (earliest on ties), when the
    guard rejected it; None otherwise (no guard, or the guard kept it: it is selected as it is)."""
    if guard is None:
        return None
    scored = [v for v in history if v.get("blocks", 0) > 0 and v["step"] > 0 and v["step"] in committed]
    if not scored:
        return None
    top = max(scored, key=lambda v: (v["matching_proposals"], -v["step"]))
    return top if top["step"] in guard["rejected_steps"] else None


def search(
    measure: Callable[[float], dict[str, Any]],
    top: dict[str, Any],
    released: dict[str, Any],
    chosen: dict[str, Any],
    *,
    tolerance: float,
    passes: int = PASSES,
) -> dict[str, Any]:
    """Bisect alpha between the released draft (0) and checkpoint `top` (1; the guard rejected it):
    `measure(alpha)` is the validation entry of ``theta(alpha)``; `released` the guard's baseline;
    `chosen` the guarded selection's entry. Returns ``selection.json``'s ``interpolation``: every
    point tried with the guard's verdict, and ``alpha`` (with ``validation``, the exported point's
    entry) when a kept point beats `chosen` on own-domain matching proposals, else ``alpha`` None."""
    floor = (1.0 - tolerance) * released["matching_proposals"]
    floors = mode_floors(released, tolerance)
    entries = {0.0: released_entry(released), 1.0: top}
    lo, hi = 0.0, 1.0
    for _ in range(passes):
        alpha = (lo + hi) / 2
        entries[alpha] = measure(alpha)
        if guarded(entries[alpha], floor, floors)["rejected"]:
            hi = alpha
        else:
            lo = alpha
    points = [{"alpha": a, **guarded(entries[a], floor, floors)} for a in sorted(entries)]
    inside = [p for p in points if not p["rejected"] and 0.0 < p["alpha"] < 1.0]
    best = max(inside, key=lambda p: (p["matching_proposals"], -p["alpha"]), default=None)
    used = best is not None and best["matching_proposals"] > chosen["matching_proposals"]
    return {
        "rule": RULE,
        "checkpoint_step": top["step"],
        "passes": passes,
        "alpha": best["alpha"] if used else None,
        "released_matching_proposals": entries[0.0]["matching_proposals"],
        "checkpoint_matching_proposals": top["matching_proposals"],
        "guarded_selection_matching_proposals": chosen["matching_proposals"],
        "points": points,
        "validation": {**entries[best["alpha"]], "alpha": best["alpha"]} if used else None,
    }


def measure_on(validator: Any, released: dict[str, torch.Tensor], trained: dict[str, torch.Tensor],
               step: int) -> Callable[[float], dict[str, Any]]:
    """`search`'s `measure` on a run's `validator` (`validate.Validator`): ``theta(alpha)`` swapped into
    the draft in place of its FP32 masters (`params.swapped`; the masters are back afterwards), then
    validated exactly as a checkpoint of `step` is (the export's values of those weights)."""
    from .params import swapped

    def measure(alpha: float) -> dict[str, Any]:
        with swapped(validator.scorer.parts.model, lerp(released, trained, alpha)):
            return validator.validate(step)

    return measure


def selected_trainable(run_dir: Path, draft_dir: Path, selection: dict[str, Any]) -> tuple[ckpt.Loaded, dict[str, torch.Tensor]]:
    """The selected checkpoint of `run_dir` and the trained values its export holds: the checkpoint's
    own, or, when ``selection.json`` chose an interpolated point (``interpolation.alpha``), ``theta(alpha)``
    between the released draft in `draft_dir` and that checkpoint."""
    loaded = ckpt.load(Path(run_dir) / ckpt.CHECKPOINTS / selection["checkpoint"])
    alpha = (selection.get("interpolation") or {}).get("alpha")
    if alpha is None:
        return loaded, dict(loaded.trainable)
    names = list(loaded.state["trainable"])
    return loaded, lerp(released_trainable(draft_dir, names), {n: loaded.trainable[n] for n in names}, float(alpha))


def protected(history: list[dict[str, Any]]) -> set[int]:
    """The checkpoint pruning must keep for a later search: the highest own-domain validation (`target`'s pick)."""
    scored = [v for v in history if v.get("blocks", 0) > 0 and v["step"] > 0]
    return {max(scored, key=lambda v: (v["matching_proposals"], -v["step"]))["step"]} if scored else set()


def select(
    validator: Any,
    run_dir: Path,
    draft_dir: Path,
    history: list[dict[str, Any]],
    guard: dict[str, Any],
    released: dict[str, Any],
    chosen: dict[str, Any],
    *,
    tolerance: float,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A guarded run's selection with `[train].interpolate = "auto"`: (``selection.json``'s ``interpolation``,
    the selected validation entry: the exported point's when `search` found one that beats `chosen`, else
    `chosen`). Without a rejected best own-domain checkpoint there is nothing to search (no points)."""
    top = target(history, guard, {s for s, _ in ckpt.committed(run_dir)})
    if top is None or not released.get("own"):  # (a baseline measured before the own rows were: no alpha 0 to score)
        return {"rule": RULE, "checkpoint_step": None, "alpha": None, "points": []}, chosen
    loaded = ckpt.load(Path(run_dir) / ckpt.CHECKPOINTS / ckpt.step_name(top["step"]))
    names = list(loaded.state["trainable"])
    trained = {n: loaded.trainable[n] for n in names}
    found = search(measure_on(validator, released_trainable(draft_dir, names), trained, top["step"]), top, released, chosen,
                   tolerance=tolerance)
    point = found.pop("validation")
    return found, (point if point is not None else chosen)
