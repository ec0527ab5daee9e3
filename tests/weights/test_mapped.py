"""Mapped (copy-on-write) storage: `load_model`'s CPU default and `stream_into(mmap=True)`.

What is checked with the kernel's own records (``/proc/self/maps``) and file
hashes: mapped tensors really are views of the shard files, writes to them stay
private (the file's bytes do not change), replacing or deleting the files after
loading changes nothing, the mapping goes away with the last tensor, and every
tensor that cannot be mapped (dtype conversion, per-expert pieces, misaligned
offsets, a file that cannot be mapped) is copied with identical values.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from dflash_worker.errors import CheckpointError
from dflash_worker.weights import load_model, stream_into, stream_read

from .test_loader import _reference, assert_identical, assert_tied

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps (Linux)")


def mapping_of(t: torch.Tensor) -> str | None:
    """The file (or pseudo-name) of the mapping holding `t`'s first byte, from /proc/self/maps; None if anonymous."""
    addr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return parts[5].strip() if len(parts) == 6 and parts[5].strip() else None
    raise AssertionError(f"address {addr:#x} is in no mapping")


def mapped_files() -> set[str]:
    with open("/proc/self/maps") as f:
        return {p[5].strip() for p in (line.split(maxsplit=5) for line in f) if len(p) == 6}


def sha256_files(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.glob("*.safetensors"))}


@linux_only
def test_mapped_tensors_are_views_of_the_shards_and_copies_are_not(tiny_target):
    path, _ = tiny_target("qwen3", "float32", True)
    shards = {str(p.resolve()) for p in path.glob("*.safetensors")}
    mapped = load_model(path)
    rep = mapped.load_report
    assert rep.mapped and rep.bytes_mapped == rep.bytes_read
    for name, p in mapped.named_parameters():
        assert mapping_of(p) in shards, name
    copied = load_model(path, mmap=False)
    assert not copied.load_report.mapped and copied.load_report.bytes_mapped == 0
    for name, p in copied.named_parameters():
        assert mapping_of(p) not in shards, name
    assert_identical(mapped, copied)
    assert_tied(mapped)


def test_writes_stay_private_and_the_file_never_changes(tiny_target, tmp_path):
    src, _ = tiny_target("qwen3", "bfloat16", False)
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    before = sha256_files(path)
    a = load_model(path)
    b = load_model(path)
    w = a.model.layers[0].mlp.down_proj.weight
    original = w.detach().clone()
    with torch.no_grad():
        w.add_(1.0)  # copy-on-write: only `a` sees this
        a.lm_head.weight.zero_()
    assert not torch.equal(w, original)
    assert torch.equal(b.model.layers[0].mlp.down_proj.weight, original)
    assert b.lm_head.weight.abs().sum() > 0
    assert sha256_files(path) == before
    # a fresh load reads the untouched file
    assert torch.equal(load_model(path).model.layers[0].mlp.down_proj.weight, original)


def test_replacing_or_deleting_the_files_after_loading_changes_nothing(tiny_target, tmp_path):
    src, _ = tiny_target("qwen3_moe", "float32", False)
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    model = load_model(path)
    assert model.load_report.mapped
    shards = sorted(path.glob("*.safetensors"))
    # replace the first shard atomically with garbage of the same size, delete the others
    tmp = shards[0].with_suffix(".tmp")
    tmp.write_bytes(os.urandom(shards[0].stat().st_size))
    os.replace(tmp, shards[0])
    for s in shards[1:]:
        s.unlink()
    assert_identical(model, _reference(src))


@linux_only
def test_mapping_is_released_with_the_last_tensor(tiny_target, tmp_path):
    src, _ = tiny_target("qwen3", "float32", False)
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    shards = {str(p.resolve()) for p in path.glob("*.safetensors")}
    model = load_model(path)
    assert shards <= mapped_files()
    keep = model.model.norm.weight.detach()  # a tensor outlives the model: its shard stays mapped
    keep_file = mapping_of(keep)
    del model
    gc.collect()
    assert mapped_files() & shards == {keep_file}
    del keep
    gc.collect()
    assert not mapped_files() & shards


