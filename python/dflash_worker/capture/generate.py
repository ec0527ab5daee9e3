"""Regenerating responses with the teacher: greedy or seeded sampling, one example at a time.

`regenerate_example` decides what is regenerated: the response after the row's prompt (every turn
before its final assistant turn) and, with ``[data].train_turns = "all"``, every earlier assistant
turn too, turn by turn, each from its context as logged (the turns before it as in the log, never as
regenerated), so the regenerated conversation never drifts from the log. The captured sequence is the
logged conversation rendered whole, with each regenerated turn's tokens in place of the logged turn's
(trained), followed by the regenerated response; every prompt renders in the row's thinking mode
(`resolve_thinking`) with its tools. Without earlier assistant turns (or with ``train_turns =
"last"``) that is the prompt followed by the generated response, as it always was.

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

from ..data.render import render_prompt, render_turns, resolve_thinking


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


@dataclass(frozen=True)
class Regenerated:
    """The captured sequence of a regenerated example: ids, 0/1 loss mask, and whether a turn was cut short."""

    ids: list[int]
    mask: list[int]
    truncated: bool


def regenerate_example(
    model: Any, tokenizer: Any, ex: Any, *, data: Any, cap: Any, stop_ids: Sequence[int], device: str | torch.device = "cpu",
) -> Regenerated:
    """Regenerate `ex` (a prepared `Example`) as the module docstring says; `data`/`cap`: `[data]`/`[capture]`.

    Each turn draws from its own seed: the response from `example_seed(seed, id)` (as before turns
    existed), an earlier assistant turn `i` from `example_seed(seed, f"{id}/{i}")`. A sequence longer
    than `max_length` is cut there, and one whose next turn has no room left to be answered ends
    before that turn (both `truncated`)."""
    enable = resolve_thinking(data.thinking, ex)
    tools = getattr(ex, "tools", None)
    prompt_msgs = list(ex.prompt_messages)
    earlier = data.train_turns == "all" and any(m.get("role") == "assistant" for m in prompt_msgs)
    base = (render_turns(tokenizer, prompt_msgs, thinking=enable, tools=tools, generation=True) if earlier else None)
    prompt = base.input_ids if base is not None else render_prompt(tokenizer, prompt_msgs, thinking=enable, tools=tools)
    greedy = cap.sampling == "greedy"

    def draw(context: list[int], budget: int, key: str) -> Generation:
        if budget <= 0:
            return Generation(ids=[], stopped=False)
        return generate(model, context, max_new_tokens=budget, stop_ids=stop_ids, greedy=greedy,
                        temperature=cap.temperature, top_p=cap.top_p, seed=example_seed(cap.seed, key), device=device)

    ids: list[int] = []
    mask: list[int] = []
    truncated = False
    at = 0
    for i, a, b in base.turns if base is not None else []:
        context = render_prompt(tokenizer, prompt_msgs[:i], thinking=enable, tools=tools)  # the turns before it, as logged
        budget = min(cap.max_new_tokens, data.max_length - len(context))
        if budget <= 0:  # no room left to answer this turn: the sequence ends before it
            ids, mask = ids + prompt[at:a], mask + [0] * (a - at)
            return Regenerated(ids=ids[: data.max_length], mask=mask[: data.max_length], truncated=True)
        g = draw(context, budget, f"{ex.id}/{i}")
        ids += prompt[at:a] + g.ids
        mask += [0] * (a - at) + [1] * len(g.ids)
        truncated |= not g.stopped
        at = b
    ids += prompt[at:]
    mask += [0] * (len(prompt) - at)
    g = draw(prompt, min(cap.max_new_tokens, data.max_length - len(prompt), data.max_length - len(ids)), ex.id)
    ids += g.ids
    mask += [1] * len(g.ids)
    truncated |= not g.stopped
    if len(ids) > data.max_length:
        ids, mask, truncated = ids[: data.max_length], mask[: data.max_length], True
    return Regenerated(ids=ids, mask=mask, truncated=truncated)
