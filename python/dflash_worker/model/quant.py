"""AF4G64: affine 4-bit quantization in groups of 64, byte-exact with MLX.

This is the format an exported draft is served in on Apple Silicon (MLX
``mode="affine"``, ``bits=4``, ``group_size=64``), the fake quantization that
quantization-aware training (QAT) runs its forward pass with, and the scope
selectors that say which weights are quantized.

Format (checked against ``mlx.core.quantize`` / ``mlx.core.dequantize`` 0.32 on
CPU by ``tests/quant``). For each group of 64 consecutive elements along the
last axis, in float32:

- ``w_max``, ``w_min`` of the group; ``mask = |w_min| > |w_max|``;
- ``scale = max((w_max - w_min) / 15, 1e-7)`` (a true division, eps is
  ``float32(1e-7)``), negated unless ``mask``; ``edge = w_min if mask else w_max``;
- ``q0 = round(edge / scale)``; if ``q0 != 0``: ``scale = edge / q0`` and
  ``bias = edge``, else ``bias = 0`` (so zero is exactly representable);
- codes ``q = clamp(round((w - bias) / scale), 0, 15)`` using the *unrounded*
  float32 scale and bias;
- ``scales`` and ``biases`` are stored in BF16 (round to nearest even);
- 8 codes per ``uint32``, least significant nibble first.

Shapes: ``w [out, in]`` -> ``packed [out, in/8] uint32``, ``scales, biases
[out, in/64] bf16``.

Dequantization (what the loader reconstructs) is NOT a single float32
``q*scale + bias``: ``mlx.core.dequantize`` on CPU multiplies and adds in the
scales' dtype, so with BF16 scales every element is
``bf16(bf16(q * scale) + bias)``, then cast to the requested output dtype.
:func:`dequantize_af4g64` reproduces that bit for bit.

Variants (``variant=``):

- ``"mlx_cpu"`` (default): byte-exact with ``mlx.core.quantize`` on the CPU
  stream: ``round`` is round-half-to-even (``std::rint``) and the group max
  starts at ``-inf`` (the true group maximum).
- ``"apple_gpu"``: a model of MLX's Metal ``affine_quantize`` kernel (and its
  CUDA twin): ``round`` is round-half-away-from-zero (Metal ``round``) and
  ``w_max`` starts at 0, i.e. ``w_max = max(0, max(group))``, which changes the
  scale of all-negative groups. Written from the kernel source; NOT verified on
  Apple hardware here (no Metal device). It assumes IEEE-correct float32
  division. The kernel has no lower clamp before its ``uint8`` conversion; we
  clamp at 0, which only matters for codes that round below -0.5, which finite
  inputs never produce.

Non-finite inputs give unspecified (though deterministic) bytes: MLX and torch
encode the resulting NaN scales differently. The export writer refuses them,
and groups whose range overflows float32 (|w| near 3.4e38) quantize to
infinite scales, which it refuses too.

Devices: the computation runs on ``w``'s device with IEEE float32 division
and round-half-to-even; byte parity is tested on CPU only.

Input dtypes: float32, float16 and bfloat16. Half-precision inputs are upcast
to float32 first; the upcast is exact, so the result equals MLX quantizing the
same values in float32 (MLX itself computes in float32 for every input dtype).
For a BF16 input ``mlx.core.quantize`` returns BF16 scales directly and the
bytes match ours; for float32/float16 inputs MLX returns float32/float16
scales, and ours equal MLX's float32 scales rounded to BF16.

QAT: :func:`fake_quantize_af4g64` returns ``dequantize(quantize(w))`` in an
explicit dtype with a straight-through gradient, and :func:`quantized_weights`
swaps such tensors in for the FP32 master parameters for the length of a
``with`` block, always putting the very same ``nn.Parameter`` objects back.

Never quantized: norms (``*norm*``), the base convolutions
(``*.base_kernel``), the selector codebooks
(``candidate_selector.predecessor_codebook`` / ``successor_codebook``) and
biases. The scope selectors :func:`selector_context` and
:func:`full_projection` only ever pick ``nn.Linear`` weights; they report every
candidate they had to skip (not 2-D, in-features not a multiple of 64).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import ConfigError

GROUP_SIZE = 64
BITS = 4
N_BINS = (1 << BITS) - 1  # 15
CODES_PER_WORD = 32 // BITS  # 8
EPS = 1e-7  # rounded to float32 on use, as MLX's `float eps = 1e-7`

VARIANTS = ("mlx_cpu", "apple_gpu")
MLX_QUANTIZATION = {"group_size": GROUP_SIZE, "bits": BITS, "mode": "affine"}

_FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)
# Elements per row chunk: keeps the float32 temporaries (1 MiB) in cache; on a
# 2-core box this was ~2x faster than 4 MiB chunks and far faster than
# whole-matrix passes.
_CHUNK_ELEMS = 1 << 18

# Module names (last path component) whose `.weight` is an nn.Linear the draft owns.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
CONTEXT_PROJECTION = "fc"
CONV_PROJECTION = "kernel_projection"
SELECTOR_PROJECTION = "candidate_selector.hidden_projection"


# ---------------------------------------------------------------------------
# input checks


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ConfigError(
            f"unknown af4g64 variant `{variant}`\nhint: use one of {', '.join(f'`{v}`' for v in VARIANTS)}"
        )


def _check_weight(w: torch.Tensor, name: str) -> None:
    if not isinstance(w, torch.Tensor):
        raise ConfigError(f"af4g64: `{name}` is a `{type(w).__name__}`, expected a torch.Tensor")
    if w.dtype not in _FLOAT_INPUTS:
        raise ConfigError(
            f"af4g64: `{name}` has dtype `{str(w.dtype).removeprefix('torch.')}`, "
            "expected `float32`, `float16` or `bfloat16`"
        )
    if w.dim() != 2:
        raise ConfigError(
            f"af4g64: `{name}` has shape `{list(w.shape)}`, expected a 2-D weight [out, in]\n"
            "hint: only linear projection weights are quantized"
        )
    if w.shape[1] % GROUP_SIZE != 0 or w.shape[1] == 0:
        raise ConfigError(
            f"af4g64: `{name}` has shape `{list(w.shape)}`; its last dim `{w.shape[1]}` "
            f"is not a positive multiple of {GROUP_SIZE}\n"
            "hint: leave this tensor unquantized (the scope selectors report such tensors as skipped)"
        )


# ---------------------------------------------------------------------------
# rounding


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    # Metal `round`: ties go away from zero. `x - trunc(x)` is exact, so ties are
    # detected exactly; everything else rounds the same as half-to-even.
    r = torch.round(x)
    t = torch.trunc(x)
    tie = (x - t).abs() == 0.5
    return torch.where(tie, t + torch.sign(x), r)


def _round(x: torch.Tensor, variant: str) -> torch.Tensor:
    # torch.round is round-half-to-even, i.e. std::rint in the default FP mode.
    return torch.round(x) if variant == "mlx_cpu" else _round_half_away(x)


# ---------------------------------------------------------------------------
# core


def _group_params(g: torch.Tensor, variant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 (scale, bias) per group of `g [rows, groups, 64]` (float32), unrounded."""
    w_min, w_max = torch.aminmax(g, dim=-1)
    if variant == "apple_gpu":
        w_max = torch.clamp_min(w_max, 0.0)
    mask = w_min.abs() > w_max.abs()
    # A true division by 15, as MLX does; a multiply by 1/15 differs in the last
    # bit for many ranges. The divisor is a full tensor on purpose: CUDA turns a
    # division by a scalar into a multiply by its reciprocal.
    scale = torch.clamp_min((w_max - w_min) / torch.full_like(w_max, float(N_BINS)), EPS)
    scale = torch.where(mask, scale, -scale)
    edge = torch.where(mask, w_min, w_max)
    q0 = _round(edge / scale, variant)
    nonzero = q0 != 0
    # q0 == 0 would make edge / q0 a division by zero; those lanes keep `scale`.
    scale = torch.where(nonzero, edge / torch.where(nonzero, q0, torch.ones_like(q0)), scale)
    bias = torch.where(nonzero, edge, torch.zeros_like(edge))
    return scale, bias


