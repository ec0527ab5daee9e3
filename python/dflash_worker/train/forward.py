"""The one forward path of training and validation: anchored blocks of a sequence, scored.

`Scorer.score` runs forward -> token loss -> selector terms -> proposals -> match counts over the
`Blocks` of one sequence (`Scorer.blocks`), under the recipe's autocast and, in the training step,
its QAT context (`Scorer.qat`); `Scorer.micro_batches` draws a step's sequences and their seeded
anchors (`data` module docstring).

Replay distillation (`[train].replay_kd = K > 0`): on the train split's replay
rows (`prepare-data --replay`, listed in the capture manifest's
``data.replay.train_ids``), the step also runs the starting draft (the trained
tensors swapped back to their values as loaded, `TrainSetup.start`, no grad,
outside any QAT context: `Scorer.start_logits`) on the same blocks and adds
``K * objectives.kd_loss_sum``, the KL from its block distributions to the
trained draft's, to that row's loss (same normaliser); the metrics line gets
``replay_kd`` (the step's KL over the normaliser). Own rows are untouched. A
capture without ``train_ids`` (or whose train split holds none of them) is a
`ConfigError` at setup (`setup.replay_train_rows`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..recipe import TrainConfig
from .data import Sequence, mix, sample_anchors
from .objectives import (
    block_labels,
    kd_loss_sum,
    match_counts,
    proposals,
    proposals_from_scores,
    selector_terms,
    token_loss_sum,
)
from .setup import TrainSetup


@dataclass(frozen=True, eq=False)
class Blocks:
    """The anchored blocks of one sequence with their labels (`objectives.block_labels`)."""

    seq: Sequence
    anchors: torch.Tensor  # [M]
    labels: torch.Tensor  # [M, T-1], on the device
    valid: torch.Tensor  # [M, T-1] bool, on the device
    replay: bool = False  # a replay row of the train split (`[train].replay_kd` distils on it)


@dataclass(frozen=True, eq=False)
class BlockScores:
    """What one forward over `Blocks` gives training and validation alike."""

    ce_sum: torch.Tensor  # token loss sum of the objective asked for (graph attached when grad is on)
    selector_sum: torch.Tensor  # selector CE sum; 0 when the selector was not scored
    counts: dict[str, list[int]]  # `objectives.match_counts` of the draft's proposals
    kd_sum: torch.Tensor | None = None  # `[train].replay_kd`'s KL sum; None when not asked for


class Scorer:
    """The forward and scoring of one run's draft (`parts`, read at each call), with `[train]`'s
    autocast, gradient checkpointing and QAT, and `attention` the draft forward's attention backend
    (`DraftModel.forward_blocks`)."""

    def __init__(self, parts: TrainSetup, cfg: TrainConfig, attention: str = "auto") -> None:
        self.parts = parts
        self.cfg = cfg
        self.attention = attention

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.parts.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.parts.device.type, dtype=self.parts.autocast)

    def qat(self) -> contextlib.AbstractContextManager:
        """The QAT context of the training forward: `qat_names` fake-quantized (none: nothing)."""
        qat_names = self.parts.tensors.qat_names
        if not qat_names:
            return contextlib.nullcontext()
        from ..model.quant import quantized_weights

        return quantized_weights(self.parts.model, qat_names)

    def forward(self, seq: Sequence, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [M, T-1, H], logits [M, T-1, V]) of the blocks at `anchors` of one sequence."""
        dev, head, model = self.parts.device, self.parts.head, self.parts.model
        ids = seq.input_ids.to(dev)
        feats = seq.features.to(dev, torch.float32)[None]
        a = anchors.to(dev)[None]
        blocks = model.make_blocks(ids[None], a)
        embeds = model.embed(blocks, head.embed)
        with self.autocast():
            if self.cfg.gradient_checkpointing and torch.is_grad_enabled():
                from torch.utils.checkpoint import checkpoint

                hidden = checkpoint(model.forward_blocks, feats, a, embeds, attention=self.attention, use_reentrant=False)
            else:
                hidden = model.forward_blocks(feats, a, embeds, attention=self.attention)
            h = hidden[0, :, 1:]
            logits = model.logits(h, head.head)
        return h.float(), logits.float()

    def blocks(self, seq: Sequence, anchors: torch.Tensor, *, replay: bool = False) -> Blocks:
        labels, valid = block_labels(seq.input_ids, seq.loss_mask, anchors, self.parts.weights.block_size)
        return Blocks(seq, anchors, labels.to(self.parts.device), valid.to(self.parts.device), replay)

    def score(self, b: Blocks, *, objective: str, with_selector: bool, kd_target: torch.Tensor | None = None) -> BlockScores:
        """The one forward path of training and validation: forward, token loss of `objective`,
        selector terms (when `with_selector`), the draft's proposals and their match counts; with
        `kd_target` (the starting draft's logits on `b`), ``sum_k valid_k * w_k * KL(p_start || p)``."""
        dev, model, pw = self.parts.device, self.parts.model, self.parts.weights.positions
        h, logits = self.forward(b.seq, b.anchors)
        ce_sum = token_loss_sum(logits, b.labels, b.valid, pw, objective)
        kd_sum = None if kd_target is None else kd_loss_sum(logits, kd_target, b.valid, pw)
        anchor_ids = b.seq.input_ids.to(dev)[b.anchors.to(dev)]
        if with_selector:
            sel_sum, scores, cand = selector_terms(model.candidate_selector, h, logits, anchor_ids, b.labels, b.valid, pw)
            # the loss already ranked the vocabulary and scored the candidates: reuse that
            # (same values as `proposals` recomputing them) instead of a second top-k
            prop, cov = proposals_from_scores(scores.detach(), cand, b.labels)
        else:
            sel_sum = torch.zeros((), device=dev)
            prop, cov = proposals(model, h.detach(), logits.detach(), anchor_ids, b.labels)
        return BlockScores(ce_sum, sel_sum, match_counts(prop, cov, b.labels, b.valid), kd_sum)

    def micro_batches(self, step: int, slots: list[int]) -> list[Blocks]:
        """The sequences of micro-batch `slots` of the step after `step` and their seeded anchors
        (`data` module docstring)."""
        cfg, parts = self.cfg, self.parts
        out = []
        for j in slots:
            g = step * cfg.grad_accum + j
            row = parts.order(g)
            seq = parts.train_split.get(row)
            anchors = sample_anchors(seq.loss_mask, cfg.blocks_per_sequence, mix(cfg.seed, 1, g))
            out.append(self.blocks(seq, anchors, replay=row in parts.replay_rows))
        return out

    @contextlib.contextmanager
    def starting_weights(self) -> Iterator[None]:
        """The trained tensors hold their starting values (`TrainSetup.start`: the released draft, as
        loaded) inside, without grad; the very same tensors are put back afterwards."""
        params, start = self.parts.params, self.parts.start
        saved = [p.data for p in params]
        try:
            with torch.no_grad():
                for p, p0 in zip(params, start):
                    p.data = p0
                yield
        finally:
            for p, d in zip(params, saved):
                p.data = d

    def start_logits(self, b: Blocks) -> torch.Tensor:
        """The starting (released) draft's block logits on `b` (same features, anchors and attention;
        outside any QAT context: the draft as released), what `[train].replay_kd` distils toward."""
        with self.starting_weights():
            return self.forward(b.seq, b.anchors)[1]
