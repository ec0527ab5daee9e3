"""Exact rollback of Gated DeltaNet recurrent states after a speculative verify step.

Why this exists: a hybrid target (Qwen3.5, Qwen3.5-MoE: Gated DeltaNet `linear_attn` layers
mixed 3:1 with gated full attention) keeps two states per linear-attention layer, and
transformers 5.24's `cache.crop(-n)` puts back only one of them. With past recording on, the
conv states keep the raw inputs of the whole block, so `crop` cuts them back exactly; the
recurrent state is copied in place after the block (`update_recurrent_state`), rejected tokens
included, and the state from before the block is gone. Left alone, the target continues from a
state that saw tokens the output does not contain, and speculative output drifts away from the
target's own greedy decoding.

How: snapshot and replay (what the upstream MLX path does). During the verify forward only,
`recording()` wraps the module globals through which `*GatedDeltaNet.forward` runs the
recurrence (`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`, looked up in
the module that defines each layer's class, so Qwen3.5 and Qwen3.5-MoE are both covered), and a
forward pre-hook on each layer tells the wrapper which layer is running. The wrapper keeps the
recurrence inputs (query, key, value, g, beta: after the conv, before the kernel's own l2 norm)
and a clone of the state the block started from. After acceptance, `replay` runs the layer's
token-by-token recurrence (`torch_recurrent_gated_delta_rule`, or the fused kernel transformers
dispatches it to) over the accepted tokens only, from that clone, and copies the final state
into the cache: the same per-token update 1-token decoding applies, and cheaper for a few
tokens than the chunked form (which pads every call to a 64-token chunk). The conv states are
left to `crop`. Everything patched is restored in a `finally`; a layer whose forward did not go
through the wrapped functions (a hub kernel replaced it, transformers moved the call) is an
error, never a silent drift.

Whichever implementation runs: transformers dispatches from inside those module globals (its
`use_kernel_func_from_hub_with_fallback` resolves the torch reference, `flash-linear-attention`,
or, with the `kernels` package, an `nn.Module` singleton whose `forward` a hub kernel may replace:
see `weights.linear_kernels`), so wrapping the globals intercepts every one of them, and the replay
calls the same dispatcher the layer called. Only a kernel for the whole layer
(`Qwen3_5GatedDeltaNet` is also a hub layer name) runs its recurrence elsewhere; the forward hook
sees the missing call and refuses. tests/model/test_hybrid_kernels.py runs this with stand-in
kernels registered through transformers' own decorator.

What it costs, per linear-attention layer and verify step: one clone of the recurrent state
([1, value heads, key dim, value dim] float32: 2 MiB for a 32 x 128 x 128 layer), references to
the block's recurrence inputs (no copies), and, only when some proposal was rejected, one
token-by-token recurrence over the accepted tokens (< block size): a fraction of the block
forward, timed as the `rollback` phase of a profiled run. Targets without linear-attention
layers never build a `RecurrentRollback` and pay nothing. The patch is process-wide while a
verify forward runs: two speculative loops over targets of the same family in two threads at
once are not supported.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..errors import FamilyError

# The module globals `*GatedDeltaNet.forward` calls for the recurrence (transformers 5.24): the
# chunked form for blocks, the token-by-token form for single tokens (and for the replay).
CHUNKED, RECURRENT = "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"
RECURRENCE_FUNCTIONS = (CHUNKED, RECURRENT)
# The recurrence inputs, sequence on dim 1: query/key/value [1, T, heads, dim], g/beta [1, T, heads].
_SEQUENCE_INPUTS = ("query", "key", "value", "g", "beta")
# Arguments the replay sets itself or that only the chunked form takes.
_NOT_PASSED_ON = (*_SEQUENCE_INPUTS, "initial_state", "output_final_state", "chunk_size")
_HINT = (
    "hint: exact rollback is implemented for transformers 5.24's Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE); "
    "load the target with transformers' own modeling code, without a hub kernel for the whole Gated DeltaNet layer"
)


@dataclass
class _Recorded:
    """One layer's recurrence call during a verify forward: enough to recompute its state on a prefix."""

    replay_fn: Callable  # the layer's token-by-token recurrence, as it was before `recording` wrapped it
    inputs: dict[str, torch.Tensor]  # `_SEQUENCE_INPUTS`, the whole block
    options: dict  # the call's other arguments (`use_qk_l2norm_in_kernel`, ...), passed on unchanged
    initial_state: torch.Tensor  # a clone: the cache's tensor is overwritten in place after the call

    @property
    def length(self) -> int:
        return self.inputs["query"].shape[1]

    def batch_key(self) -> tuple:
        """Calls with equal keys can replay as one batch. A tensor or unhashable option (packed
        sequences' `cu_seqlens`, say) keeps a call apart: stacking layers would not respect it."""
        if any(torch.is_tensor(v) or not isinstance(v, Hashable) for v in self.options.values()):
            return (id(self),)
        shapes = tuple((t.shape, t.dtype, t.device) for t in (*self.inputs.values(), self.initial_state))
        return (self.replay_fn, shapes, frozenset(self.options.items()))


