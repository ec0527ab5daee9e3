"""Safetensors header validation: valid files agree with the `safetensors` package, corrupt ones raise
`CheckpointError` naming file and tensor, and never anything else."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_worker.errors import CheckpointError
from dflash_worker.weights import MAX_HEADER_BYTES, list_tensors, read_header, resolve_checkpoint

from .conftest import write_raw


def _entry(dtype="F32", shape=(2,), begin=0, end=8):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def test_valid_file_matches_safetensors(tmp_path):
    tensors = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.ones(4, dtype=torch.bfloat16),
        "c": torch.zeros(0, 5, dtype=torch.int64),
        "d": torch.tensor(True),
        "e": torch.arange(3, dtype=torch.uint8),
    }
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "hi"})
    h = read_header(path)
    assert h.metadata == {"format": "pt", "note": "hi"}
    with safe_open(str(path), "pt") as f:
        assert set(f.keys()) == set(h.tensors)
        for name in f.keys():
            sl = f.get_slice(name)
            assert list(h.tensors[name].shape) == list(sl.get_shape())
            assert h.tensors[name].dtype == sl.get_dtype()
    raw = path.read_bytes()
    for name, t in tensors.items():
        info = h.tensors[name]
        assert raw[info.begin : info.end] == t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    entries = list_tensors(path)
    assert entries["a"] == (path, "F32", (2, 3), 24)
    file, dtype, shape, nbytes = entries["b"]
    assert (dtype, shape, nbytes) == ("BF16", (4,), 8)


BAD_CASES = {
    # name: (header, data, length override, words that must appear in the message)
    "invalid json": ("{not json", b"", None, ["not valid json"]),
    "not an object": ("[1, 2]", b"", None, ["json object"]),
    "invalid utf-8": (b'{"\xff\xfe": 1}', b"", None, ["utf-8"]),
    "duplicate key": ('{"w": ' + json.dumps(_entry()) + ', "w": ' + json.dumps(_entry()) + "}", b"\0" * 8, None, ["duplicate", "`w`"]),
    "unknown dtype": ({"w": _entry(dtype="F4")}, b"\0" * 8, None, ["unknown dtype", "`F4`", "`w`"]),
    "negative shape": ({"w": _entry(shape=(-2,), end=8)}, b"\0" * 8, None, ["negative", "`w`"]),
    "float shape": ({"w": _entry(shape=(2.0,))}, b"\0" * 8, None, ["integers", "`w`"]),
    "bool shape": ({"w": _entry(shape=(True,), end=4)}, b"\0" * 4, None, ["integers", "`w`"]),
    "byte count": ({"w": _entry(shape=(3,), end=8)}, b"\0" * 8, None, ["byte count", "`w`", "`12`"]),
    "offsets out of range": ({"w": _entry(begin=0, end=8)}, b"\0" * 4, None, ["past the end", "`w`"]),
    "begin after end": ({"w": _entry(begin=8, end=0)}, b"\0" * 8, None, ["data_offsets", "`w`"]),
    "overlap": ({"a": _entry(begin=0, end=8), "b": _entry(begin=4, end=12)}, b"\0" * 12, None, ["overlap", "`b`", "`a`"]),
    "hole": ({"a": _entry(begin=0, end=8), "b": _entry(begin=12, end=20)}, b"\0" * 20, None, ["hole", "`b`"]),
    "trailing bytes": ({"a": _entry()}, b"\0" * 12, None, ["trailing", "`a`"]),
    "missing field": ({"w": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, None, ["data_offsets", "`w`"]),
    "unknown field": ({"w": {**_entry(), "extra": 1}}, b"\0" * 8, None, ["unknown field", "`w`"]),
    "entry not object": ({"w": 3}, b"", None, ["object", "`w`"]),
    "metadata not strings": ({"__metadata__": {"k": 1}}, b"", None, ["__metadata__"]),
    "nan constant": ('{"w": NaN}', b"", None, ["json"]),
    "length past eof": ({"w": _entry()}, b"\0" * 8, 10_000, ["past the end of the file"]),
    "length over limit": ({}, b"", MAX_HEADER_BYTES + 1, ["exceeds"]),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_corrupt_headers(tmp_path, case):
    header, data, length, words = BAD_CASES[case]
    path = write_raw(tmp_path / f"{case.replace(' ', '_')}.safetensors", header, data, length=length)
    with pytest.raises(CheckpointError) as info:
        read_header(path)
    msg = str(info.value)
    assert str(path) in msg
    for w in words:
        assert w.lower() in msg.lower(), (w, msg)


def test_truncated_files(tmp_path):
    good = tmp_path / "good.safetensors"
    save_file({"w": torch.ones(16), "v": torch.ones(3)}, str(good))
    raw = good.read_bytes()
    for cut in (0, 5, 8, 20, len(raw) - 1):
        p = tmp_path / f"cut{cut}.safetensors"
        p.write_bytes(raw[:cut])
        with pytest.raises(CheckpointError) as info:
            read_header(p)
        assert str(p) in str(info.value)
    # cut inside the data: the error names the tensor that runs past the end
    p = tmp_path / "cutdata.safetensors"
    p.write_bytes(raw[:-1])
    with pytest.raises(CheckpointError, match="tensor `.*`.*past the end"):
        read_header(p)


def test_empty_and_zero_size(tmp_path):
    h = read_header(write_raw(tmp_path / "empty.safetensors", {}))
    assert h.tensors == {}
    h = read_header(write_raw(tmp_path / "z.safetensors", {"a": _entry(shape=(0,), begin=0, end=0), "b": _entry(shape=(0, 3), begin=0, end=0)}))
    assert set(h.tensors) == {"a", "b"}


def test_missing_and_directory(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        read_header(tmp_path / "nope.safetensors")
    with pytest.raises(CheckpointError, match="directory"):
        read_header(tmp_path)
    with pytest.raises(CheckpointError, match="no `model.safetensors.index.json`"):
        resolve_checkpoint(tmp_path)


def _sharded(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file({"a": torch.ones(2), "b": torch.ones(3)}, str(d / "s1.safetensors"))
    save_file({"c": torch.ones(4)}, str(d / "s2.safetensors"))
    wm = {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}
    return d, wm


def _write_index(d, wm):
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))


def test_index_ok(tmp_path):
    d, wm = _sharded(tmp_path)
    _write_index(d, wm)
    t = list_tensors(d)
    assert {n: (e.file.name, e.shape) for n, e in t.items()} == {
        "a": ("s1.safetensors", (2,)),
        "b": ("s1.safetensors", (3,)),
        "c": ("s2.safetensors", (4,)),
    }


def test_index_missing_shard(tmp_path):
    d, wm = _sharded(tmp_path)
    _write_index(d, {**wm, "z": "s3.safetensors"})
    with pytest.raises(CheckpointError) as info:
        list_tensors(d)
    msg = str(info.value)
    assert "model.safetensors.index.json" in msg and "s3.safetensors" in msg and "`z`" in msg


def test_index_lists_absent_tensor(tmp_path):
    d, wm = _sharded(tmp_path)
    _write_index(d, {**wm, "z": "s2.safetensors"})
    with pytest.raises(CheckpointError, match=r"lists tensor `z` in shard .*s2.safetensors.* does not contain it"):
        list_tensors(d)


def test_shard_has_unlisted_tensor(tmp_path):
    d, wm = _sharded(tmp_path)
    del wm["b"]
    _write_index(d, wm)
    with pytest.raises(CheckpointError, match=r"s1.safetensors.*tensor `b` is not listed"):
        list_tensors(d)


def test_index_hostile(tmp_path):
    d, wm = _sharded(tmp_path)
    _write_index(d, {**wm, "a": "../escape.safetensors"})
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        list_tensors(d)
    (d / "model.safetensors.index.json").write_text('{"weight_map": {"a": "s1.safetensors", "a": "s1.safetensors"}}')
    with pytest.raises(CheckpointError, match="duplicate key `a`"):
        list_tensors(d)
    (d / "model.safetensors.index.json").write_text('{"weight_map": 3}')
    with pytest.raises(CheckpointError, match="weight_map"):
        list_tensors(d)
    (d / "model.safetensors.index.json").write_bytes(b"\xff{")
    with pytest.raises(CheckpointError, match="UTF-8"):
        list_tensors(d)


def test_no_index_duplicate_across_files(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    save_file({"a": torch.ones(2)}, str(d / "x.safetensors"))
    save_file({"a": torch.ones(2)}, str(d / "y.safetensors"))
    with pytest.raises(CheckpointError, match="tensor `a` also appears"):
        list_tensors(d)


def test_length_prefix_is_little_endian(tmp_path):
    raw = json.dumps({"w": _entry()}).encode()
    p = tmp_path / "be.safetensors"
    p.write_bytes(struct.pack(">Q", len(raw)) + raw + b"\0" * 8)
    with pytest.raises(CheckpointError):
        read_header(p)
