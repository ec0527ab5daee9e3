"""DFlash2 candidate selector: rescores the draft's top-k tokens along a path from the anchor.

score(candidate c at position t | previous token p) =
    logit_t[c] + < pred[p] * proj(hidden_t), succ[c] >
with two (vocab x rank) codebooks and a rank-r projection of the draft hidden
state. Decoding walks the block left to right, so each choice conditions the
next. The three tensors are stored as plain parameters named
`predecessor_codebook`, `successor_codebook` (no `.weight`, the released
layout) and `hidden_projection.weight`.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import DraftConfig
from .sampling import draw, sampling_probs


class CandidateSelector(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        rank = config.selector_rank
        self.top_k = config.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(config.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(config.vocab_size, rank))
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def candidates(self, logits_BTV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(unary scores, token ids) of the top-k logits per position, [B, T, k] each."""
        # unsorted: the candidate order only has to be stable between proposal and verification
        return torch.topk(logits_BTV, self.top_k, dim=-1, sorted=False)

    def pair_scores(
        self, hidden_BTH: torch.Tensor, unary_BTk: torch.Tensor, cand_BTk: torch.Tensor, prev_BT: torch.Tensor
    ) -> torch.Tensor:
        """Teacher-forced scores [B, T, k] given the previous token of every position (training)."""
        query = self.hidden_projection(hidden_BTH) * self.predecessor_codebook[prev_BT]
        succ = self.successor_codebook[cand_BTk]
        return unary_BTk + (succ @ query.unsqueeze(-1)).squeeze(-1)

    def walk(
        self,
        hidden_BTH: torch.Tensor,
        logits_BTV: torch.Tensor,
        anchor_B: torch.Tensor,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Decode a path from the anchor.

        Returns (path tokens [B, T], candidate ids [B, T, k], and at
        temperature > 0 the per-position selection probabilities [B, T, k]
        over those candidates, else None).
        """
        unary, cand = self.candidates(logits_BTV)
        proj = self.hidden_projection(hidden_BTH)  # [B, T, r]
        succ = self.successor_codebook[cand]  # [B, T, k, r]
        B, T, k = cand.shape
        # Every pairwise score is known up front: position 0 follows the anchor; position t >= 1
        # follows one of the k candidates of t-1, so trans[t][i, j] scores candidate j after i.
        first = unary[:, 0] + (succ[:, 0] @ (self.predecessor_codebook[anchor_B] * proj[:, 0]).unsqueeze(-1)).squeeze(-1)
        if T > 1:
            pred = self.predecessor_codebook[cand[:, :-1]] * proj[:, 1:, None, :]  # [B, T-1, k, r]
            trans = unary[:, 1:, None, :] + pred @ succ[:, 1:].transpose(-1, -2)  # [B, T-1, k, k]
        rows = torch.arange(B, device=cand.device)
        picks, probs = [], []
        scores = first
        for t in range(T):
            if t:
                scores = trans[rows, t - 1, choice]  # noqa: F821 - `choice` is bound at t == 0
            if temperature > 0:
                q = sampling_probs(scores, temperature)
                choice = draw(q, generator)
                probs.append(q)
            else:
                choice = scores.argmax(dim=-1)
            picks.append(choice)
        path = cand.gather(-1, torch.stack(picks, dim=1).unsqueeze(-1)).squeeze(-1)
        return path, cand, (torch.stack(probs, dim=1) if probs else None)