def _packed_chunk(g: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, variant: str) -> torch.Tensor:
    """Packed bytes ``[rows, groups * 32]`` uint8 (two codes per byte, low nibble first) for ``g [rows, groups, 64]``."""
    x = g - bias.unsqueeze(-1)
    x = x.div_(scale.unsqueeze(-1))
    x = x.round_() if variant == "mlx_cpu" else _round_half_away(x)
    x = x.clamp_(0.0, float(N_BINS))
    # Codes are small integers held exactly in float32, so even + 16 * odd is the
    # packed byte, computed exactly before the (single) integer conversion.
    return torch.add(x[..., 0::2], x[..., 1::2], alpha=16).to(torch.uint8).reshape(x.shape[0], -1)


def quantize_af4g64(
    w: torch.Tensor, *, variant: str = "mlx_cpu", name: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight to AF4G64.

    Args:
        w: ``[out, in]`` float32/float16/bfloat16 tensor, ``in % 64 == 0``.
        variant: ``"mlx_cpu"`` (default) or ``"apple_gpu"``; see the module docstring.
        name: tensor name used in error messages.

    Returns:
        ``(packed [out, in/8] uint32, scales [out, in/64] bfloat16, biases [out, in/64] bfloat16)``
        on ``w``'s device. The input is not modified and gradients are not tracked.
    """
    _check_variant(variant)
    _check_weight(w, name)
    rows, cols = w.shape
    groups = cols // GROUP_SIZE
    packed_u8 = torch.empty((rows, cols // 2), dtype=torch.uint8, device=w.device)
    scales = torch.empty((rows, groups), dtype=torch.bfloat16, device=w.device)
    biases = torch.empty((rows, groups), dtype=torch.bfloat16, device=w.device)
    step = max(1, _CHUNK_ELEMS // cols)
    with torch.no_grad():
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            # float32 upcast is exact for fp16/bf16 inputs.
            g = w[r0:r1].to(torch.float32).reshape(r1 - r0, groups, GROUP_SIZE)
            scale, bias = _group_params(g, variant)
            packed_u8[r0:r1] = _packed_chunk(g, scale, bias, variant)
            scales[r0:r1] = scale.to(torch.bfloat16)  # round to nearest even
            biases[r0:r1] = bias.to(torch.bfloat16)
    return _bytes_to_words(packed_u8), scales, biases


# ---------------------------------------------------------------------------
# packing


def _pack_bytes(codes: torch.Tensor) -> torch.Tensor:
    # Two codes per byte, even index in the low nibble.
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _bytes_to_words(packed_u8: torch.Tensor) -> torch.Tensor:
    # On a little-endian host byte k of a uint32 holds bits 8k..8k+7, so bytes laid
    # out low-nibble-first are exactly MLX's least-significant-nibble-first words.
    if sys.byteorder == "little":
        return packed_u8.view(torch.uint32)
    b = packed_u8.reshape(*packed_u8.shape[:-1], -1, 4).to(torch.int64)
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    return words.to(torch.uint32)


def _words_to_bytes(packed: torch.Tensor) -> torch.Tensor:
    if sys.byteorder == "little":
        return packed.contiguous().view(torch.uint8)
    w = packed.to(torch.int64)
    b = torch.stack([(w >> s) & 0xFF for s in (0, 8, 16, 24)], dim=-1)
    return b.reshape(*packed.shape[:-1], -1).to(torch.uint8)


def pack_af4g64(codes: torch.Tensor) -> torch.Tensor:
    """Pack integer codes ``[..., n]`` (values 0..15, ``n % 8 == 0``) into ``[..., n/8]`` uint32.

    Code ``8*j + k`` goes to bits ``4k .. 4k+3`` of word ``j`` (least significant nibble first).
    """
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise ConfigError(f"af4g64 pack: codes have dtype `{codes.dtype}`, expected an integer dtype")
    if codes.dim() == 0 or codes.shape[-1] % CODES_PER_WORD != 0:
        raise ConfigError(
            f"af4g64 pack: codes have shape `{list(codes.shape)}`; the last dim must be a multiple of {CODES_PER_WORD}"
        )
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > N_BINS):
        raise ConfigError(f"af4g64 pack: codes must lie in 0..{N_BINS}, found `{int(codes.min())}..{int(codes.max())}`")
    return _bytes_to_words(_pack_bytes(codes.to(torch.uint8).contiguous()).contiguous())


def unpack_af4g64(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_af4g64`: ``[..., m]`` uint32 -> ``[..., 8m]`` uint8 codes."""
    if packed.dtype != torch.uint32:
        raise ConfigError(f"af4g64 unpack: packed weight has dtype `{packed.dtype}`, expected `torch.uint32`")
    b = _words_to_bytes(packed)
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * CODES_PER_WORD)


