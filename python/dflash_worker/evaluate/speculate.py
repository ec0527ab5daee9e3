"""Speculative generation with a DFlash / DFlash2 draft and its target (batch size 1).

Each step: the draft fills a block (last verified token + mask tokens) with a
proposal; the target scores the whole block in one forward; the longest
prefix the target agrees with is accepted plus one bonus token from the
target; both caches roll back to the verified length. Greedy verification
accepts a proposal token iff it equals the target's argmax; sampled
verification uses rejection sampling, so the output is distributed as the
target's own (filtered) sampling. DFlash2 drafts propose through their
candidate selector.

Rolling the target back: attention layers drop the rejected keys and values
(`cache.crop`). Hybrid targets (Qwen3.5, Qwen3.5-MoE) also have Gated
DeltaNet layers, whose recurrent state `crop` cannot restore: for those,
`rollback.RecurrentRollback` records each layer's recurrence during the
verify forward and replays it over the accepted tokens only (see its module
for why and what it costs). Targets without linear-attention layers take the
plain path, with no hooks.

The acceptance length reported per step is the number of tokens the step
added to the output (accepted + bonus, cut at `max_new_tokens` or a stop
token).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ..device import now
from ..errors import ConfigError, FamilyError
from ..model.draft import DraftModel, context_features
from ..model.sampling import accept_by_rejection, check_sampling, draw, pick, sampling_probs
from .rollback import RecurrentRollback


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


def _target_cache(target, *, record_past: bool = True):
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    # Sliding-window and linear-attention layers must keep rolled-back states until we crop them;
    # a cache that is never cropped must not record (its recorded conv states would grow every step).
    if record_past and hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()
    return cache


def _crop(cache, length: int, *, trim: bool = False) -> None:
    """Roll `cache` back to `length` tokens. `trim`: crop even when nothing is removed, which cuts
    recorded linear-attention conv states back to the kernel size (they grow until cropped)."""
    extra = cache.get_seq_length() - length
    if extra > 0 or trim:
        cache.crop(-extra)


def _head(target):
    head = getattr(target, "lm_head", None)
    return head if head is not None else target.get_output_embeddings()


@dataclass(frozen=True)
class _Sampling:
    temperature: float
    top_p: float
    top_k: int
    generator: torch.Generator | None


def _check_pair(draft: DraftModel, target, input_ids: torch.Tensor, max_new_tokens: int, block_size: int | None) -> int:
    """Refuse what the loop cannot run (before any forward); the block size to use."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ConfigError(f"speculative generation takes one sequence `[1, n]`, found shape `{tuple(input_ids.shape)}`")
    if max_new_tokens < 1:
        raise ConfigError(f"`max_new_tokens` must be >= 1, found `{max_new_tokens}`")
    bs = draft.block_size if block_size is None else int(block_size)
    if bs < 2:
        raise ConfigError(f"`block_size` must be >= 2, found `{bs}`")
    embed_w = target.get_input_embeddings().weight
    if embed_w.shape[1] != draft.config.hidden_size or embed_w.shape[0] <= draft.mask_token_id:
        raise FamilyError(
            f"draft (hidden `{draft.config.hidden_size}`, mask token `{draft.mask_token_id}`) does not fit the target "
            f"embedding `{list(embed_w.shape)}`\nhint: pair the draft with the target it was trained for"
        )
    return bs


def _propose(draft: DraftModel, block: torch.Tensor, features, d_cache, embed_w, head, s: _Sampling):
    """The draft's proposal for the block's mask positions, with the draft probabilities and
    candidate support rejection sampling needs (None when greedy / not a DFlash2 draft)."""
    hidden = draft.step(features, draft.embed(block, embed_w), d_cache)[:, 1:]
    if draft.candidate_selector is not None:
        return draft.propose(hidden, block[:, 0], head, s.temperature, s.generator)
    d_logits = draft.logits(hidden, head)
    if s.temperature > 0:
        draft_probs = sampling_probs(d_logits, s.temperature, s.top_p, s.top_k)
        return draw(draft_probs, s.generator), None, draft_probs
    return d_logits.argmax(dim=-1), None, None


def _accept(proposal: torch.Tensor, logits: torch.Tensor, draft_probs, support, s: _Sampling) -> tuple[int, torch.Tensor]:
    """How many of the block's proposed tokens the target accepts, and its bonus token after them:
    greedy, the longest prefix equal to the target's argmax; sampled, rejection sampling."""
    if s.temperature > 0:
        t_probs = sampling_probs(logits, s.temperature, s.top_p, s.top_k)
        return accept_by_rejection(proposal, t_probs, draft_probs, support, s.generator)
    best = logits.argmax(dim=-1)
    agree = (proposal == best[:, :-1]).to(torch.int64)
    accepted = int(agree.cumprod(dim=1).sum())
    return accepted, best[0, accepted]


def _commit(tokens: torch.Tensor, pos: int, proposal: torch.Tensor, accepted: int, bonus, limit: int, stops) -> tuple[int, int | None]:
    """Write the accepted tokens and the bonus after `pos`; how many tokens the step produced (cut at
    `limit` and after the first of `stops`) and the stop token it ended on (None when none)."""
    tokens[:, pos + 1 : pos + 1 + accepted] = proposal[:, :accepted]
    tokens[0, pos + 1 + accepted] = bonus
    produced = min(accepted + 1, limit - pos - 1)
    if stops is not None:
        hit = torch.isin(tokens[0, pos + 1 : pos + 1 + produced], stops).nonzero()
        if hit.numel():
            produced = int(hit[0, 0]) + 1
            return produced, int(tokens[0, pos + produced])
    return produced, None


