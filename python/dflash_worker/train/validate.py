"""Validation: matching proposals on the val split, measured with exactly the export's weights.

A `Validator` is given its split and its rows: the own rows, and the general rows
(`prepare-data --replay-val-fraction`, `setup.general_val_rows`), measured apart. Each
measurement scores the first `val_examples` of the rows, with anchors drawn the same way at
every validation, through the training forward (`forward.Scorer.score`) while the FP32 masters
are swapped out for `params.export_values` (BF16, or AF4G64 for an AF4G64 export's quantized
tensors). `measure_released` scores the released draft so, before the first update: the
general-domain guard's baseline (`selection`).

Thinking modes: with ``[data].thinking = "per_row"`` each val row's mode is its prepared example's
(`val_modes`, `data.render.resolve_thinking`), and every measurement also carries ``modes``: the
same figures over the scored rows (own and general together) of each mode, from the same forward
passes (no extra scoring), which the guard reads per mode (`selection`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..recipe import TrainConfig
from .data import CapturedSplit, mix, sample_anchors
from .forward import Blocks, Scorer
from .objectives import summarize, weight_total
from .params import export_values, swapped
from .selection import VAL_KEYS

if TYPE_CHECKING:
    from ..recipe import DataConfig

MODES = {True: "on", False: "off"}


def val_modes(split: CapturedSplit | None, data: DataConfig) -> dict[int, str]:
    """Each val row's thinking mode (``on`` / ``off``) when ``[data].thinking = "per_row"``, from its
    prepared example (`resolve_thinking`); {} for a one-mode dataset (the guard has nothing more to
    tell apart) or no val split. A row whose example the data directory lacks has no mode."""
    if split is None or data.thinking != "per_row":
        return {}
    from ..data import PreparedData
    from ..data.render import resolve_thinking

    examples = {ex.id: ex for ex in PreparedData(data.dir).iter_split("val")}
    return {i: MODES[bool(resolve_thinking(data.thinking, examples[split.id_of(i)]))]
            for i in range(len(split)) if split.id_of(i) in examples}


def _summary(scores: list[tuple[int, dict, float, float, float]], positions: int) -> dict[str, Any]:
    """Matching proposals (`summarize`) and the CE terms of the row `scores` of `Validator.score`."""
    out = summarize([c for _, c, _, _, _ in scores], positions)
    denom = sum(d for *_, d in scores)
    out["ce"] = sum(ce for _, _, ce, _, _ in scores) / denom if denom else None
    out["selector_ce"] = sum(sel for _, _, _, sel, _ in scores) / denom if denom else None
    return out


class Validator:
    """Measures the draft of `scorer` on the val `split`'s `own` and `general` rows (indices)."""

    def __init__(self, scorer: Scorer, split: CapturedSplit | None, own: list[int], general: list[int], cfg: TrainConfig,
                 modes: dict[int, str] | None = None) -> None:
        self.scorer = scorer
        self.split = split
        self.own = own
        self.general = general
        self.cfg = cfg
        self.modes = modes or {}  # val row -> thinking mode (`val_modes`); {}: no per-mode figures

    def blocks(self, rows: list[int]) -> Iterator[Blocks]:
        """The first `val_examples` of the validation sequences `rows` with anchors (the same at every validation)."""
        for _, b in self._blocks(rows):
            yield b

    def _blocks(self, rows: list[int]) -> Iterator[tuple[int, Blocks]]:
        cfg, split = self.cfg, self.split
        for i in rows[: cfg.val_examples] if split is not None else ():
            seq = split.get(i)
            anchors = sample_anchors(seq.loss_mask, cfg.blocks_per_sequence, mix(cfg.seed, 2, i))
            if anchors.numel():
                yield i, self.scorer.blocks(seq, anchors)

    @contextlib.contextmanager
    def export_weights(self) -> Iterator[None]:
        """The draft in eval mode, without grad, with the FP32 masters swapped out for `export_values`
        (BF16, or AF4G64 for QAT names); the very same parameter objects are put back afterwards,
        success or failure."""
        model, tensors = self.scorer.parts.model, self.scorer.parts.tensors
        values = export_values(dict(model.named_parameters()), tensors.export_names, qat_names=tensors.val_quant)
        was_training = model.training
        model.eval()
        try:
            with swapped(model, values), torch.no_grad():
                yield
        finally:
            model.train(was_training)

    def score(self, rows: list[int]) -> list[tuple[int, dict, float, float, float]]:
        """Per scored validation sequence of `rows`: (row, match counts, CE sum, selector CE sum, weight total)."""
        parts = self.scorer.parts
        pw, with_selector = parts.weights.positions, parts.model.candidate_selector is not None
        out = []
        for i, b in self._blocks(rows):
            s = self.scorer.score(b, objective="weighted_ce", with_selector=with_selector)
            out.append((i, s.counts, float(s.ce_sum), float(s.selector_sum), float(weight_total(b.valid, pw))))
        return out

    def measure(self, rows: list[int]) -> dict[str, Any]:
        """Matching proposals (`summarize`) and the CE terms over validation sequences `rows`."""
        return _summary(self.score(rows), self.scorer.parts.weights.block_size - 1)

    def _measure_all(self) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, dict[str, Any]] | None]:
        """The own rows' figures, the general rows' (None without any), and, with `modes`, each mode's
        over both (None without modes), from one scoring of each row."""
        positions = self.scorer.parts.weights.block_size - 1
        own = self.score(self.own)
        general = self.score(self.general) if self.general else []
        by_mode = None
        if self.modes:
            scored = own + general
            by_mode = {m: {k: v for k, v in _summary([x for x in scored if self.modes.get(x[0]) == m], positions).items()
                           if k in VAL_KEYS}
                       for m in sorted({self.modes[x[0]] for x in scored if x[0] in self.modes})}
        return _summary(own, positions), (_summary(general, positions) if self.general else None), by_mode

    def validate(self, step: int, inside: Callable[[], None] | None = None) -> dict[str, Any]:
        """The validation entry of `step`: matching proposals computed with exactly the export's weights
        (`export_weights`, `inside` run first while they are in place): the own rows, and the general
        rows apart (``general``) when there are any."""
        with self.export_weights():
            if inside is not None:
                inside()
            out, general, modes = self._measure_all()
        out["step"] = step
        if general is not None:
            out["general"] = {k: general[k] for k in VAL_KEYS}
        if modes is not None:
            out["modes"] = modes
        return out

    def measure_released(self) -> dict[str, Any]:
        """The guard's baseline: the general val rows scored with the export values of the draft as
        loaded (call before the first update), through the path `validate` takes; ``own``: the own
        rows, what selecting the released draft (step 0) records."""
        with self.export_weights():
            own, general, modes = self._measure_all()
        if general is None:
            general = self.measure([])
        return {"step": 0, "examples": len(self.general[: self.cfg.val_examples]), **{k: general[k] for k in VAL_KEYS},
                "own": {k: own[k] for k in VAL_KEYS}, **({} if modes is None else {"modes": modes})}
