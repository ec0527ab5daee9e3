"""Byte parity of `quantize_af4g64` with `mlx.core.quantize` (CPU), the MLX format facts,
and the `apple_gpu` variant against an independent scalar reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from af4g64_oracle import (
    assert_same_bits,
    from_mx,
    mlx_quantize,
    mlx_reference_bits,
    mx,
    mx_bits,
    np_bits,
    scalar_quantize,
    to_mx,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dflash_worker.errors import ConfigError
from dflash_worker.model.quant import (
    dequantize_af4g64,
    pack_af4g64,
    quantize_af4g64,
    unpack_af4g64,
)


def _gen(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _cases() -> dict[str, np.ndarray]:
    rng = _gen(1234)
    c: dict[str, np.ndarray] = {}
    c["normal_1x64"] = rng.standard_normal((1, 64))
    c["normal_7x192"] = rng.standard_normal((7, 192))
    c["normal_64x1024"] = rng.standard_normal((64, 1024)) * 0.02
    c["normal_3x4096"] = rng.standard_normal((3, 4096)) * 3
    c["positive_only"] = np.abs(rng.standard_normal((16, 256))) + 1e-3
    c["negative_only"] = -np.abs(rng.standard_normal((16, 256))) - 1e-3
    c["shifted_positive"] = rng.uniform(5.0, 6.0, (8, 128))
    c["shifted_negative"] = rng.uniform(-6.0, -5.0, (8, 128))
    c["const_zero"] = np.zeros((4, 128))
    c["const_neg_zero"] = -np.zeros((4, 128))
    c["const_tiny"] = np.full((4, 128), 1e-30)
    c["const_subnormal"] = np.full((4, 128), 1e-42)
    c["const_neg_tiny"] = np.full((4, 128), -3e-9)
    c["const_one"] = np.ones((4, 128))
    c["const_huge"] = np.full((4, 128), 3e38)
    c["const_neg_huge"] = np.full((4, 128), -1e30)
    outlier = rng.standard_normal((32, 256)) * 0.01
    outlier[np.arange(32), rng.integers(0, 256, 32)] = 100.0
    outlier[np.arange(32), rng.integers(0, 256, 32)] = -250.0
    c["one_outlier_per_group"] = outlier
    # (w - bias)/scale lands exactly on k + 0.5: rint and round-half-away disagree on even k.
    ties = np.tile(np.concatenate([[0.0, 15.0], np.arange(31) * 0.5, np.arange(31) * 0.5])[:64], (4, 1))
    c["half_integer_ties"] = ties
    c["ties_negative"] = -ties
    c["ties_scaled"] = ties * 0.125
    c["mixed_groups"] = np.concatenate(
        [np.zeros((2, 64)), rng.standard_normal((2, 64)), np.full((2, 64), -7.0), np.abs(rng.standard_normal((2, 64)))], 1
    )
    c["range_overflow"] = np.tile(np.array([3e38, -3e38] * 32), (2, 1))  # w_max - w_min overflows to inf
    c["near_eps"] = rng.standard_normal((4, 128)) * 1e-7
    return {k: v.astype(np.float32) for k, v in c.items()}


CASES = _cases()


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp32_byte_parity_with_mlx(case):
    w = torch.from_numpy(CASES[case])
    assert_same_bits(quantize_af4g64(w), mlx_reference_bits(w))


@pytest.mark.parametrize("case", ["normal_64x1024", "positive_only", "negative_only", "one_outlier_per_group", "half_integer_ties", "const_zero", "const_tiny"])
def test_bf16_input_matches_mlx_bf16_quantize_exactly(case):
    # MLX keeps bf16 scales for a bf16 input: all three outputs are directly comparable.
    w = torch.from_numpy(CASES[case]).to(torch.bfloat16)
    q, s, b = mlx_quantize(w)
    assert s.dtype == mx.bfloat16 and b.dtype == mx.bfloat16
    assert_same_bits(quantize_af4g64(w), (mx_bits(q), mx_bits(s), mx_bits(b)))


@pytest.mark.parametrize("case", ["normal_64x1024", "positive_only", "negative_only", "one_outlier_per_group", "half_integer_ties", "const_zero", "near_eps"])
def test_fp16_input_codes_match_mlx_fp16_quantize(case):
    w = torch.from_numpy(CASES[case]).to(torch.float16)
    ours = quantize_af4g64(w)
    # Codes: MLX computes in float32 for fp16 input too, so its fp16 run gives the same words.
    q16, s16, _ = mlx_quantize(w)
    assert s16.dtype == mx.float16  # MLX would store fp16 scales; AF4G64 stores bf16
    assert_same_bits(ours[:1], (mx_bits(q16),), labels=("packed",))
    # Scales/biases: the float32 values MLX computes, rounded once to bf16.
    assert_same_bits(ours, mlx_reference_bits(w))


def test_output_shapes_dtypes_and_input_untouched():
    w = torch.from_numpy(CASES["normal_7x192"])
    before = w.clone()
    q, s, b = quantize_af4g64(w)
    assert (q.dtype, tuple(q.shape)) == (torch.uint32, (7, 24))
    assert (s.dtype, tuple(s.shape)) == (torch.bfloat16, (7, 3))
    assert (b.dtype, tuple(b.shape)) == (torch.bfloat16, (7, 3))
    assert np.array_equal(np_bits(w), np_bits(before))


def test_non_contiguous_input_quantizes_its_values():
    base = torch.from_numpy(_gen(5).standard_normal((128, 64)).astype(np.float32))
    w = base.t()  # [64, 128], non-contiguous
    assert not w.is_contiguous()
    assert_same_bits(quantize_af4g64(w), mlx_reference_bits(w.contiguous()))


def test_chunked_rows_match_mlx(monkeypatch):
    # Many rows with a small chunk size exercises the row-chunk loop boundaries.
    import dflash_worker.model.quant as quant

    monkeypatch.setattr(quant, "_CHUNK_ELEMS", 3 * 128)
    w = torch.from_numpy(_gen(6).standard_normal((37, 128)).astype(np.float32))
    assert_same_bits(quant.quantize_af4g64(w), mlx_reference_bits(w))


# ---------------------------------------------------------------------------
# fuzzing: arbitrary finite float32 values and raw bit patterns

_shapes = st.tuples(st.integers(1, 3), st.integers(1, 3).map(lambda g: 64 * g))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hnp.arrays(np.float32, _shapes, elements=st.floats(width=32, allow_nan=False, allow_infinity=False)))
def test_fuzz_finite_floats_byte_parity(arr):
    w = torch.from_numpy(arr.copy())
    assert_same_bits(quantize_af4g64(w), mlx_reference_bits(w))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hnp.arrays(np.uint32, _shapes, elements=st.integers(0, 2**32 - 1)))
def test_fuzz_random_bit_patterns_byte_parity(bits):
    arr = bits.view(np.float32).copy()
    arr[~np.isfinite(arr)] = np.float32(0.0)  # exponent 0xFF patterns are not finite
    w = torch.from_numpy(arr)
    assert_same_bits(quantize_af4g64(w), mlx_reference_bits(w))


def test_fuzz_bulk_random_bit_patterns_bf16_and_fp32():
    # Many groups at once (hypothesis keeps its examples small).
    rng = _gen(99)
    arr = rng.integers(0, 2**32, (512, 256), dtype=np.uint64).astype(np.uint32).view(np.float32)
    arr = np.where(np.isfinite(arr), arr, np.float32(1.5))
    w = torch.from_numpy(arr)
    assert_same_bits(quantize_af4g64(w), mlx_reference_bits(w))
    wb = w.to(torch.bfloat16)
    wb[~torch.isfinite(wb)] = 1.5  # float32 values above bf16's max round to inf
    q, s, b = mlx_quantize(wb)
    assert_same_bits(quantize_af4g64(wb), (mx_bits(q), mx_bits(s), mx_bits(b)))


# ---------------------------------------------------------------------------
# format facts, checked against MLX rather than assumed


def test_packing_is_least_significant_nibble_first_per_mlx():
    # One row whose codes are known: 0..15 then 15..0 repeating, with w_min=0, w_max=15.
    codes = np.array(list(range(16)) + list(range(15, -1, -1)) + list(range(16)) + list(range(15, -1, -1)), np.float32)
    w = torch.from_numpy(codes[None, :])
    q, _, _ = mlx_quantize(w)
    words = mx_bits(q)[0]
    # |w_min| <= |w_max|, so the scale is negative (-1) with bias 15: code = 15 - value.
    expected = [sum(int(15 - codes[8 * j + k]) << (4 * k) for k in range(8)) for j in range(8)]
    assert words.tolist() == expected
    assert np_bits(quantize_af4g64(w)[0])[0].tolist() == expected
    assert np_bits(pack_af4g64(torch.from_numpy(15 - codes[None, :].astype(np.int64))))[0].tolist() == expected


def test_pack_unpack_roundtrip_and_errors():
    codes = torch.from_numpy(_gen(3).integers(0, 16, (5, 128)).astype(np.uint8))
    packed = pack_af4g64(codes)
    assert packed.dtype == torch.uint32 and tuple(packed.shape) == (5, 16)
    assert torch.equal(unpack_af4g64(packed), codes)
    with pytest.raises(ConfigError, match="0..15"):
        pack_af4g64(torch.full((1, 8), 16))
    with pytest.raises(ConfigError, match="multiple of 8"):
        pack_af4g64(torch.zeros((1, 12), dtype=torch.int64))
    with pytest.raises(ConfigError, match="integer dtype"):
        pack_af4g64(torch.zeros((1, 8)))
    with pytest.raises(ConfigError, match="uint32"):
        unpack_af4g64(torch.zeros((1, 8), dtype=torch.int32))


def test_scalar_reference_matches_mlx_so_it_can_judge_the_gpu_variant():
    w = np.concatenate([CASES["half_integer_ties"], CASES["negative_only"][:4, :64], CASES["shifted_negative"][:4, :64]])
    codes, scales, biases = scalar_quantize(w, "mlx_cpu")
    ref = mlx_reference_bits(torch.from_numpy(w))
    assert np.array_equal(np_bits(pack_af4g64(torch.from_numpy(codes))), ref[0])
    assert np.array_equal(np_bits(torch.from_numpy(scales).to(torch.bfloat16)), ref[1])
    assert np.array_equal(np_bits(torch.from_numpy(biases).to(torch.bfloat16)), ref[2])


@pytest.mark.parametrize("case", ["half_integer_ties", "ties_negative", "negative_only", "shifted_negative", "normal_7x192", "const_neg_tiny", "one_outlier_per_group"])
def test_apple_gpu_variant_matches_scalar_model_of_metal_kernel(case):
    w = CASES[case]
    codes, scales, biases = scalar_quantize(w, "apple_gpu")
    q, s, b = quantize_af4g64(torch.from_numpy(w), variant="apple_gpu")
    assert torch.equal(unpack_af4g64(q), torch.from_numpy(codes))
    assert np.array_equal(np_bits(s), np_bits(torch.from_numpy(scales).to(torch.bfloat16)))
    assert np.array_equal(np_bits(b), np_bits(torch.from_numpy(biases).to(torch.bfloat16)))


def test_variants_differ_exactly_where_documented():
    ties = torch.from_numpy(CASES["half_integer_ties"])
    # Ties: same scales/biases, codes differ (8.5 -> 8 vs 9).
    cpu, gpu = quantize_af4g64(ties), quantize_af4g64(ties, variant="apple_gpu")
    assert torch.equal(cpu[1].view(torch.int16), gpu[1].view(torch.int16))
    assert not torch.equal(cpu[0], gpu[0])
    # All-negative groups: w_max starts at 0 on the GPU, so the scale changes.
    neg = torch.from_numpy(CASES["shifted_negative"])
    assert not torch.equal(quantize_af4g64(neg)[1].view(torch.int16), quantize_af4g64(neg, variant="apple_gpu")[1].view(torch.int16))
    # Mixed-sign groups without ties agree.
    w = torch.from_numpy(CASES["normal_64x1024"])
    a, b = quantize_af4g64(w), quantize_af4g64(w, variant="apple_gpu")
    assert torch.equal(a[1].view(torch.int16), b[1].view(torch.int16))


@pytest.mark.parametrize(
    "w, match",
    [
        (torch.zeros(64), "2-D"),
        (torch.zeros(2, 2, 64), "2-D"),
        (torch.zeros(4, 96), "multiple of 64"),
        (torch.zeros(4, 0), "multiple of 64"),
        (torch.zeros(4, 64, dtype=torch.float64), "dtype `float64`"),
        (torch.zeros(4, 64, dtype=torch.int32), "dtype `int32`"),
    ],
)
def test_bad_inputs_raise_clear_errors(w, match):
    with pytest.raises(ConfigError, match=match):
        quantize_af4g64(w, name="layers.0.mlp.up_proj.weight")


def test_unknown_variant_is_refused():
    with pytest.raises(ConfigError, match="unknown af4g64 variant `metal`"):
        quantize_af4g64(torch.zeros(1, 64), variant="metal")


# ---------------------------------------------------------------------------
# dequantization


def _random_bf16(rng, shape, lo=-30, hi=30):
    # Finite bf16 values spread over many binades, both signs, some zeros.
    mant = rng.integers(0, 128, shape)
    exp = rng.integers(127 + lo, 127 + hi, shape)
    sign = rng.integers(0, 2, shape)
    bits = (sign << 15) | (exp << 7) | mant
    bits[rng.random(shape) < 0.05] = 0
    return torch.from_numpy(bits.astype(np.uint16).view(np.int16)).view(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_dequantize_matches_mlx_dequantize_bitwise(dtype):
    rng = _gen(42)
    rows, cols = 48, 512
    codes = torch.from_numpy(rng.integers(0, 16, (rows, cols)).astype(np.uint8))
    packed = pack_af4g64(codes)
    scales = _random_bf16(rng, (rows, cols // 64))
    biases = _random_bf16(rng, (rows, cols // 64))
    ours = dequantize_af4g64(packed, scales, biases, dtype)
    mdt = {torch.bfloat16: mx.bfloat16, torch.float32: mx.float32, torch.float16: mx.float16}[dtype]
    ref = mx.dequantize(to_mx(packed), to_mx(scales), to_mx(biases), group_size=64, bits=4, mode="affine", dtype=mdt, stream=mx.cpu)
    assert ours.dtype == dtype
    assert np.array_equal(np_bits(ours), mx_bits(ref))


def test_dequantize_is_not_a_single_fp32_fma():
    # Documents why dequantize rounds twice: a plain fp32 q*s+b disagrees with MLX.
    w = torch.from_numpy(CASES["normal_64x1024"])
    q, s, b = quantize_af4g64(w)
    ref = from_mx(mx.dequantize(to_mx(q), to_mx(s), to_mx(b), group_size=64, bits=4, dtype=mx.float32, stream=mx.cpu))
    naive = unpack_af4g64(q).float().reshape(64, 16, 64) * s.float()[..., None] + b.float()[..., None]
    assert not torch.equal(naive.reshape(64, 1024), ref)
    assert torch.equal(dequantize_af4g64(q, s, b, torch.float32), ref)


def test_dequantize_shape_errors():
    q, s, b = quantize_af4g64(torch.zeros(2, 128))
    with pytest.raises(ConfigError, match="scales and biases of shape"):
        dequantize_af4g64(q, s[:, :1], b)
    with pytest.raises(ConfigError, match="2-D"):
        dequantize_af4g64(q[0], s, b)
