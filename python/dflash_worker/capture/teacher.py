"""The teacher-feature path: the one component capture and training both call.

`Teacher` holds the frozen target (streamed in by `dflash_worker.weights.load_model`, in eval
mode, never trained) and the target layer ids the draft taps. Capture uses it to regenerate a
response (`example_tokens`) and to compute the features it stores; online training
(`[train].features = "online"`) uses the very same `Teacher.features` inside the training
step, so both modes see the same numbers for the same tokens on the same kind of device.

Features: for each id in `layer_ids`, ``hidden_states[id + 1]`` (the output of decoder layer
`id`) of a forward over the example (batch 1, no padding), concatenated on the last dim:
``[T, len(layer_ids) * hidden]`` on the CPU, in the teacher's dtype. Only those hidden states
are asked for (transformers' ``output_hidden_states=[...]`` selection), so the other layers'
outputs are freed as the forward goes.

Long examples (`chunk_tokens`, `[capture].chunk_tokens`, for capture and online training alike):
an example of at most `chunk_tokens` tokens runs as one plain forward (``use_cache=False``), the
bytes every capture so far holds. A longer one runs chunk by chunk through the target's own
cache (``use_cache=True``; the cache class transformers builds for the target: a KV cache for
attention layers and, on hybrid Qwen3.5 targets, the Gated DeltaNet conv and recurrent states),
each chunk's queries attending to the cached prefix and causally to their own chunk with no mask
built at all: an SDPA target runs its attention layers through `prefix_causal_sdpa`, registered
in transformers' own `AttentionInterface` for the chunked loop only. On the CPU it is SDPA's flash
kernel twice (the prefix keys unmasked, the chunk's own keys causal) merged by their log-sum-exps;
elsewhere SDPA with a lower-right causal bias (`torch.nn.attention.bias.causal_lower_right`). An
explicit ``[chunk, prefix + chunk]`` mask would cost both memory (its float copy inside SDPA) and
time (a masked kernel skips no block). Memory then grows linearly with `T`: the cache
(keys/values of the attention layers), the features kept (written into one preallocated
``[T, F]`` tensor) and one chunk's activations. The values equal the one-shot forward's up to
float reordering (a chunk's matmuls and attention reductions run over other shapes, so a few ulps
differ; the tiny targets' bound is in tests/capture/test_long_context.py); the capture key names
`chunk_tokens` whenever `max_length` exceeds it.
"""

from __future__ import annotations

import contextlib
import gc
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..data import Example, render_row
from ..errors import DataError

if TYPE_CHECKING:
    from .plan import CapturePlan


DEFAULT_CHUNK_TOKENS = 2048  # `[capture].chunk_tokens`'s default


def teacher_features(model: Any, input_ids: list[int], layer_ids: list[int], device: Any, *,
                     chunk_tokens: int | None = None):
    """`[T, len(layer_ids) * H]` on the CPU: ``hidden_states[id + 1]`` of each id, concatenated.

    `chunk_tokens`: longer examples run chunk by chunk through the target's cache (module
    docstring); None runs every example as one forward.
    """
    import torch

    wanted = [i + 1 for i in layer_ids]
    T = len(input_ids)
    with torch.inference_mode():
        x = torch.tensor([input_ids], dtype=torch.long, device=device)
        if chunk_tokens is None or T <= chunk_tokens:
            out = model(input_ids=x, output_hidden_states=wanted, use_cache=False, logits_to_keep=1)
            return _taps(out.hidden_states, layer_ids).to("cpu")
        feats, cache = None, None
        with _prefix_attention(model):
            for start in range(0, T, chunk_tokens):
                # `cache` None on the first chunk: the model builds its own cache class (hybrid targets: linear
                # attention states beside the KV cache) and hands it back to carry into the next chunk
                out = model(input_ids=x[:, start : start + chunk_tokens], cache=cache, use_cache=True,
                            output_hidden_states=wanted, logits_to_keep=1)
                cache = out.cache
                part = _taps(out.hidden_states, layer_ids)
                if feats is None:
                    feats = torch.empty((T, part.shape[-1]), dtype=part.dtype, device="cpu")
                feats[start : start + part.shape[0]].copy_(part)
                del out, part
        return feats


PREFIX_ATTENTION = "prefix_causal_sdpa"  # no "flash" in it: transformers reads such names as hub kernels


