"""The one safetensors writer (`weights.write`): round-trips through `safetensors` and our reader,
fixes header order, metadata order and padding to the byte, and refuses what it cannot write
naming the tensor, leaving no partial file."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from dflash_worker.errors import CheckpointError
from dflash_worker.weights import read_header
from dflash_worker.weights.dtypes import SAFETENSORS_DTYPES, TORCH_DTYPES
from dflash_worker.weights.header import DTYPE_SIZES
from dflash_worker.weights.write import SAFETENSORS_ORDER, RawTensor, safetensors_order, write_safetensors


def _raw_header(path) -> bytes:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return data[8 : 8 + n]


def _bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def test_exact_bytes_of_a_small_file(tmp_path):
    """The format pinned to the byte: metadata first, tensors in the given order, compact JSON, spaces to 8."""
    path = tmp_path / "a.safetensors"
    w = write_safetensors(path, {"x": torch.tensor([1, 2], dtype=torch.int32), "m": torch.tensor([7], dtype=torch.uint8)},
                          {"format": "pt"})
    header = b'{"__metadata__":{"format":"pt"},"x":{"dtype":"I32","shape":[2],"data_offsets":[0,8]},' \
             b'"m":{"dtype":"U8","shape":[1],"data_offsets":[8,9]}}'
    header += b" " * (-len(header) % 8)
    want = struct.pack("<Q", len(header)) + header + struct.pack("<ii", 1, 2) + b"\x07"
    assert path.read_bytes() == want
    assert w.sha256 == hashlib.sha256(want).hexdigest() and w.bytes == len(want)


def test_round_trip_every_dtype_through_safetensors_and_our_reader(tmp_path):
    tensors = {f"t.{name}": _sample(dt, (3, 2), i) for i, (name, dt) in enumerate(TORCH_DTYPES.items())}
    tensors |= {"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4, dtype=torch.bfloat16)}
    meta = {"zeta": "1", "alpha": "two"}  # written in this order, not sorted
    path = tmp_path / "all.safetensors"
    w = write_safetensors(path, tensors, meta)
    assert w.bytes == path.stat().st_size and w.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    h = read_header(path)
    assert list(h.tensors) == list(tensors) and h.metadata == meta
    assert h.data_start % 8 == 0
    assert list(json.loads(_raw_header(path))["__metadata__"]) == ["zeta", "alpha"]
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == meta
        for name, t in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and got.shape == t.shape
            assert _bytes(got) == _bytes(t), name


def test_tensors_ordered_largest_element_first_are_aligned(tmp_path):
    """Nothing is inserted between tensors: alignment comes from the order the caller gives (capture's)."""
    path = tmp_path / "a.safetensors"
    write_safetensors(path, {"i64": torch.arange(3), "f32": torch.ones(5), "bf16": torch.ones(3, dtype=torch.bfloat16),
                             "u8": torch.ones(3, dtype=torch.uint8)})
    h = read_header(path)
    for info in h.tensors.values():
        assert info.begin % (TORCH_DTYPES[info.dtype].itemsize) == 0, info.name
    assert b"__metadata__" not in _raw_header(path)  # no metadata given, none written


def test_list_is_stored_as_the_concatenation_on_the_first_dim(tmp_path):
    parts = [_sample(torch.bfloat16, (n, 6), n) for n in (3, 1, 7)]
    path = tmp_path / "f.safetensors"
    write_safetensors(path, {"features": parts})
    with safe_open(str(path), framework="pt") as f:
        assert torch.equal(f.get_tensor("features"), torch.cat(parts))


def test_raw_tensor_parts_are_read_once_while_writing(tmp_path):
    seen = []

    def parts():
        seen.append("start")
        yield b"\x01\x00"
        yield memoryview(b"\x02\x00\x03\x00")

    path = tmp_path / "r.safetensors"
    write_safetensors(path, {"r": RawTensor("I16", (3,), parts())})
    assert seen == ["start"]
    with safe_open(str(path), framework="pt") as f:
        assert f.get_tensor("r").tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (torch.arange(12, dtype=torch.float32).reshape(3, 4).t(), r"tensor `bad`: is not contiguous.*\nhint: pass `t.contiguous\(\)`"),
        (torch.zeros(2, dtype=torch.complex64), r"tensor `bad`: dtype `torch.complex64` has no safetensors name\nhint: supported"),
        (torch.zeros(2, device="meta"), r"tensor `bad`: is on `meta`, not the CPU"),
        ([1.0, 2.0], r"tensor `bad`: expected a torch.Tensor, a list of them or a `RawTensor`, found `float`"),
        ([torch.zeros(2, 3), torch.zeros(2, 4)], r"tensor `bad`: parts do not concatenate on the first dim"),
        ([torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float16)], r"tensor `bad`: parts do not concatenate"),
        ([], r"tensor `bad`: is an empty list of tensors"),
        (RawTensor("Q4", (2,), [b"xx"]), r"tensor `bad`: unknown dtype `Q4`"),
        (RawTensor("U8", (-1,), [b""]), r"tensor `bad`: shape must be non-negative integers"),
        (RawTensor("U8", (3,), [b"ab"]), r"tensor `bad`: its parts hold `2` bytes, shape `\[3\]` x `U8` needs `3`"),
        (RawTensor("U8", (1,), [b"a", b"b"]), r"tensor `bad`: its parts hold more than `1` bytes"),
    ],
)
def test_refused_input_names_the_tensor_and_leaves_the_old_file(tmp_path, value, match):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"old")
    with pytest.raises(CheckpointError, match=match):
        write_safetensors(path, {"good": torch.ones(2), "bad": value})
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]  # no temporary left


