"""Stream checkpoint tensors straight into a module built on the meta device.

`stream_into` fills every parameter and persistent buffer of a module from a
checkpoint directory, a single ``.safetensors`` file, or a caller's in-memory
``Mapping[str, Tensor]``:

1. Plan (no tensor bytes read): map every checkpoint name (after `key_mapping`)
   to a destination; check shapes and dtype kinds; list missing and unexpected
   keys. Any problem raises `CheckpointError` before anything is read.
2. Allocate each destination once, in its final dtype on its final device
   (except the mapped ones, below).
3. Read shard by shard, one open file at a time, tensors in file order, with
   ``preadv`` directly into the destination's bytes, in chunks of at most
   `CHUNK_BYTES` spread over up to `MAX_THREADS` threads. Only when the dtype
   differs or the device is not the CPU does a chunk pass through a staging
   buffer: one per thread, reused, at most one chunk (64 MiB) in size. On
   Linux each direct chunk's pages are prefaulted with one `madvise` call
   before the read (see `_prefault`).

   With ``mmap=True`` (what `load_model` does for CPU targets), a tensor whose
   checkpoint bytes already are its final storage (CPU, same dtype, offset
   aligned to the element size, stored whole) is not copied at all: the shard
   is mapped copy-on-write (``MAP_PRIVATE``) and the tensor is a view of the
   page cache, whose pages are faulted in by the load threads
   (``MADV_POPULATE_READ``). Nothing is allocated for it, processes that load
   the same checkpoint share its pages, and a write to the tensor copies only
   the page written, privately: the file never changes. The cost is the usual
   one of mapped files: the checkpoint must not be rewritten in place (a
   truncating writer makes later reads of unwritten pages fail with SIGBUS);
   replacing or deleting it is safe, the mapping keeps the old inode.
   Everything else takes the copy path above.
4. Swap the new tensors into the module. Tied parameters (one tensor under two
   names, e.g. ``lm_head.weight`` and ``model.embed_tokens.weight``) get one
   storage shared by every name.
5. Recompute non-persistent buffers (rotary ``inv_freq``) that were built on
   the meta device: they are not in checkpoints.

Packed MoE experts: transformers 5 stores Qwen3-MoE experts as packed
parameters ``mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows first, then up)
and ``mlp.experts.down_proj [E, H, I]``. A checkpoint may hold them packed or as
per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``; each per-expert
tensor is read straight into its (contiguous) slice of the packed storage.
Such a checkpoint has thousands of small tensors, so consecutive reads go to
the pool in batches of up to one chunk's bytes, each batch backing its
destination rows with one `madvise` per run of adjacent rows (an expert's gate
and up rows, the next expert's) before reading; every file's batches are
queued before the first is waited for.

The caller's mapping is only read, never mutated; a checkpoint is never
assembled into a whole state dict.
"""

from __future__ import annotations

import ctypes
import errno
import mmap as _mmap
import os
import re
import sys
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError
from .checkpoint import Checkpoint, resolve_checkpoint

if sys.byteorder != "little":  # safetensors data is little-endian; we read bytes verbatim
    raise ImportError("dflash_worker.weights needs a little-endian host")

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
}
SAFETENSORS_DTYPES = {v: k for k, v in TORCH_DTYPES.items()}

Source = str | os.PathLike | Mapping[str, torch.Tensor]
KeyMapping = Mapping[str, str] | Callable[[str], str] | None
SkipFn = Callable[[str], bool] | None
ProgressFn = Callable[[int, int], None]

