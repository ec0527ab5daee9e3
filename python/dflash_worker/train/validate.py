"""Validation: matching proposals on the val split, measured with exactly the export's weights.

A `Validator` is given its split and its rows: the own rows, and the general rows
(`prepare-data --replay-val-fraction`, `setup.general_val_rows`), measured apart. Each
measurement scores the first `val_examples` of the rows, with anchors drawn the same way at
every validation, through the training forward (`forward.Scorer.score`) while the FP32 masters
are swapped out for `params.export_values` (BF16, or AF4G64 for an AF4G64 export's quantized
tensors). `measure_released` scores the released draft so, before the first update: the
general-domain guard's baseline (`selection`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..recipe import TrainConfig
from .data import CapturedSplit, mix, sample_anchors
from .forward import Blocks, Scorer
from .objectives import summarize, weight_total
from .params import export_values, swapped
from .selection import VAL_KEYS


class Validator:
    """Measures the draft of `scorer` on the val `split`'s `own` and `general` rows (indices)."""

    def __init__(self, scorer: Scorer, split: CapturedSplit | None, own: list[int], general: list[int], cfg: TrainConfig) -> None:
        self.scorer = scorer
        self.split = split
        self.own = own
        self.general = general
        self.cfg = cfg

    def blocks(self, rows: list[int]) -> Iterator[Blocks]:
        """The first `val_examples` of the validation sequences `rows` with anchors (the same at every validation)."""
        cfg, split = self.cfg, self.split
        for i in rows[: cfg.val_examples] if split is not None else ():
            seq = split.get(i)
            anchors = sample_anchors(seq.loss_mask, cfg.blocks_per_sequence, mix(cfg.seed, 2, i))
            if anchors.numel():
                yield self.scorer.blocks(seq, anchors)

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

    def measure(self, rows: list[int]) -> dict[str, Any]:
        """Matching proposals (`summarize`) and the CE terms over validation sequences `rows`."""
        parts = self.scorer.parts
        pw, with_selector = parts.weights.positions, parts.model.candidate_selector is not None
        counts = []
        ce = sel = denom = 0.0
        for b in self.blocks(rows):
            s = self.scorer.score(b, objective="weighted_ce", with_selector=with_selector)
            counts.append(s.counts)
            ce += float(s.ce_sum)
            sel += float(s.selector_sum)
            denom += weight_total(b.valid, pw)
        out = summarize(counts, parts.weights.block_size - 1)
        out["ce"] = ce / denom if denom else None
        out["selector_ce"] = sel / denom if denom else None
        return out

    def validate(self, step: int, inside: Callable[[], None] | None = None) -> dict[str, Any]:
        """The validation entry of `step`: matching proposals computed with exactly the export's weights
        (`export_weights`, `inside` run first while they are in place): the own rows, and the general
        rows apart (``general``) when there are any."""
        with self.export_weights():
            if inside is not None:
                inside()
            out = self.measure(self.own)
            general = self.measure(self.general) if self.general else None
        out["step"] = step
        if general is not None:
            out["general"] = {k: general[k] for k in VAL_KEYS}
        return out

    def measure_released(self) -> dict[str, Any]:
        """The guard's baseline: the general val rows scored with the export values of the draft as
        loaded (call before the first update), through the path `validate` takes; ``own``: the own
        rows, what selecting the released draft (step 0) records."""
        with self.export_weights():
            general = self.measure(self.general)
            own = self.measure(self.own)
        return {"step": 0, "examples": len(self.general[: self.cfg.val_examples]), **{k: general[k] for k in VAL_KEYS},
                "own": {k: own[k] for k in VAL_KEYS}}
