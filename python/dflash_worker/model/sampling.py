"""Token sampling primitives shared by the draft selector and speculative decoding.

All randomness goes through `torch.multinomial` / `torch.rand` on the default
generator unless a `torch.Generator` is given, so a seeded run is repeatable
and consumes the random stream in a fixed order.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    if temperature < 0:
        raise ConfigError(f"`temperature` must be >= 0, found `{temperature}`")
    if not 0 < top_p <= 1:
        raise ConfigError(f"`top_p` must be in (0, 1], found `{top_p}`")
    if top_k < 0:
        raise ConfigError(f"`top_k` must be >= 0 (0 disables it), found `{top_k}`")


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Float32 probabilities over the last axis after temperature, top-k and top-p (nucleus) filtering.

    top-k keeps exactly the `top_k` highest scores; top-p then keeps the
    smallest prefix of the remaining tokens (by descending probability) whose
    mass before the token is below `top_p`, and renormalises.
    """
    scores = logits.float() / temperature
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kept_vals, kept_idx = torch.topk(scores, top_k, dim=-1)
        probs = torch.zeros_like(scores).scatter_(-1, kept_idx, torch.softmax(kept_vals, dim=-1))
    else:
        probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        ordered, order = probs.sort(dim=-1, descending=True)
        mass_before = ordered.cumsum(dim=-1) - ordered
        ordered = torch.where(mass_before < top_p, ordered, torch.zeros_like(ordered))
        probs = torch.zeros_like(probs).scatter_(-1, order, ordered)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One sample index per row of `probs` [..., V] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    if generator is not None and generator.device != flat.device:
        # a generator only drives its own device: sample there, return on the caller's device
        return torch.multinomial(flat.to(generator.device), 1, generator=generator).to(probs.device).view(probs.shape[:-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def pick(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0, generator=None) -> torch.Tensor:
    """Greedy argmax at temperature 0, otherwise a filtered sample."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    return draw(sampling_probs(logits, temperature, top_p, top_k), generator)


def accept_by_rejection(
    proposed: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_support: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[int, torch.Tensor]:
    """Speculative rejection sampling for one sequence.

    proposed [1, g] draft tokens; target_probs [1, g + 1, V]; draft_probs
    [1, g, V] (full vocabulary) or [1, g, k] over `draft_support` [1, g, k]
    token ids (DFlash2 selector candidates). Token i is accepted with
    probability min(1, p_i / q_i); the first rejection is replaced by a draw
    from the normalised residual max(p - q, 0) (the target row itself when
    the residual is empty); if all are accepted the bonus comes from the last
    target row. Returns (accepted count, next token).
    """
    g = proposed.shape[1]
    p = target_probs[:, :g].gather(-1, proposed.unsqueeze(-1)).squeeze(-1)
    if draft_support is None:
        q = draft_probs.gather(-1, proposed.unsqueeze(-1)).squeeze(-1)
    else:
        q = torch.where(draft_support == proposed.unsqueeze(-1), draft_probs, torch.zeros_like(draft_probs)).sum(-1)
    rng_device = q.device if generator is None else generator.device
    u = torch.rand(q.shape, dtype=q.dtype, device=rng_device, generator=generator).to(q.device)
    keep = (u * q < p).to(torch.int32)
    accepted = int(keep.cumprod(dim=-1).sum(dim=-1)[0])
    if accepted == g:
        return accepted, draw(target_probs[:, -1], generator)[0]
    target_row = target_probs[0, accepted]
    if draft_support is None:
        residual = target_row - draft_probs[0, accepted]
    else:
        residual = target_row.clone().scatter_add_(0, draft_support[0, accepted], -draft_probs[0, accepted])
    residual = residual.clamp_min(0)
    total = residual.sum()
    if float(total) > 0:
        residual = residual / total
    else:
        residual = target_row
    return accepted, draw(residual[None], generator)[0]