_EXPERT_KEY = re.compile(r"^(?P<prefix>.+)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


@dataclass
class LoadReport:
    """What `stream_into` did. Names are module names (after `key_mapping`)."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    tied: list[str] = field(default_factory=list)  # checkpoint copies of tied names, skipped
    mapped: list[str] = field(default_factory=list)  # loaded as copy-on-write views of the file, not copied
    bytes_read: int = 0  # tensor bytes taken from files (read or mapped)
    bytes_mapped: int = 0  # of which mapped
    files: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # checkpoint names `skip` left out, never read
    bytes_skipped: int = 0  # their tensor bytes


# --------------------------------------------------------------------------- targets


@dataclass
class _Slot:
    """One destination storage (a parameter or persistent buffer, possibly under several names)."""

    name: str  # canonical (first) name
    aliases: list[str]
    owners: list[tuple[nn.Module, str, bool]]  # (module, attribute, is_parameter)
    shape: tuple[int, ...]
    dtype: torch.dtype  # final dtype
    requires_grad: bool
    old: torch.Tensor
    new: torch.Tensor | None = None


def _collect_slots(module: nn.Module, dtype: torch.dtype | None) -> tuple[dict[str, _Slot], dict[str, _Slot]]:
    """Return (slots by canonical name, slots by any name)."""
    by_id: dict[int, _Slot] = {}
    by_name: dict[str, _Slot] = {}
    order: list[_Slot] = []

    def add(name: str, mod: nn.Module, attr: str, tensor: torch.Tensor, is_param: bool) -> None:
        slot = by_id.get(id(tensor))
        if slot is None:
            final = tensor.dtype
            if dtype is not None and tensor.is_floating_point():
                final = dtype
            slot = _Slot(
                name=name,
                aliases=[],
                owners=[],
                shape=tuple(tensor.shape),
                dtype=final,
                requires_grad=bool(getattr(tensor, "requires_grad", False)),
                old=tensor,
            )
            by_id[id(tensor)] = slot
            order.append(slot)
        else:
            slot.aliases.append(name)
        slot.owners.append((mod, attr, is_param))
        by_name[name] = slot

    for mod_name, mod in module.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for attr, p in mod._parameters.items():
            if p is not None:
                add(prefix + attr, mod, attr, p, True)
        for attr, b in mod._buffers.items():
            if b is not None and attr not in mod._non_persistent_buffers_set:
                add(prefix + attr, mod, attr, b, False)
    return {s.name: s for s in order}, by_name


def _packed_expert_slots(by_name: dict[str, _Slot]) -> dict[tuple[str, str], tuple[_Slot, int, int]]:
    """(experts prefix, proj) -> (packed slot, row start, row end) for per-expert checkpoint keys."""
    out: dict[tuple[str, str], tuple[_Slot, int, int]] = {}
    for name, slot in by_name.items():
        if name.endswith(".gate_up_proj") and len(slot.shape) == 3 and slot.shape[1] % 2 == 0:
            prefix = name[: -len(".gate_up_proj")]
            down = by_name.get(prefix + ".down_proj")
            if down is None or len(down.shape) != 3 or down.shape[0] != slot.shape[0]:
                continue
            inter = slot.shape[1] // 2
            out[(prefix, "gate_proj")] = (slot, 0, inter)
            out[(prefix, "up_proj")] = (slot, inter, 2 * inter)
            out[(prefix, "down_proj")] = (down, 0, down.shape[1])
    return out


# --------------------------------------------------------------------------- plan


@dataclass
class _Item:
    """Read one source tensor into `slot` (whole, or expert `expert` rows [r0, r1))."""

    key: str  # checkpoint name (before mapping)
    slot: _Slot
    expert: int | None
    r0: int
    r1: int
    part: str
    src_dtype: torch.dtype
    nbytes: int = 0
    # file sources
    file: Path | None = None
    begin: int = 0


def _map_key(key_mapping: KeyMapping, key: str) -> str:
    if key_mapping is None:
        return key
    if callable(key_mapping):
        mapped = key_mapping(key)
        return key if mapped is None else mapped
    return key_mapping.get(key, key)


def _kind(dt: torch.dtype) -> str:
    if dt == torch.bool:
        return "bool"
    if dt.is_floating_point:
        return "float"
    if dt.is_complex:
        return "complex"
    return "int"


def _plan(
    slots: dict[str, _Slot],
    by_name: dict[str, _Slot],
    entries: list[tuple[str, str, torch.dtype, tuple[int, ...], int]],
    key_mapping: KeyMapping,
    report: LoadReport,
) -> list[_Item]:
    """entries: (checkpoint key, where (file or "<mapping>"), dtype, shape, nbytes), in read order."""
    packed = _packed_expert_slots(by_name)
    present_names = {_map_key(key_mapping, e[0]) for e in entries}
    items: list[_Item] = []
    claimed: dict[tuple[int, int | None, str], str] = {}
    claimed_by_slot: dict[int, tuple[str, bool]] = {}  # slot -> (first key, was whole)
    for key, where, src_dtype, shape, nbytes in entries:
        name = _map_key(key_mapping, key)
        slot = by_name.get(name)
        expert: int | None = None
        part = "whole"
        r0 = r1 = 0
        expected_shape: tuple[int, ...]
        if slot is not None:
            if name != slot.name and slot.name in present_names:
                # a checkpoint copy of a tied alias: the canonical tensor wins
                report.tied.append(name)
                continue
            expected_shape = slot.shape
        else:
            m = _EXPERT_KEY.match(name)
            hit = packed.get((m["prefix"], m["proj"])) if m else None
            if hit is None or int(m["expert"]) >= hit[0].shape[0]:
                report.unexpected.append(name)
                continue
            slot, r0, r1 = hit
            expert = int(m["expert"])
            part = m["proj"]
            expected_shape = (r1 - r0, *slot.shape[2:])
        if tuple(shape) != expected_shape:
            raise CheckpointError(
                f"`{where}`, tensor `{key}`: shape mismatch: the model expects `{list(expected_shape)}` "
                f"for `{slot.name if expert is None else name}`, the checkpoint has `{list(shape)}`"
            )
        if _kind(src_dtype) != _kind(slot.dtype):
            raise CheckpointError(
                f"`{where}`, tensor `{key}`: dtype mismatch: the model expects `{slot.dtype}` "
                f"for `{slot.name}`, the checkpoint has `{src_dtype}`"
                + ("\nhint: quantized checkpoints cannot be loaded as training inputs" if _kind(src_dtype) == "int" else "")
            )
        # Each destination is filled once: whole, or by distinct per-expert pieces.
        claim = (id(slot), expert, part)
        first = claimed_by_slot.get(id(slot))
        if claim in claimed or (first is not None and (expert is None or first[1])):
            other = claimed.get(claim) or first[0]  # type: ignore[index]
            raise CheckpointError(
                f"`{where}`, tensor `{key}`: fills `{slot.name}` which `{other}` already fills"
                "\nhint: check `key_mapping` and packed vs per-expert tensors"
            )
        claimed[claim] = key
        claimed_by_slot.setdefault(id(slot), (key, expert is None))
        items.append(_Item(key=key, slot=slot, expert=expert, r0=r0, r1=r1, part=part, src_dtype=src_dtype, nbytes=nbytes))

    # missing: slots with no whole tensor and incomplete pieces
    covered_whole = {id(it.slot) for it in items if it.expert is None}
    pieces: dict[int, set[tuple[int, str]]] = {}
    for it in items:
        if it.expert is not None:
            pieces.setdefault(id(it.slot), set()).add((it.expert, it.part))
    for slot in slots.values():
        if id(slot) in covered_whole:
            continue
        have = pieces.get(id(slot))
        if have is None:
            report.missing.append(slot.name)
            continue
        prefix = slot.name.rsplit(".", 1)[0]
        parts = ("gate_proj", "up_proj") if slot.name.endswith(".gate_up_proj") else ("down_proj",)
        for e in range(slot.shape[0]):
            for p in parts:
                if (e, p) not in have:
                    report.missing.append(f"{prefix}.{e}.{p}.weight")
    return items


def _list(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# --------------------------------------------------------------------------- reading


# Reads are split into chunks of at most this many bytes, spread over a few
# threads (preadv and copy_ release the GIL), so page faults, the kernel copy
# and dtype conversion overlap on multi-core machines.
CHUNK_BYTES = 64 * 1024 * 1024
MAX_THREADS = 4


def _threads() -> int:
    return max(1, min(MAX_THREADS, os.cpu_count() or 1))


class _Staging(threading.local):
    """Per-thread CPU buffer (at most `CHUNK_BYTES`) for chunks that need a dtype conversion or a device copy."""

    def __init__(self, pin: bool = False):
        # threading.local re-runs __init__ with these arguments in every thread
        self.pin = pin
        self.buf: torch.Tensor | None = None

    def get(self, nbytes: int) -> torch.Tensor:
        buf = self.buf
        if buf is None or buf.numel() < nbytes:
            self.buf = None  # free the old one first
            self.buf = buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        return buf[:nbytes]


def _byte_view(t: torch.Tensor):
    """A writable numpy uint8 view of a contiguous CPU tensor's bytes."""
    flat = t.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy()


def _pread_into(fd: int, offset: int, view: memoryview, path: Path, key: str) -> None:
    pos, n_total = 0, len(view)
    while pos < n_total:
        if _HAS_PREADV:
            n = os.preadv(fd, [view[pos:]], offset + pos)
        else:  # pragma: no cover - platforms without preadv: one extra copy
            data = os.pread(fd, n_total - pos, offset + pos)
            n = len(data)
            view[pos : pos + n] = data
        if not n:
            raise CheckpointError(
                f"`{path}`, tensor `{key}`: file truncated while reading (got `{pos}` of `{n_total}` bytes)"
                "\nhint: the file changed after its header was validated; re-download it"
            )
        pos += n


_HAS_PREADV = hasattr(os, "preadv")

# Prefaulting. A fresh destination is unbacked memory: a plain read faults it in
# one 4 KiB page at a time, about half of the read's CPU time on a 1 GiB
# checkpoint. `madvise(MADV_POPULATE_WRITE)` (Linux 5.14+) backs a whole range
# in one call first, which measured ~15% less CPU for the whole read. It only
# touches whole pages inside the destination tensor and writes nothing; where
# it is unavailable or fails, reads fall back to ordinary page faults.
_MADV_POPULATE_WRITE = 23
_PAGE = _mmap.PAGESIZE
_PREFAULT_MIN_BYTES = 256 * 1024  # below this, one syscall saves nothing


def _load_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover - libc without madvise
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()


def _prefault(addr: int, nbytes: int) -> None:
    """Back the whole pages inside ``[addr, addr + nbytes)`` before a read writes them (best effort)."""
    global _madvise
    if _madvise is None or nbytes < _PREFAULT_MIN_BYTES:
        return
    lo = -(-addr // _PAGE) * _PAGE
    hi = (addr + nbytes) // _PAGE * _PAGE
    if hi > lo and _madvise(lo, hi - lo, _MADV_POPULATE_WRITE) != 0:
        _madvise = None  # older kernel (EINVAL) or refused: plain page faults from now on


# Mapped tensors: their pages are faulted in by the load threads, chunk by
# chunk, with `madvise(MADV_POPULATE_READ)` (Linux 5.14+): read-only mappings
# of the page cache, so nothing is copied; on a cold cache this reads the file
# in parallel. Elsewhere pages fault in on first use.
_MADV_POPULATE_READ = 22
_populate_read_ok = True


def _mappable(item: _Item) -> bool:
    """Can `item`'s checkpoint bytes be its final CPU storage as they are?"""
    return (
        item.expert is None
        and item.nbytes > 0
        and item.src_dtype == item.slot.dtype
        and item.begin % item.slot.dtype.itemsize == 0
    )


def _populate_read(addr: int, nbytes: int, path: Path | None, key: str) -> None:
    """Map the page-cache pages under ``[addr, addr + nbytes)`` of a file mapping now (best effort)."""
    global _populate_read_ok
    if _madvise is None or not _populate_read_ok:
        return
    lo = addr // _PAGE * _PAGE
    hi = -(-(addr + nbytes) // _PAGE) * _PAGE
    if _madvise(lo, hi - lo, _MADV_POPULATE_READ) != 0:
        err = ctypes.get_errno()
        if err == errno.EFAULT:  # a read would raise SIGBUS: the file shrank after it was mapped
            raise CheckpointError(
                f"`{path}`, tensor `{key}`: the file shrank while it was being loaded"
                "\nhint: do not rewrite a checkpoint in place while it is loaded; re-download it"
            )
        if err != errno.EINTR:
            _populate_read_ok = False  # older kernel (EINVAL): pages fault in on first use


def _map_items(fd: int, path: Path, items: list[_Item]) -> bool:
    """Make each of `items` a copy-on-write view of its bytes in the file; False if the file cannot be mapped."""
    try:
        mm = _mmap.mmap(fd, 0, access=_mmap.ACCESS_COPY)
    except (OSError, ValueError):  # e.g. a file system without mmap: copy instead
        return False
    size = len(mm)
    for it in items:
        if it.begin + it.nbytes > size:
            raise CheckpointError(
                f"`{path}`, tensor `{it.key}`: file truncated after its header was validated "
                f"(`{size}` bytes, the tensor ends at byte `{it.begin + it.nbytes}`)"
                "\nhint: the file changed while it was being loaded; re-download it"
            )
    for it in items:
        slot = it.slot
        flat = torch.frombuffer(mm, dtype=slot.dtype, count=it.nbytes // slot.dtype.itemsize, offset=it.begin)
        slot.new = flat.view(slot.shape)  # each tensor keeps `mm` alive; it is unmapped with the last one
    return True


def _dest(item: _Item) -> torch.Tensor:
    t = item.slot.new
    assert t is not None
    if item.expert is None:
        return t
    return t[item.expert, item.r0 : item.r1]


@dataclass
class _Unit:
    """One piece of work on an open fd: `fn(fd)` fills `nbytes` of `item`'s destination.

    `prefault`: the destination's address range ``(addr, nbytes)`` for a read
    straight into fresh memory, backed in one call by the batch that runs it.
    """

    item: _Item
    nbytes: int
    fn: Callable[[int], None]
    prefault: tuple[int, int] | None = None


class _Views(dict):
    """Per slot: a writable byte view of its (contiguous CPU) destination and its address, made once."""

    def of(self, slot: _Slot) -> tuple[memoryview, int]:
        got = self.get(id(slot))
        if got is None:
            t = slot.new
            assert t is not None
            got = self[id(slot)] = (memoryview(_byte_view(t)), t.data_ptr())
        return got


def _item_offset(item: _Item) -> int:
    """Byte offset of `item`'s destination inside its slot (rows [r0, r1) of expert `expert`, or 0)."""
    if item.expert is None:
        return 0
    shape = item.slot.shape
    row = item.slot.dtype.itemsize
    for d in shape[2:]:
        row *= d
    return (item.expert * shape[1] + item.r0) * row


def _chunks(item: _Item, device: torch.device, staging: _Staging, views: _Views) -> list[_Unit]:
    """Work units that together fill `item`'s destination."""
    if item.nbytes == 0:
        return []
    slot = item.slot
    src_es = item.src_dtype.itemsize
    step = max(src_es, CHUNK_BYTES - CHUNK_BYTES % src_es)  # whole elements per chunk
    # Straight into the destination: CPU, same dtype; a slot is contiguous (allocated here), and so
    # is one expert's rows of it.
    direct = device.type == "cpu" and item.src_dtype == slot.dtype and slot.new.is_contiguous()  # type: ignore[union-attr]
    if direct:
        whole, base = views.of(slot)
        off = _item_offset(item)
        view = whole[off : off + item.nbytes]
        addr = base + off

        def direct_read(fd: int, a: int) -> None:
            n = min(step, item.nbytes - a)
            _pread_into(fd, item.begin + a, view[a : a + n], item.file, item.key)

        return [
            _Unit(item, min(step, item.nbytes - a), lambda fd, a=a: direct_read(fd, a), (addr + a, min(step, item.nbytes - a)))
            for a in range(0, item.nbytes, step)
        ]
    dst = _dest(item)
    flat = dst.view(-1)

    def convert(fd: int, a: int) -> None:
        n = min(step, item.nbytes - a)
        tmp = staging.get(n)
        _pread_into(fd, item.begin + a, memoryview(tmp.numpy()), item.file, item.key)
        with torch.no_grad():
            flat[a // src_es : (a + n) // src_es].copy_(tmp.view(item.src_dtype))

    return [_Unit(item, min(step, item.nbytes - a), lambda fd, a=a: convert(fd, a)) for a in range(0, item.nbytes, step)]


def _mapped_chunks(item: _Item) -> list[_Unit]:
    """Work units that fault in the pages of a mapped `item`."""
    addr = item.slot.new.data_ptr()  # type: ignore[union-attr]

    def populate(fd: int, a: int) -> None:
        _populate_read(addr + a, min(CHUNK_BYTES, item.nbytes - a), item.file, item.key)

    return [
        _Unit(item, min(CHUNK_BYTES, item.nbytes - a), lambda fd, a=a: populate(fd, a))
        for a in range(0, item.nbytes, CHUNK_BYTES)
    ]


def _batches(units: list[_Unit], limit: int = CHUNK_BYTES) -> list[list[_Unit]]:
    """Consecutive units grouped up to `limit` bytes a group (a larger unit stays alone).

    A MoE checkpoint stored per expert has thousands of small tensors; one
    pool task each spent more time in task hand-off than in reading.
    """
    out: list[list[_Unit]] = []
    cur: list[_Unit] = []
    size = 0
    for u in units:
        if cur and size + u.nbytes > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append(u)
        size += u.nbytes
    if cur:
        out.append(cur)
    return out


def _prefault_ranges(ranges: list[tuple[int, int]]) -> None:
    """Back the destination ranges of a batch, adjacent ranges merged (per-expert rows are adjacent)."""
    lo = hi = -1
    for a, n in sorted(ranges):
        if a == hi:
            hi = a + n
            continue
        if hi > lo:
            _prefault(lo, hi - lo)
        lo, hi = a, a + n
    if hi > lo:
        _prefault(lo, hi - lo)


def _run_batch(batch: list[_Unit], fd: int) -> None:
    # in the worker thread, so backing one batch's memory overlaps other batches' reads
    _prefault_ranges([u.prefault for u in batch if u.prefault is not None])
    for u in batch:
        _run_chunk(u.fn, fd, u.item)


def _read_files(
    by_file: dict[Path, list[_Item]], device: torch.device, staging: _Staging, pool, on_done, to_map: set[int]
) -> None:
    """Fill every item from its file: one open fd a file, batches of chunks in file order over the pool.

    Every file's batches are queued before the first is waited for, so the
    next file's planning overlaps the current reads; `on_done` still runs file
    by file, in order. Items whose slot is in `to_map` become views of the
    mapped file (if it can be mapped); their destinations are allocated here
    otherwise.
    """
    views = _Views()
    fds: list[int] = []
    queued: list[tuple[list[_Item], set[int], list]] = []
    try:
        for path, items in by_file.items():
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            except OSError as exc:
                raise CheckpointError(f"`{path}`: cannot open: {exc.strerror or exc}") from None
            fds.append(fd)
            mapped_here = to_map
            candidates = [it for it in items if id(it.slot) in to_map]
            if candidates and not _map_items(fd, path, candidates):
                mapped_here = set()
                for it in candidates:
                    it.slot.new = torch.empty(it.slot.shape, dtype=it.slot.dtype, device=device)
            work = _batches(
                [
                    u
                    for it in items
                    for u in (_mapped_chunks(it) if id(it.slot) in mapped_here else _chunks(it, device, staging, views))
                ]
            )
            if pool is None:
                for batch in work:
                    _run_batch(batch, fd)
                pending = []
            else:
                pending = [pool.submit(_run_batch, batch, fd) for batch in work]
            queued.append((items, mapped_here, pending))
        for items, mapped_here, pending in queued:
            for fut in pending:
                fut.result()
            for it in items:
                on_done(it, id(it.slot) in mapped_here)
    finally:
        # Every queued batch ends before any fd is closed (a failed one must not leave
        # others reading a closed, possibly reused, descriptor).
        wait([fut for _, _, pending in queued for fut in pending])
        for fd in fds:
            os.close(fd)


def _run_chunk(fn, fd: int, it: _Item) -> None:
    try:
        fn(fd)
    except OSError as exc:
        raise CheckpointError(f"`{it.file}`, tensor `{it.key}`: read failed: {exc.strerror or exc}") from None


# --------------------------------------------------------------------------- buffers


def _qual(mod_name: str, attr: str) -> str:
    return f"{mod_name}.{attr}" if mod_name else attr


def _is_rotary(mod: nn.Module) -> bool:
    return "RotaryEmbedding" in type(mod).__name__ and hasattr(mod, "rope_type") and hasattr(mod, "config")


def _nonpersistent_plan(module: nn.Module) -> list[tuple[str, nn.Module, list[str]]]:
    """Modules whose non-persistent buffers are on meta, checked to be recomputable before anything is read."""
    plan = []
    for mod_name, mod in module.named_modules():
        meta = [
            a for a, b in mod._buffers.items() if b is not None and a in mod._non_persistent_buffers_set and b.is_meta
        ]
        if not meta:
            continue
        if callable(getattr(mod, "reset_buffers", None)):
            pass
        elif _is_rotary(mod) and set(meta) <= {"inv_freq", "original_inv_freq"}:
            pass
        else:
            full = ", ".join(f"`{_qual(mod_name, a)}`" for a in meta)
            raise CheckpointError(
                f"non-persistent buffer(s) {full} were built on the meta device and are not in checkpoints"
                "\nhint: build that submodule outside the meta context, or give it a `reset_buffers()` method"
            )
        plan.append((mod_name, mod, meta))
    return plan


def _recompute_nonpersistent(module: nn.Module, plan: list[tuple[str, nn.Module, list[str]]], device: torch.device) -> None:
    """Give non-persistent buffers their real values (they are not in checkpoints); move real ones to `device`."""
    for _, mod in module.named_modules():
        for a, b in list(mod._buffers.items()):
            if b is not None and a in mod._non_persistent_buffers_set and not b.is_meta:
                mod._buffers[a] = b.to(device)
    for _, mod, meta in plan:
        for a in meta:
            b = mod._buffers[a]
            mod._buffers[a] = torch.empty(b.shape, dtype=b.dtype, device=device)
        if callable(getattr(mod, "reset_buffers", None)):
            mod.reset_buffers()
            continue
        # Rotary embeddings: the rope function the module's own __init__ uses
        # (as transformers' loader does), computed on the CPU like there.
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        fn = getattr(mod, "compute_default_rope_parameters", None) if mod.rope_type == "default" else None
        fn = fn or ROPE_INIT_FUNCTIONS[mod.rope_type]
        inv_freq, _ = fn(mod.config)
        with torch.no_grad():
            for a in meta:
                mod._buffers[a].copy_(inv_freq)


# --------------------------------------------------------------------------- entry point


def _resolve_device(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise CheckpointError(f"invalid device `{device}`: {exc}") from None


def stream_into(
    module: nn.Module,
    source: Source,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    key_mapping: KeyMapping = None,
    strict: bool = True,
    progress: ProgressFn | None = None,
    dry_run: bool = False,
    mmap: bool = False,
    skip: SkipFn = None,
) -> LoadReport:
    """Fill `module` (typically built under ``torch.device("meta")``) from `source`.

    `source`: checkpoint directory (index or single file), a ``.safetensors``
    file, or a ``Mapping[str, Tensor]`` (only read). `dtype`: final dtype of
    floating-point tensors (``None`` keeps each tensor's dtype in the module).
    `key_mapping`: checkpoint name -> module name, as an exact-name mapping or
    a callable; unmapped names pass through. `strict`: raise `CheckpointError`
    listing missing and unexpected keys; otherwise report them, and missing
    tensors that were on the meta device are zero-filled. `progress(done_bytes,
    total_bytes)` is called after each tensor. `dry_run`: only plan (check
    names, shapes and dtypes against the module, reading headers only) and
    return the report; the module is left untouched. `mmap`: on a CPU
    device, tensors stored whole in the final dtype become copy-on-write views
    of the mapped checkpoint instead of copies (see the module docstring); the
    rest is copied as usual. Ignored for in-memory sources and other devices.
    `skip(name)`: checkpoint names (before `key_mapping`) that belong to no
    part of this module on purpose (a multimodal wrapper's vision tower, MTP
    heads); they are neither read nor reported unexpected, but counted in
    `report.skipped` and `report.bytes_skipped`.

    Returns a `LoadReport`; the module's tensors are replaced in place.
    """
    dev = _resolve_device(device)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"invalid dtype `{dtype}`: expected a torch dtype")
    report = LoadReport()
    slots, by_name = _collect_slots(module, dtype)

    ckpt: Checkpoint | None = None
    mapping: Mapping[str, torch.Tensor] | None = None
    entries: list[tuple[str, str, torch.dtype, tuple[int, ...], int]] = []
    file_of: dict[str, tuple[Path, int]] = {}
    if isinstance(source, Mapping):
        mapping = source
        for key, t in mapping.items():
            if not isinstance(t, torch.Tensor):
                raise CheckpointError(f"in-memory source, tensor `{key}`: expected a torch.Tensor, found `{type(t).__name__}`")
            if t.is_meta:
                raise CheckpointError(f"in-memory source, tensor `{key}`: is on the meta device (holds no data)")
            nbytes = t.numel() * t.element_size()
            if skip is not None and skip(key):
                report.skipped.append(key)
                report.bytes_skipped += nbytes
                continue
            entries.append((key, "<mapping>", t.dtype, tuple(t.shape), nbytes))
    else:
        ckpt = resolve_checkpoint(source)
        for h in ckpt.shards:
            report.files.append(str(h.path))
            for key, info in h.tensors.items():  # already in file order
                if skip is not None and skip(key):
                    report.skipped.append(key)
                    report.bytes_skipped += info.nbytes
                    continue
                entries.append((key, str(h.path), TORCH_DTYPES[info.dtype], info.shape, info.nbytes))
                file_of[key] = (h.path, info.begin)

    items = _plan(slots, by_name, entries, key_mapping, report)
    buffer_plan = _nonpersistent_plan(module)
    what = "in-memory source" if mapping is not None else f"`{source}`"
    if strict and (report.missing or report.unexpected):
        parts = []
        if report.missing:
            parts.append(f"missing keys ({len(report.missing)}): {_list(report.missing)}")
        if report.unexpected:
            parts.append(f"unexpected keys ({len(report.unexpected)}): {_list(report.unexpected)}")
        raise CheckpointError(
            f"{what} does not match the model: " + "; ".join(parts)
            + "\nhint: check that the checkpoint belongs to this model config (or pass `key_mapping`)"
        )

    item_slots = {id(it.slot): it.slot for it in items}
    if dry_run:
        report.loaded = [s.name for s in item_slots.values()]
        return report

    if mapping is None:
        for it in items:
            it.file, it.begin = file_of[it.key]
    # Mapped candidates: the whole of a slot from one file, as stored.
    to_map: set[int] = set()
    if mmap and mapping is None and dev.type == "cpu" and os.name == "posix":
        to_map = {id(it.slot) for it in items if _mappable(it)}
    # Allocate each other destination once, in its final dtype and device.
    for slot in item_slots.values():
        if id(slot) not in to_map:
            slot.new = torch.empty(slot.shape, dtype=slot.dtype, device=dev)

    total = sum(it.nbytes for it in items)
    done = 0
    if mapping is not None:
        with torch.no_grad():
            for it in items:
                _dest(it).copy_(mapping[it.key])
                done += it.nbytes
                if progress:
                    progress(done, total)
        report.bytes_read = 0
    else:
        staging = _Staging(pin=dev.type == "cuda")
        by_file: dict[Path, list[_Item]] = {}
        for it in items:
            by_file.setdefault(it.file, []).append(it)

        def on_done(it: _Item, mapped: bool) -> None:
            nonlocal done
            done += it.nbytes
            report.bytes_read += it.nbytes
            if mapped:
                report.bytes_mapped += it.nbytes
                report.mapped.append(it.slot.name)
            if progress:
                progress(done, total)

        n_threads = _threads() if total > CHUNK_BYTES else 1
        pool = ThreadPoolExecutor(n_threads, thread_name_prefix="dflash-load") if n_threads > 1 else None
        try:
            _read_files(by_file, dev, staging, pool, on_done, to_map)
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        del staging

    # Missing tensors in non-strict mode: keep real ones, zero-fill meta ones.
    for slot in slots.values():
        if slot.new is None:
            if slot.old.is_meta:
                slot.new = torch.zeros(slot.shape, dtype=slot.dtype, device=dev)
            else:
                slot.new = slot.old.detach().to(device=dev, dtype=slot.dtype)
    # Swap in; every owner of one slot gets the same tensor object (ties stay ties).
    for slot in slots.values():
        value: torch.Tensor = slot.new  # type: ignore[assignment]
        param = None
        for mod, attr, is_param in slot.owners:
            if is_param:
                if param is None:
                    param = nn.Parameter(value, requires_grad=slot.requires_grad)
                mod._parameters[attr] = param
            else:
                mod._buffers[attr] = value
        slot.old = None  # type: ignore[assignment]
    _recompute_nonpersistent(module, buffer_plan, dev)

    loaded = [s.name for s in item_slots.values()]
    report.loaded = loaded
    return report


__all__ = ["LoadReport", "SAFETENSORS_DTYPES", "TORCH_DTYPES", "stream_into"]
