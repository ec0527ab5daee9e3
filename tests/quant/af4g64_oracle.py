"""Helpers shared by the AF4G64 tests: MLX as the byte oracle, raw-byte views, and an
independent scalar reference (one group at a time, numpy float32) of both variants."""

from __future__ import annotations

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core", reason="mlx[cpu] is the AF4G64 byte oracle")


def np_bits(t: torch.Tensor) -> np.ndarray:
    """Raw bits of a torch tensor as an unsigned numpy array (uint32 / uint16 / uint8)."""
    t = t.detach().cpu().contiguous()
    view = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]
    arr = t.view(view).numpy()
    return arr.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[t.element_size()])


def mx_bits(a) -> np.ndarray:
    """Raw bits of an mlx array as an unsigned numpy array."""
    size = a.itemsize
    ui = {4: mx.uint32, 2: mx.uint16, 1: mx.uint8}[size]
    mx.eval(a)
    return np.array(a.view(ui))


def to_mx(t: torch.Tensor):
    """The same bits as an mlx array of the same dtype."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.float32:
        return mx.array(t.numpy())
    if t.dtype == torch.float16:
        return mx.array(t.numpy())
    if t.dtype == torch.bfloat16:
        return mx.array(np_bits(t)).view(mx.bfloat16)
    if t.dtype == torch.uint32:
        return mx.array(np_bits(t))
    raise TypeError(t.dtype)


def from_mx(a) -> torch.Tensor:
    """The same bits as a torch tensor of the same dtype."""
    mx.eval(a)
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(mx_bits(a).view(np.int16).copy()).view(torch.bfloat16)
    if a.dtype == mx.uint32:
        return torch.from_numpy(np.array(a).view(np.int32).copy()).view(torch.uint32)
    return torch.from_numpy(np.array(a).copy())


def mlx_quantize(w: torch.Tensor, *, as_dtype: torch.dtype | None = None):
    """mx.quantize of `w` (in its own dtype unless `as_dtype`), returned as mlx arrays."""
    x = to_mx(w)
    if as_dtype is not None:
        x = x.astype({torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}[as_dtype])
    q, s, b = mx.quantize(x, group_size=64, bits=4, mode="affine", stream=mx.cpu)
    mx.eval(q, s, b)
    return q, s, b


def mlx_reference_bits(w: torch.Tensor):
    """What AF4G64 must produce for `w`: MLX's float32 quantization with scales/biases rounded to BF16."""
    q, s, b = mlx_quantize(w, as_dtype=torch.float32)
    return mx_bits(q), mx_bits(s.astype(mx.bfloat16)), mx_bits(b.astype(mx.bfloat16))


def assert_same_bits(ours: tuple, ref: tuple, labels=("packed", "scales", "biases")) -> None:
    for label, a, b in zip(labels, ours, ref):
        a = np_bits(a) if isinstance(a, torch.Tensor) else a
        assert a.shape == b.shape, (label, a.shape, b.shape)
        diff = int((a != b).sum())
        assert diff == 0, f"{label}: {diff} differing elements of {a.size}; first at {np.argwhere(a != b)[:3].tolist()}"


# ---------------------------------------------------------------------------
# scalar reference, written from the format description (independent of the
# vectorised torch code under test)

def _round_half_even(x: np.float32) -> np.float32:
    return np.float32(np.rint(x))


def _round_half_away(x: np.float32) -> np.float32:
    t = np.trunc(x)
    if abs(x - t) == np.float32(0.5):
        return np.float32(t + np.sign(x))
    return np.float32(np.rint(x))


def scalar_quantize(w: np.ndarray, variant: str = "mlx_cpu"):
    """Per-group loop over a float32 [rows, cols] array -> (codes uint8, scale f32, bias f32)."""
    rnd = _round_half_even if variant == "mlx_cpu" else _round_half_away
    rows, cols = w.shape
    codes = np.zeros((rows, cols), np.uint8)
    scales = np.zeros((rows, cols // 64), np.float32)
    biases = np.zeros((rows, cols // 64), np.float32)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for r in range(rows):
            for g in range(cols // 64):
                grp = w[r, g * 64:(g + 1) * 64].astype(np.float32)
                w_max = np.float32(-np.inf) if variant == "mlx_cpu" else np.float32(0.0)
                w_min = np.float32(np.inf)
                for v in grp:
                    w_max = max(w_max, v)
                    w_min = min(w_min, v)
                mask = abs(w_min) > abs(w_max)
                scale = max(np.float32(w_max - w_min) / np.float32(15), np.float32(1e-7))
                scale = np.float32(scale if mask else -scale)
                edge = w_min if mask else w_max
                q0 = rnd(np.float32(edge / scale))
                bias = np.float32(0)
                if q0 != 0:
                    scale = np.float32(edge / q0)
                    bias = edge
                for j, v in enumerate(grp):
                    q = rnd(np.float32(np.float32(v - bias) / scale))
                    codes[r, g * 64 + j] = int(min(max(q, np.float32(0)), np.float32(15)))
                scales[r, g] = scale
                biases[r, g] = bias
    return codes, scales, biases