class _Generation:
    """One speculative generation: the token buffer (prompt, verified tokens, room for one more block),
    both caches, the target features of the tokens verified last step, and `pos`, the position of the
    last verified token (the next block's anchor)."""

    def __init__(self, draft: DraftModel, target, input_ids: torch.Tensor, *, max_new_tokens: int, stop_token_ids, bs: int, s: _Sampling):
        dev = input_ids.device
        self.draft, self.target, self.bs, self.s = draft, target, bs, s
        self.head = _head(target)
        self.embed_w = target.get_input_embeddings().weight
        self.n = n = input_ids.shape[1]
        self.limit = n + max_new_tokens
        self.tokens = torch.full((1, self.limit + 1), draft.mask_token_id, dtype=torch.long, device=dev)
        self.tokens[:, :n] = input_ids
        self.positions = torch.arange(self.limit + 1, device=dev)[None]
        self.stops = None if not stop_token_ids else torch.tensor(list(stop_token_ids), dtype=torch.long, device=dev)
        self.t_cache = _target_cache(target)
        self.rollback = RecurrentRollback.for_target(target, self.t_cache)  # None: no linear-attention layers
        self.recording = self.rollback.recording if self.rollback is not None else contextlib.nullcontext
        self.d_cache = draft.new_cache()
        self.pos = n
        self.features = None
        self.stopped_on: int | None = None

    def prefill(self, input_ids: torch.Tensor) -> None:
        """The target's forward over the prompt: the first new token and the draft's first features."""
        n = self.n
        out = self.target(input_ids, position_ids=self.positions[:, :n], cache=self.t_cache, use_cache=True, logits_to_keep=1,
                          output_hidden_states=True)
        if self.rollback is not None:
            _crop(self.t_cache, n, trim=True)  # the conv states recorded the whole prompt; keep the kernel's width
        self.tokens[:, n] = pick(out.logits[:, -1], self.s.temperature, self.s.top_p, self.s.top_k, self.s.generator)
        self.features = context_features(out.hidden_states, self.draft.target_layer_ids)

    def step(self, clock) -> tuple[int, list[float]]:
        """One block: the draft proposes, the target verifies, the accepted tokens are written and
        both caches roll back to them. The tokens produced, and `clock()` between the phases."""
        pos, t_cache = self.pos, self.t_cache
        marks = [clock()]
        span = min(self.bs, self.limit - pos)
        block = self.tokens[:, pos : pos + span].clone()
        proposal, support, draft_probs = _propose(self.draft, block, self.features, self.d_cache, self.embed_w, self.head, self.s)
        block[:, 1:] = proposal
        marks.append(clock())

        with self.recording():
            out = self.target(block, position_ids=self.positions[:, pos : pos + span], cache=t_cache, use_cache=True,
                              output_hidden_states=True)
        marks.append(clock())
        accepted, bonus = _accept(proposal, out.logits, draft_probs, support, self.s)
        produced, self.stopped_on = _commit(self.tokens, pos, proposal, accepted, bonus, self.limit, self.stops)
        self.pos = pos = pos + produced
        marks.append(clock())
        if self.rollback is not None:
            self.rollback.replay(t_cache, produced)
            marks.append(clock())
        _crop(t_cache, pos, trim=self.rollback is not None)
        # the verify pass computed target features for the block; keep those now verified
        self.features = context_features(out.hidden_states, self.draft.target_layer_ids)[:, :produced]
        marks.append(clock())
        return produced, marks


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
    writing the tokens, stop tokens), ``rollback`` (hybrid targets only: the
    linear-attention layers' recurrence replayed over the accepted tokens) and
    ``crop`` (cache rollback and the next step's features); the device is
    synchronised between phases, which on an accelerator costs some of the
    overlap an unprofiled run has.
    """
    check_sampling(temperature, top_p, top_k)
    bs = _check_pair(draft, target, input_ids, max_new_tokens, block_size)
    sampling = _Sampling(temperature, top_p, top_k, generator)
    run = _Generation(draft, target, input_ids, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, bs=bs, s=sampling)
    dev, n = input_ids.device, run.n

    t0 = now(dev)
    run.prefill(input_ids)
    t1 = now(dev)

    lengths: list[int] = []
    phase = dict.fromkeys(("draft", "verify", "accept", *(("rollback",) if run.rollback else ()), "crop"), 0.0)
    clock = (lambda: now(dev)) if profile else (lambda: 0.0)
    if run.stops is not None and bool(torch.isin(run.tokens[0, n], run.stops)):
        run.stopped_on = int(run.tokens[0, n])
    while run.stopped_on is None and run.pos + 1 < run.limit:
        produced, marks = run.step(clock)
        lengths.append(produced)
        for k, a, b in zip(phase, marks, marks[1:]):
            phase[k] += b - a

    t2 = now(dev)
    output = run.tokens[:, : min(run.pos + 1, run.limit)]
    return SpeculativeResult(
        output_ids=output,
        acceptance_lengths=lengths,
        num_input_tokens=n,
        num_output_tokens=output.shape[1] - n,
        prefill_seconds=t1 - t0,
        decode_seconds=t2 - t1,
        stopped_on=run.stopped_on,
        extra={"phase_seconds": phase} if profile else {},
    )


@torch.inference_mode()
def greedy_generate(target, input_ids: torch.Tensor, *, max_new_tokens: int, stop_token_ids: list[int] | None = None) -> torch.Tensor:
    """Plain greedy decoding with the target alone (the baseline speculative output must equal).

    Its cache is never cropped, so it does not record past states: a recording hybrid cache would
    keep every conv input and take the slower multi-token conv path on each 1-token step."""
    cache = _target_cache(target, record_past=False)
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