def test_what_cannot_be_mapped_is_copied(tiny_target):
    # dtype conversion: nothing mapped
    path, _ = tiny_target("qwen3", "float32", True)
    conv = load_model(path, dtype=torch.bfloat16)
    assert conv.load_report.bytes_mapped == 0
    assert_identical(conv, _reference(path, torch.bfloat16))
    # per-expert MoE tensors fill slices of packed storage: copied; the rest mapped
    moe, _ = tiny_target("qwen3_moe", "float32", False)
    names = json.loads((moe / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(".experts.0.gate_proj.weight" in n for n in names)  # saved per expert
    m = load_model(moe)
    rep = m.load_report
    assert rep.mapped and not any(n.endswith((".gate_up_proj", ".down_proj")) and ".experts" in n for n in rep.mapped)
    assert 0 < rep.bytes_mapped < rep.bytes_read
    assert_identical(m, _reference(moe))


def test_a_file_that_cannot_be_mapped_is_copied(tiny_target, monkeypatch):
    path, _ = tiny_target("qwen3", "bfloat16", True)

    def refuse(*a, **k):
        raise OSError(19, "No such device")  # what mmap says on file systems without it

    monkeypatch.setattr(stream_read._mmap, "mmap", refuse)
    m = load_model(path)
    assert m.load_report.bytes_mapped == 0 and not m.load_report.mapped
    assert_identical(m, _reference(path))
    assert_tied(m)


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4, bias=False)
        self.b = nn.Linear(4, 2, bias=False)


def _raw_safetensors(path: Path, tensors: dict[str, torch.Tensor], pad: int) -> None:
    """Write a valid safetensors file whose header is padded by `pad` spaces (so the data may start misaligned)."""
    header, blobs, off = {}, [], 0
    for k, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[k] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode() + b" " * pad
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


@pytest.mark.parametrize("pad", [0, 1, 2, 3])
def test_misaligned_tensors_are_copied_aligned_ones_mapped(tmp_path, pad):
    g = torch.Generator().manual_seed(pad)
    tensors = {"a.weight": torch.randn(4, 8, generator=g), "b.weight": torch.randn(2, 4, generator=g)}
    f = tmp_path / "m.safetensors"
    _raw_safetensors(f, tensors, pad)
    header_len = struct.unpack("<Q", f.read_bytes()[:8])[0]
    data_start = 8 + header_len
    with torch.device("meta"):
        mod = Pair()
    rep = stream_into(mod, f, mmap=True)
    if data_start % 4 == 0:
        assert sorted(rep.mapped) == ["a.weight", "b.weight"]
    else:
        assert rep.mapped == [] and rep.bytes_mapped == 0
    for k, t in tensors.items():
        assert torch.equal(mod.get_parameter(k), t), k
        assert mod.get_parameter(k).data_ptr() % 4 == 0  # fp32 storage always element-aligned


def test_stream_into_copies_unless_asked_and_ignores_mmap_off_cpu_sources(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(4, 8, generator=g), "b.weight": torch.randn(2, 4, generator=g)}
    f = tmp_path / "m.safetensors"
    _raw_safetensors(f, tensors, 0)
    with torch.device("meta"):
        mod = Pair()
    assert stream_into(mod, f).mapped == []  # stream_into's default: copies
    with torch.device("meta"):
        mod = Pair()
    rep = stream_into(mod, tensors, mmap=True)  # in-memory sources are copied
    assert rep.mapped == [] and torch.equal(mod.a.weight, tensors["a.weight"])


def _truncate_last_shard_around_mapping(tiny_target, tmp_path, monkeypatch, *, before: bool, size) -> tuple[Path, Path]:
    """A copy of a tiny checkpoint whose last shard is truncated to `size(old size)` just before
    (or just after) the loader maps it, i.e. after its header was validated."""
    src, _ = tiny_target("qwen3", "float32", False)
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    real = stream_read._map_items
    victim = sorted(path.glob("*.safetensors"))[-1]

    def truncate_around(fd, p, items):
        hit = Path(p) == victim
        if hit and before:
            os.truncate(victim, size(victim.stat().st_size))
        ok = real(fd, p, items)
        if hit and not before:
            os.truncate(victim, size(victim.stat().st_size))
        return ok

    monkeypatch.setattr(stream_read, "_map_items", truncate_around)
    return path, victim


def test_file_truncated_before_mapping_names_file_and_tensor(tiny_target, tmp_path, monkeypatch):
    path, victim = _truncate_last_shard_around_mapping(tiny_target, tmp_path, monkeypatch, before=True, size=lambda n: n - 4)
    with pytest.raises(CheckpointError, match=rf"`{victim}`, tensor `[^`]+`: file truncated after its header was validated"):
        load_model(path)


@linux_only
def test_file_shrinking_while_pages_are_faulted_in_is_an_error_not_sigbus(tiny_target, tmp_path, monkeypatch):
    """MADV_POPULATE_READ reports EFAULT where a read would raise SIGBUS; the loader turns it into an error."""
    if stream_read._madvise is None or not stream_read._populate_read_ok:
        pytest.skip("madvise(MADV_POPULATE_READ) is not available on this kernel")
    # after the mapping, every tensor of the shard lies past the end of the file
    path, victim = _truncate_last_shard_around_mapping(tiny_target, tmp_path, monkeypatch, before=False, size=lambda n: 8)
    with pytest.raises(CheckpointError, match=rf"`{victim}`, tensor `[^`]+`: the file shrank while it was being loaded"):
        load_model(path)
