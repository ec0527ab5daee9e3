"""A draft whose proposals are known in advance, so that speculative steps reject where chosen.

Why: with random weights an untrained draft agrees with its target almost never, so every block is
cut after its first token and the hybrid targets' recurrent-state rollback only ever replays one
token. A check of the rollback (losslessness, its cost per verify step) needs rejections inside
blocks, as a trained draft makes them: `OracleDraft` runs the real draft (its forward, cache and
features, so the draft phase costs what it costs) and then proposes the target's own greedy
continuation, made wrong from a chosen offset per step on. The target accepts exactly the tokens
before that offset and rejects the rest of the block.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# per-step offsets of the first wrong proposal: inside blocks of 8 and 16, at 0 (nothing accepted),
# and past the block (all accepted)
CORRUPT_AT = (3, 0, 1, 6, 20, 2, 0, 5, 12, 1, 9, 0)


class OracleDraft:
    """Wraps a real `DraftModel`; proposes `greedy_ids` [1, n] (the target's greedy decoding of the
    prompt, prompt included) corrupted from `corrupt_at[step % len]` on. Use one per prompt."""

    candidate_selector = None  # propose through `logits`, the loop's DFlash path

    def __init__(self, real: Any, greedy_ids: torch.Tensor, corrupt_at: tuple[int, ...] = CORRUPT_AT):
        self.real, self.greedy_ids, self.corrupt_at = real, greedy_ids[0], tuple(corrupt_at)
        self.vocab = int(real.config.vocab_size)
        self.verified = 0  # tokens verified so far; the next block's anchor sits there
        self.steps = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def step(self, features: torch.Tensor, block_embeds: torch.Tensor, cache: Any) -> torch.Tensor:
        """The real draft step; counts the verified tokens (the prompt's features first, then each step's)."""
        self.verified += features.shape[1]
        return self.real.step(features, block_embeds, cache)

    def logits(self, hidden: torch.Tensor, head: Any) -> torch.Tensor:
        """One-hot logits of the planned proposal for the block's `hidden.shape[1]` mask positions."""
        k = hidden.shape[1]
        proposal = self.greedy_ids[self.verified + 1 : self.verified + 1 + k].clone()
        if proposal.shape[0] < k:  # past the reference's end: anything (the loop cuts at its limit)
            proposal = torch.cat([proposal, proposal.new_zeros(k - proposal.shape[0])])
        off = self.corrupt_at[self.steps % len(self.corrupt_at)]
        self.steps += 1
        if off < k:
            proposal[off:] = (proposal[off:] + 97) % self.vocab  # all wrong from `off` on
        return F.one_hot(proposal.to(hidden.device), self.vocab).to(hidden.dtype)[None] * 8.0
