"""Regenerating responses with the teacher: greedy or seeded sampling, one example at a time.

A small decode loop of our own instead of `generate()`: every example draws
from its own CPU `torch.Generator` seeded from (recipe seed, example id), so
the sampled response of an example does not depend on which examples ran
before it. That is what makes a resumed capture byte-identical to an
uninterrupted one. Probabilities are computed in float32 on the CPU so the
draw does not depend on the accelerator's RNG.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Generation:
    """New token ids (stop token included when one was produced) and whether a stop token ended them."""

    ids: list[int]
    stopped: bool


def example_seed(seed: int, example_id: str) -> int:
    """Per-example 63-bit seed from the recipe seed and the example id."""
    digest = hashlib.sha256(f"dflash-sample\0{seed}\0{example_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def _pick(logits: torch.Tensor, *, greedy: bool, temperature: float, top_p: float, gen: torch.Generator | None) -> int:
    logits = logits.float().cpu()
    if greedy:
        return int(torch.argmax(logits).item())  # first maximum on ties
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always the top token)
        keep = (cum - sorted_p) < top_p
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)
        return int(order[choice].item())
    return int(torch.multinomial(probs, 1, generator=gen).item())


@torch.inference_mode()
def generate(
    model: Any,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    greedy: bool,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int | None = None,
    device: str | torch.device = "cpu",
) -> Generation:
    """Decode up to `max_new_tokens` tokens after `prompt_ids` with a KV cache."""
    gen = None
    if not greedy:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(int(seed or 0))
    stops = set(int(s) for s in stop_ids)
    x = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    out = model(input_ids=x, use_cache=True, logits_to_keep=1)
    cache = out.cache  # transformers 5 names the KV cache `cache` (`past_key_values` is deprecated)
    new: list[int] = []
    for _ in range(max_new_tokens):
        tok = _pick(out.logits[0, -1], greedy=greedy, temperature=temperature, top_p=top_p, gen=gen)
        new.append(tok)
        if tok in stops:
            return Generation(ids=new, stopped=True)
        if len(new) == max_new_tokens:
            break
        x = torch.tensor([[tok]], dtype=torch.long, device=device)
        out = model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1)
        cache = out.cache
    return Generation(ids=new, stopped=False)
