"""Speculative generation with a DFlash / DFlash2 draft and its target (batch size 1).

Each step: the draft fills a block (last verified token + mask tokens) with a
proposal; the target scores the whole block in one forward; the longest
prefix the target agrees with is accepted plus one bonus token from the
target; both caches roll back to the verified length. Greedy verification
accepts a proposal token iff it equals the target's argmax; sampled
verification uses rejection sampling, so the output is distributed as the
target's own (filtered) sampling. DFlash2 drafts propose through their
candidate selector.

The acceptance length reported per step is the number of tokens the step
added to the output (accepted + bonus, cut at `max_new_tokens` or a stop
token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..device import now
from ..errors import ConfigError, FamilyError
from ..model.draft import DraftModel, context_features
from ..model.sampling import accept_by_rejection, check_sampling, draw, pick, sampling_probs


@dataclass
class SpeculativeResult:
    """Output ids (prompt included, [1, n]) and per-step statistics; times in seconds."""

    output_ids: torch.Tensor
    acceptance_lengths: list[int]
    num_input_tokens: int
    num_output_tokens: int
    prefill_seconds: float
    decode_seconds: float
    stopped_on: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.acceptance_lengths) / max(1, len(self.acceptance_lengths))

    @property
    def time_per_output_token(self) -> float:
        return self.decode_seconds / max(1, self.num_output_tokens)

    def as_dict(self) -> dict:
        return {
            "num_input_tokens": self.num_input_tokens,
            "num_output_tokens": self.num_output_tokens,
            "acceptance_lengths": list(self.acceptance_lengths),
            "mean_acceptance_length": self.mean_acceptance_length,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "time_per_output_token": self.time_per_output_token,
            "stopped_on": self.stopped_on,
        }


def _target_cache(target):
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    # Sliding-window layers must keep rolled-back states until we crop them.
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()
    return cache


def _crop(cache, length: int) -> None:
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _head(target):
    head = getattr(target, "lm_head", None)
    return head if head is not None else target.get_output_embeddings()


@torch.inference_mode()
def speculative_generate(
    draft: DraftModel,
    target,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    stop_token_ids: list[int] | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    block_size: int | None = None,
    generator: torch.Generator | None = None,
    profile: bool = False,
) -> SpeculativeResult:
    """Generate up to `max_new_tokens` after `input_ids` [1, n] with draft + target.

    `block_size` (default: the draft's) may be lowered to verify fewer tokens
    per step. Sampling draws from `generator` or the global torch RNG. With
    `profile`, `extra["phase_seconds"]` holds the decode loop's time by phase,
    summed over steps: ``draft`` (draft forward and proposal, selector
    included), ``verify`` (the target's block forward), ``accept`` (comparing,
    writing the tokens, stop tokens) and ``crop`` (cache rollback and the
    next step's features); the device is synchronised between phases, which
    on an accelerator costs some of the overlap an unprofiled run has.
    """
    check_sampling(temperature, top_p, top_k)
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ConfigError(f"speculative generation takes one sequence `[1, n]`, found shape `{tuple(input_ids.shape)}`")
    if max_new_tokens < 1:
        raise ConfigError(f"`max_new_tokens` must be >= 1, found `{max_new_tokens}`")
    bs = draft.block_size if block_size is None else int(block_size)
    if bs < 2:
        raise ConfigError(f"`block_size` must be >= 2, found `{bs}`")
    dev = input_ids.device
    head = _head(target)
    embed_w = target.get_input_embeddings().weight
    layer_ids = draft.target_layer_ids
    if embed_w.shape[1] != draft.config.hidden_size or embed_w.shape[0] <= draft.mask_token_id:
        raise FamilyError(
            f"draft (hidden `{draft.config.hidden_size}`, mask token `{draft.mask_token_id}`) does not fit the target "
            f"embedding `{list(embed_w.shape)}`\nhint: pair the draft with the target it was trained for"
        )
    is_v2 = draft.candidate_selector is not None

    n = input_ids.shape[1]
    limit = n + max_new_tokens
    tokens = torch.full((1, limit + 1), draft.mask_token_id, dtype=torch.long, device=dev)
    tokens[:, :n] = input_ids
    positions = torch.arange(limit + 1, device=dev)[None]
    stops = None if not stop_token_ids else torch.tensor(list(stop_token_ids), dtype=torch.long, device=dev)
    t_cache = _target_cache(target)
    d_cache = draft.new_cache()

    t0 = now(dev)
    out = target(
        input_ids,
        position_ids=positions[:, :n],
        cache=t_cache,
        use_cache=True,
        logits_to_keep=1,
        output_hidden_states=True,
    )
    tokens[:, n] = pick(out.logits[:, -1], temperature, top_p, top_k, generator)
    features = context_features(out.hidden_states, layer_ids)
    t1 = now(dev)

    pos = n  # position of the last verified token = the next block's anchor
    lengths: list[int] = []
    stopped_on = None
    phase = {"draft": 0.0, "verify": 0.0, "accept": 0.0, "crop": 0.0}
    clock = (lambda: now(dev)) if profile else (lambda: 0.0)
    if stops is not None and bool(torch.isin(tokens[0, n], stops)):
        stopped_on = int(tokens[0, n])
    while stopped_on is None and pos + 1 < limit:
        ta = clock()
        span = min(bs, limit - pos)
        block = tokens[:, pos : pos + span].clone()
        hidden = draft.step(features, draft.embed(block, embed_w), d_cache)[:, 1:]
        draft_probs = support = None
        if is_v2:
            proposal, support, draft_probs = draft.propose(hidden, block[:, 0], head, temperature, generator)
        else:
            d_logits = draft.logits(hidden, head)
            if temperature > 0:
                draft_probs = sampling_probs(d_logits, temperature, top_p, top_k)
                proposal = draw(draft_probs, generator)
            else:
                proposal = d_logits.argmax(dim=-1)
        block[:, 1:] = proposal
        tb = clock()

        out = target(
            block,
            position_ids=positions[:, pos : pos + span],
            cache=t_cache,
            use_cache=True,
            output_hidden_states=True,
        )
        tc = clock()
        if temperature > 0:
            t_probs = sampling_probs(out.logits, temperature, top_p, top_k)
            accepted, bonus = accept_by_rejection(proposal, t_probs, draft_probs, support, generator)
        else:
            best = out.logits.argmax(dim=-1)
            agree = (proposal == best[:, :-1]).to(torch.int64)
            accepted = int(agree.cumprod(dim=1).sum())
            bonus = best[0, accepted]
        tokens[:, pos + 1 : pos + 1 + accepted] = proposal[:, :accepted]
        tokens[0, pos + 1 + accepted] = bonus
        produced = min(accepted + 1, limit - pos - 1)
        if stops is not None:
            hit = torch.isin(tokens[0, pos + 1 : pos + 1 + produced], stops).nonzero()
            if hit.numel():
                produced = int(hit[0, 0]) + 1
                stopped_on = int(tokens[0, pos + produced])
        pos += produced
        td = clock()
        _crop(t_cache, pos)
        lengths.append(produced)
        # the verify pass computed target features for the block; keep those now verified
        features = context_features(out.hidden_states, layer_ids)[:, :produced]
        te = clock()
        for k, dt in zip(phase, (tb - ta, tc - tb, td - tc, te - td)):
            phase[k] += dt

    t2 = now(dev)
    output = tokens[:, : min(pos + 1, limit)]
    return SpeculativeResult(
        output_ids=output,
        acceptance_lengths=lengths,
        num_input_tokens=n,
        num_output_tokens=output.shape[1] - n,
        prefill_seconds=t1 - t0,
        decode_seconds=t2 - t1,
        stopped_on=stopped_on,
        extra={"phase_seconds": phase} if profile else {},
    )


@torch.inference_mode()
def greedy_generate(target, input_ids: torch.Tensor, *, max_new_tokens: int, stop_token_ids: list[int] | None = None) -> torch.Tensor:
    """Plain greedy decoding with the target alone (the baseline speculative output must equal)."""
    cache = _target_cache(target)
    n = input_ids.shape[1]
    out = target(input_ids, cache=cache, use_cache=True, logits_to_keep=1)
    ids = [input_ids]
    stops = set(stop_token_ids or ())
    for i in range(max_new_tokens):
        nxt = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        ids.append(nxt)
        if int(nxt) in stops or i + 1 == max_new_tokens:
            break
        out = target(nxt, position_ids=torch.tensor([[n + i]], device=input_ids.device), cache=cache, use_cache=True)
    return torch.cat(ids, dim=1)