class RecurrentRollback:
    """Snapshot during the verify forward (`recording`), replay over the accepted tokens (`replay`)."""

    def __init__(self, layers: dict[int, torch.nn.Module]):
        self.layers = layers
        self.recorded: dict[int, _Recorded] = {}
        self._running: int | None = None
        self._homes: list[object] = []  # the python modules whose recurrence globals `recording` wraps
        for module in layers.values():
            home = sys.modules.get(type(module).__module__)
            missing = [n for n in RECURRENCE_FUNCTIONS if not callable(getattr(home, n, None))]
            if missing:
                raise FamilyError(
                    f"linear-attention layer `{module.layer_idx}` (`{type(module).__name__}`): its module "
                    f"`{type(module).__module__}` has no `{'`, `'.join(missing)}` to intercept\n{_HINT}"
                )
            if home not in self._homes:
                self._homes.append(home)

    @classmethod
    def for_target(cls, target, cache) -> RecurrentRollback | None:
        """The rollback for `target`'s linear-attention layers in `cache`, or None when it has none.

        Raises `FamilyError` when a linear-attention cache layer has no Gated DeltaNet module: its
        recurrent state could not be rolled back, and speculative output would drift silently."""
        from transformers.cache_utils import LinearAttentionCacheLayerMixin

        linear = [i for i, layer in enumerate(cache.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]
        if not linear:
            return None
        found = {m.layer_idx: m for m in target.modules() if type(m).__name__.endswith("GatedDeltaNet") and hasattr(m, "layer_idx")}
        missing = [i for i in linear if i not in found]
        if missing:
            raise FamilyError(
                f"the target's cache has linear-attention layers `{missing}` without a Gated DeltaNet module, so "
                f"speculative decoding cannot roll their recurrent state back\n{_HINT}"
            )
        return cls({i: found[i] for i in linear})

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Record every layer's recurrence call of the forward run inside; restores all it patches."""
        self.recorded.clear()
        saved = [(home, name, getattr(home, name)) for home in self._homes for name in RECURRENCE_FUNCTIONS]
        replay_fns = {home: fn for home, name, fn in saved if name == RECURRENT}
        hooks = []
        try:
            for home, name, fn in saved:
                setattr(home, name, self._wrap(fn, replay_fns[home]))
            for idx, module in self.layers.items():
                hooks.append(module.register_forward_pre_hook(self._enter_hook(idx)))
                hooks.append(module.register_forward_hook(self._leave_hook(idx)))
            yield
        finally:
            for hook in hooks:
                hook.remove()
            for home, name, fn in saved:
                setattr(home, name, fn)
            self._running = None

    def replay(self, cache, produced: int) -> None:
        """Put each layer's recurrent state in `cache` back to the state after the first `produced`
        tokens of the recorded block (no work when the whole block was kept).

        Layers whose calls agree in function, shapes and options replay as one batch (layers on
        the batch dimension): one kernel launch, or one Python loop on the CPU, instead of one
        per layer."""
        groups: dict[tuple, list[int]] = {}
        for idx, rec in self.recorded.items():
            assert 1 <= produced <= rec.length, (produced, rec.length)
            if produced < rec.length:  # else the state after the whole block is the one the cache holds
                groups.setdefault(rec.batch_key(), []).append(idx)
        for idxs in groups.values():
            recs = [self.recorded[i] for i in idxs]
            q, k, v, g, beta = (torch.cat([r.inputs[name][:, :produced] for r in recs]) for name in _SEQUENCE_INPUTS)
            initial = torch.cat([r.initial_state for r in recs])
            # q, k, v positional as the layer passes them: a fused kernel behind the function names them `q, k, v`
            _, state = recs[0].replay_fn(q, k, v, g=g, beta=beta, initial_state=initial, output_final_state=True, **recs[0].options)
            for i, layer_state in zip(idxs, state.split(1)):
                cache.update_recurrent_state(layer_state, i)
        self.recorded.clear()

    def _wrap(self, fn: Callable, replay_fn: Callable) -> Callable:
        signature = call_signature(fn)
        var = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
        name = getattr(fn, "__name__", None) or getattr(type(fn), "kernel_layer_name", type(fn).__name__)

        def recording_recurrence(*args, **kwargs):
            idx = self._running
            if idx is not None:
                bound = signature.bind(*args, **kwargs)
                reason = _unreplayable(bound, idx in self.recorded)
                if reason:
                    raise FamilyError(
                        f"linear-attention layer `{idx}` called `{name}` in a way the rollback cannot replay: {reason}\n{_HINT}"
                    )
                arguments = bound.arguments
                options = {k: v for k, v in arguments.items() if k not in _NOT_PASSED_ON and k != var}
                options.update(arguments.get(var, {}) if var else {})
                inputs = {name: arguments[name] for name in _SEQUENCE_INPUTS}
                self.recorded[idx] = _Recorded(replay_fn, inputs, options, arguments["initial_state"].clone())
            return fn(*args, **kwargs)

        return recording_recurrence

    def _enter_hook(self, idx: int):
        def hook(module, args):
            self._running = idx

        return hook

    def _leave_hook(self, idx: int):
        def hook(module, args, output):
            self._running = None
            if idx not in self.recorded:
                raise FamilyError(
                    f"linear-attention layer `{idx}` (`{type(module).__name__}`) ran its forward without calling "
                    f"`{'` or `'.join(RECURRENCE_FUNCTIONS)}`, so its recurrent state cannot be rolled back\n{_HINT}"
                )

        return hook


def call_signature(fn: Callable) -> inspect.Signature:
    """The signature a call to recurrence function `fn` is bound against: its own (transformers'
    decorator wraps the torch reference with `functools.wraps`, so the reference's names), or, for a
    function the `kernels` package made an `nn.Module` singleton (`use_kernel_forward_from_hub` on a
    function), that of its class's `forward` without `self`: the decorated function's, whatever hub
    layer `kernelize` later bound on the instance (the caller still passes the reference's names)."""
    if isinstance(fn, torch.nn.Module):
        signature = inspect.signature(type(fn).forward)
        return signature.replace(parameters=list(signature.parameters.values())[1:])
    return inspect.signature(fn)


def _unreplayable(bound: inspect.BoundArguments, seen: bool) -> str | None:
    """Why a recorded recurrence call could not be replayed on a prefix, or None."""
    if seen:
        return "a second recurrence call in one forward"
    missing = [n for n in _SEQUENCE_INPUTS if not isinstance(bound.arguments.get(n), torch.Tensor)]
    if missing:
        return f"inputs `{missing}` not found"
    if bound.arguments.get("initial_state") is None:
        return "no recurrent state before the block (the prompt must be prefilled into the same cache)"
    return None