# ---------------------------------------------------------------------------
# dequantization


def dequantize_af4g64(
    packed: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Reconstruct ``[out, in]`` weights exactly as ``mlx.core.dequantize`` does on CPU.

    With BF16 scales/biases every element is ``bf16(bf16(q * scale) + bias)``
    (MLX computes in the scales' dtype), then cast to `dtype` (float32 output
    therefore holds BF16 values). Float32 scales (not what AF4G64 stores) give
    a plain float32 ``q * scale + bias``.
    """
    if packed.dim() != 2 or scales.dim() != 2 or biases.dim() != 2:
        raise ConfigError(
            f"af4g64 dequantize: expected 2-D tensors, got packed `{list(packed.shape)}`, "
            f"scales `{list(scales.shape)}`, biases `{list(biases.shape)}`"
        )
    rows, words = packed.shape
    cols = words * CODES_PER_WORD
    if cols % GROUP_SIZE != 0 or tuple(scales.shape) != (rows, cols // GROUP_SIZE) or scales.shape != biases.shape:
        raise ConfigError(
            f"af4g64 dequantize: packed `{list(packed.shape)}` needs scales and biases of shape "
            f"`{[rows, cols // GROUP_SIZE]}`, got `{list(scales.shape)}` and `{list(biases.shape)}`"
        )
    if scales.dtype != biases.dtype or scales.dtype not in _FLOAT_INPUTS:
        raise ConfigError(
            f"af4g64 dequantize: scales `{scales.dtype}` and biases `{biases.dtype}` must share one float dtype"
        )
    compute = scales.dtype
    codes = unpack_af4g64(packed).to(torch.float32).reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    s = scales.to(torch.float32).unsqueeze(-1)
    b = biases.to(torch.float32).unsqueeze(-1)
    # q * s is exact in float32 (4-bit times 8- or 11-bit significand); each
    # operation is rounded to the compute dtype, as MLX's elementwise ops do.
    prod = (codes * s).to(compute).to(torch.float32)
    out = (prod + b).to(compute)
    return out.reshape(rows, cols).to(dtype)


# ---------------------------------------------------------------------------
# fake quantization (QAT)


class _FakeQuantizeAF4G64(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, dtype, out_dtype, variant):  # type: ignore[override]
        ctx.in_dtype = w.dtype
        packed, scales, biases = quantize_af4g64(w.detach(), variant=variant)
        return dequantize_af4g64(packed, scales, biases, dtype).to(out_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        # Straight-through: d(fake_quant(w))/dw := identity. The cast only changes
        # the dtype to the master's (e.g. bf16 grad -> fp32 master), never the value.
        return grad.to(ctx.in_dtype), None, None, None


def fake_quantize_af4g64(
    w: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    *,
    out_dtype: torch.dtype | None = None,
    variant: str = "mlx_cpu",
) -> torch.Tensor:
    """``dequantize_af4g64(*quantize_af4g64(w), dtype)`` with a straight-through gradient.

    The forward values are exactly what an MLX loader reconstructs from the
    export (``mlx.core.dequantize(..., dtype=dtype)``): `dtype` is the dtype the
    served model runs in. The result has dtype `out_dtype` (default: `dtype`);
    pass ``out_dtype=w.dtype`` to get the same values (BF16 values are exact in
    FP32) in the master's dtype, so the backward pass never rounds the gradient
    through `dtype`. Backward returns the incoming gradient unchanged (cast to
    ``w.dtype``).
    """
    _check_variant(variant)
    _check_weight(w, "weight")
    for d in (dtype, out_dtype if out_dtype is not None else dtype):
        if d not in _FLOAT_INPUTS:
            raise ConfigError(f"af4g64 fake quantize: dtype `{d}` is not float32, float16 or bfloat16")
    return _FakeQuantizeAF4G64.apply(w, dtype, out_dtype if out_dtype is not None else dtype, variant)


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    try:
        owner = module.get_submodule(path) if path else module
    except AttributeError:
        raise ConfigError(f"qat: module has no submodule `{path}` (parameter `{name}`)") from None
    if attr not in owner._parameters or owner._parameters[attr] is None:
        raise ConfigError(f"qat: module has no parameter `{name}`\nhint: names come from `module.named_parameters()`")
    return owner, attr


@contextlib.contextmanager
def quantized_weights(
    module: nn.Module,
    names: Iterable[str],
    *,
    dtype: torch.dtype = torch.bfloat16,
    variant: str = "mlx_cpu",
) -> Iterator[dict[str, torch.Tensor]]:
    """Within the ``with`` block, `module`'s parameters `names` read as their fake-quantized values.

    Each named parameter ``p`` is replaced in its owner's ``_parameters`` slot (order
    kept) by ``fake_quantize_af4g64(p, dtype, out_dtype=p.dtype)``: values the loader
    reconstructs in `dtype` (for BF16, exactly representable in an FP32 master),
    and, when grad mode is on, connected to ``p`` by the straight-through
    gradient, so ``loss.backward()`` (inside or after the block) fills ``p.grad``.
    The optimizer keeps referring to the original FP32 master parameters.

    On exit (normal, exception or generator close) every slot gets back the very
    same ``nn.Parameter`` object, untouched. Inside the block
    ``module.parameters()`` yields the swapped tensors; do not build optimizers
    or save state dicts there. Yields ``{name: swapped tensor}``.
    """
    _check_variant(variant)
    names = list(dict.fromkeys(names))
    slots: list[tuple[nn.Module, str, nn.Parameter]] = []
    for n in names:
        owner, attr = _owner(module, n)
        p = owner._parameters[attr]
        if not isinstance(p, nn.Parameter):
            raise ConfigError(f"qat: `{n}` is already swapped (nested quantized_weights on the same parameter)")
        _check_weight(p, n)
        slots.append((owner, attr, p))
    # Compute every replacement before touching the module, so a bad tensor
    # (shape, dtype) raises with nothing swapped.
    swapped = {
        n: fake_quantize_af4g64(p, dtype, out_dtype=p.dtype, variant=variant) for n, (_, _, p) in zip(names, slots)
    }
    done: list[tuple[nn.Module, str, nn.Parameter]] = []
    try:
        for n, (owner, attr, p) in zip(names, slots):
            # Direct slot assignment: nn.Module.__setattr__ would refuse a
            # non-Parameter here, and deleting + re-adding would reorder
            # named_parameters() (and with it optimizer/state-dict order).
            owner._parameters[attr] = swapped[n]  # type: ignore[assignment]
            done.append((owner, attr, p))
        yield swapped
    finally:
        for owner, attr, p in reversed(done):
            owner._parameters[attr] = p


# ---------------------------------------------------------------------------
# scopes


@dataclass(frozen=True)
class QuantScope:
    """Result of a scope selector: the parameter names to quantize, and what was skipped and why."""

    names: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...] = field(default_factory=tuple)


def _named(params: nn.Module | Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]):
    if isinstance(params, nn.Module):
        return list(params.named_parameters())
    if isinstance(params, Mapping):
        return list(params.items())
    return list(params)


def never_quantized(name: str) -> bool:
    """True for tensors AF4G64 never touches: norms, base convolutions, selector codebooks, biases."""
    parts = name.split(".")
    module = parts[-2] if len(parts) > 1 else ""
    return (
        "norm" in module
        or parts[-1] in ("base_kernel", "bias")
        or any(p.endswith("_codebook") for p in parts)
    )


def _select(params, match) -> QuantScope:
    names: list[str] = []
    skipped: list[tuple[str, str]] = []
    for name, t in _named(params):
        if not name.endswith(".weight") or never_quantized(name) or not match(name[: -len(".weight")]):
            continue
        shape = list(t.shape)
        if len(shape) != 2:
            skipped.append((name, f"shape `{shape}` is not 2-D"))
        elif shape[1] == 0 or shape[1] % GROUP_SIZE != 0:
            skipped.append((name, f"in-features `{shape[1]}` not a multiple of {GROUP_SIZE}"))
        else:
            names.append(name)
    return QuantScope(tuple(names), tuple(skipped))


def _is(module_path: str, suffix: str) -> bool:
    return module_path == suffix or module_path.endswith("." + suffix)


def selector_context(params) -> QuantScope:
    """Scope ``selector_context``: the candidate selector's ``hidden_projection`` and the context ``fc``.

    `params` is an ``nn.Module``, a mapping or an iterable of ``(name, tensor)``.
    """
    return _select(params, lambda m: _is(m, CONTEXT_PROJECTION) or _is(m, SELECTOR_PROJECTION))


_FULL = frozenset((*ATTENTION_PROJECTIONS, *MLP_PROJECTIONS, CONTEXT_PROJECTION, CONV_PROJECTION))


def full_projection(params) -> QuantScope:
    """Scope ``full_projection``: every ``nn.Linear`` weight the draft owns.

    q/k/v/o, gate/up/down, the context ``fc``, each conv's ``kernel_projection``
    and the selector's ``hidden_projection``. Norms, ``*.base_kernel`` and the
    selector codebooks are never included. `params` as for :func:`selector_context`.
    """
    return _select(params, lambda m: m.rsplit(".", 1)[-1] in _FULL or _is(m, SELECTOR_PROJECTION))


SCOPES = {"selector_context": selector_context, "full_projection": full_projection}


__all__ = [
    "BITS",
    "GROUP_SIZE",
    "MLX_QUANTIZATION",
    "QuantScope",
    "SCOPES",
    "VARIANTS",
    "dequantize_af4g64",
    "fake_quantize_af4g64",
    "full_projection",
    "never_quantized",
    "pack_af4g64",
    "quantize_af4g64",
    "quantized_weights",
    "selector_context",
    "unpack_af4g64",
]