@contextlib.contextmanager
def _prefix_attention(model: Any) -> Iterator[None]:
    """`model`'s attention layers run `prefix_causal_sdpa` inside (an SDPA target only; eager or flash
    targets keep theirs, with the masks transformers builds for them)."""
    before = model.config._attn_implementation
    if before != "sdpa":
        yield
        return
    from transformers import AttentionInterface

    AttentionInterface.register(PREFIX_ATTENTION, prefix_causal_sdpa)
    model.set_attn_implementation(PREFIX_ATTENTION)  # not in the mask registry: transformers builds no mask
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def prefix_causal_sdpa(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
                       scaling: float | None = None, sliding_window: int | None = None, **kwargs: Any) -> tuple[Any, None]:
    """A transformers attention function for a chunk after a cached prefix: query ``i`` of ``C`` sits at
    position ``S - C + i`` of the ``S`` keys and sees every key up to it (module docstring).

    query ``[1, Hq, C, D]``, key / value ``[1, Hkv, S, D]``; returns ``([1, C, Hq, D], None)``."""
    import torch
    import torch.nn.functional as F

    assert attention_mask is None and query.shape[0] == 1, "the chunked teacher runs batch 1 without padding"
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    C, S = query.shape[-2], key.shape[-2]
    P = S - C
    if sliding_window is not None:  # a sliding layer: its own `[C, S]` mask (transformers' rule, q - k < window)
        q_pos = torch.arange(P, S, device=query.device)[:, None]
        k_pos = torch.arange(S, device=query.device)[None, :]
        mask = (k_pos <= q_pos) & (q_pos - k_pos < sliding_window)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    elif P == 0:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    elif query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16, torch.float16):
        # both halves and their merge in float32, rounded to the teacher's dtype once, as the one-shot kernel does
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        q, k, v = query.float(), key.float(), value.float()
        o_pre, lse_pre = flash(q, k[:, :, :P], v[:, :, :P], 0.0, False, scale=scaling)
        o_own, lse_own = flash(q, k[:, :, P:], v[:, :, P:], 0.0, True, scale=scaling)
        # softmax over both key sets = each part's softmax weighted by its share of the total exp-sum
        lse_pre, lse_own = lse_pre.unsqueeze(-1), lse_own.unsqueeze(-1)
        top = torch.maximum(lse_pre, lse_own)
        w_pre, w_own = (lse_pre - top).exp(), (lse_own - top).exp()
        out = ((o_pre * w_pre + o_own * w_own) / (w_pre + w_own)).to(query.dtype)
    else:
        from torch.nn.attention.bias import causal_lower_right

        out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(C, S), scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _taps(hidden_states: Any, layer_ids: list[int]) -> Any:
    """``[T, len(layer_ids) * H]``: the selected hidden states of batch row 0, concatenated."""
    import torch

    return torch.cat([hidden_states[i + 1][0] for i in layer_ids], dim=-1)


class Teacher:
    """The frozen target on one device and the layers the draft taps (module docstring)."""

    def __init__(self, model: Any, layer_ids: list[int], *, device: str, dtype: str, load_seconds: float = 0.0,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        self.model = model
        self.layer_ids = list(layer_ids)
        self.device = device
        self.dtype = dtype
        self.load_seconds = load_seconds
        self.chunk_tokens = chunk_tokens

    @classmethod
    def load(cls, target: Path, layer_ids: list[int], *, device: str, dtype: str,
             chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Teacher:
        """Stream the target in (`weights.load_model`) on `device` in `dtype` (a `[capture].dtype` name);
        `chunk_tokens`: `[capture].chunk_tokens` (module docstring)."""
        import torch

        from ..weights import load_model

        t = time.perf_counter()
        model = load_model(target, device=device, dtype=getattr(torch, dtype))
        model.eval()  # frozen: features are computed under `inference_mode`, nothing is trained
        return cls(model, layer_ids, device=device, dtype=dtype, load_seconds=time.perf_counter() - t, chunk_tokens=chunk_tokens)

    def skipped_note(self) -> str:
        """`` (skipped unread: ...)`` for a multimodal target whose vision / MTP tensors were not read, else ``""``."""
        rep = getattr(self.model, "load_report", None)
        if rep is None or not rep.skipped:
            return ""
        return f" (skipped unread: {len(rep.skipped)} tensors, {rep.bytes_skipped} bytes outside the text tower)"

    def features(self, input_ids: list[int]) -> Any:
        """The tap features of one example: `[T, len(layer_ids) * hidden]`, CPU, in the teacher's dtype."""
        import torch

        feats = teacher_features(self.model, input_ids, self.layer_ids, self.device, chunk_tokens=self.chunk_tokens)
        return feats.to(getattr(torch, self.dtype))

    def release(self) -> bool:
        """Drop the model (``del`` + ``gc``, and the CUDA cache); True when nothing else still holds it."""
        import torch

        ref = weakref.ref(self.model)
        self.model = None
        gc.collect()
        if str(self.device).startswith("cuda"):
            torch.cuda.empty_cache()
        return ref() is None


def example_tokens(plan: CapturePlan, model: Any, ex: Example, stops: list[int], cut: frozenset[tuple[str, str]]) -> tuple[list[int], list[int], bool]:
    """(input ids, loss mask, truncated) of one example: rendered as prepared, or with a regenerated response.

    `model`: the teacher's model (read only with `[capture].regenerate`).
    `cut`: `(split, id)` of the examples `on_overlong = "truncate"` cuts to `max_length`; ids and
    mask are cut at the same position, and the plan guarantees response tokens remain.
    `truncated` is about generation (hit `max_new_tokens`), not this cut.
    """
    from .generate import regenerate_example

    cap, dcfg, tokenizer = plan.cap, plan.recipe.data, plan.tokenizer
    if cap.regenerate:  # in the row's thinking mode, turn by turn from the logged context (`regenerate_example`)
        g = regenerate_example(model, tokenizer, ex, data=dcfg, cap=cap, stop_ids=stops, device=plan.choice.device)
        ids, mask, truncated = g.ids, g.mask, g.truncated
    else:
        r = render_row(tokenizer, ex, dcfg)
        ids, mask, truncated = r.input_ids, r.loss_mask, False
        if (ex.split, ex.id) in cut:
            ids, mask = ids[: dcfg.max_length], mask[: dcfg.max_length]
    if len(ids) > dcfg.max_length:  # check_data and the overlong plan guarantee this never happens
        raise DataError(f"`{ex.file}` line {ex.line}: `{len(ids)}` tokens > max_length `{dcfg.max_length}`")
    return ids, mask, truncated