@pytest.mark.parametrize(("name", "meta"), [("", None), ("__metadata__", None), ("t", {"k": 1}), ("t", {2: "v"})])
def test_invalid_names_and_metadata_are_refused(tmp_path, name, meta):
    with pytest.raises(CheckpointError, match=r"invalid tensor name|metadata"):
        write_safetensors(tmp_path / "x.safetensors", {name: torch.ones(1)}, meta)
    assert not list(tmp_path.iterdir())


def test_a_failure_while_writing_removes_the_temporary(tmp_path):
    def parts():
        yield b"\x00" * 4
        raise OSError("injected disk failure")

    path = tmp_path / "x.safetensors"
    with pytest.raises(OSError, match="injected"):
        write_safetensors(path, {"a": torch.ones(2), "b": RawTensor("F32", (2,), parts())})
    assert not list(tmp_path.iterdir())


_DTYPES = st.sampled_from(sorted(SAFETENSORS_DTYPES, key=str))
_SHAPES = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.text("abc._", min_size=1, max_size=12).filter(lambda s: s != "__metadata__"),
                       st.tuples(_DTYPES, _SHAPES), min_size=1, max_size=6),
       st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3))
def test_any_tensors_round_trip_and_validate(tmp_path, spec, meta):
    tensors = {name: _sample(dt, shape, i) for i, (name, (dt, shape)) in enumerate(spec.items())}
    path = tmp_path / "p.safetensors"
    write_safetensors(path, tensors, meta)
    h = read_header(path)  # the project's reader accepts it: offsets tile the data exactly
    assert list(h.tensors) == list(tensors) and h.metadata == meta and h.data_start % 8 == 0
    for name, t in tensors.items():
        raw = path.read_bytes()[h.tensors[name].begin : h.tensors[name].end]
        assert raw == _bytes(t), name


def test_safetensors_order_names_every_dtype_once_largest_element_first():
    assert sorted(SAFETENSORS_ORDER) == sorted(DTYPE_SIZES)
    sizes = [DTYPE_SIZES[d] for d in SAFETENSORS_ORDER]
    assert sizes == sorted(sizes, reverse=True)


def test_safetensors_order_sorts_by_dtype_then_name_for_every_kind_of_value():
    tensors = {"b": torch.ones(1, dtype=torch.uint8), "raw": RawTensor("I64", (1,), [b"\0" * 8]),
               "a": torch.ones(1, dtype=torch.uint8), "list": [torch.ones(1), torch.ones(2)],
               "flag": torch.ones(1, dtype=torch.bool), "odd": torch.zeros(1, dtype=torch.complex64)}
    assert list(safetensors_order(tensors)) == ["raw", "list", "a", "b", "flag", "odd"]  # unknown dtype last


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.text("abcAB._9", min_size=1, max_size=10).filter(lambda s: s != "__metadata__"),
                       st.tuples(_DTYPES, _SHAPES), min_size=1, max_size=8),
       st.dictionaries(st.text("ab", min_size=1, max_size=4), st.text(st.characters(max_codepoint=0x7E), max_size=6),
                       max_size=1))
def test_safetensors_order_gives_the_bytes_of_safetensors_save_file(tmp_path, spec, meta):
    """The AF4G64 export relies on this to keep the bytes `save_file` wrote (at most one metadata key:
    `save_file` orders several from a hash map; ASCII below DEL: our JSON escapes the rest, serde writes UTF-8)."""
    from safetensors.torch import save_file

    tensors = {name: _sample(dt, shape, i) for i, (name, (dt, shape)) in enumerate(spec.items())}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    write_safetensors(ours, safetensors_order(tensors), meta or None)
    save_file(tensors, str(theirs), metadata=meta or None)
    assert ours.read_bytes() == theirs.read_bytes()
    h = read_header(ours)
    assert all(info.begin % DTYPE_SIZES[info.dtype] == 0 for info in h.tensors.values())
