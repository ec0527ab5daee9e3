"""Step 3 of `stream_into` (`weights.stream`): reading the planned tensors from their files.

One open file at a time, tensors in file order, ``preadv`` straight into each destination's
bytes in chunks of at most `CHUNK_BYTES` over up to `MAX_THREADS` threads; a per-thread staging
buffer only where the dtype differs or the device is not the CPU; destinations prefaulted with
`madvise` (`_prefault`); with ``mmap=True`` the tensors whose bytes already are their final CPU
storage become copy-on-write views of the mapped file (`_map_items`). The module docstring of
`weights.stream` says why each choice is made and what it costs.
"""

from __future__ import annotations

import ctypes
import errno
import mmap as _mmap
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError
from .stream_plan import _dest, _Item, _item_offset, _Slot

if sys.byteorder != "little":  # safetensors data is little-endian; we read bytes verbatim
    raise ImportError("dflash_worker.weights needs a little-endian host")

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


def _read_items(
    items: list[_Item], device: torch.device, to_map: set[int], on_done: Callable[[_Item, bool], None], total: int
) -> None:
    """Fill every item from its file (`_read_files`): over a pool of threads when there is more
    than one chunk's work (`total` bytes), with a staging buffer per thread where one is needed."""
    staging = _Staging(pin=device.type == "cuda")
    by_file: dict[Path, list[_Item]] = {}
    for it in items:
        by_file.setdefault(it.file, []).append(it)
    n_threads = _threads() if total > CHUNK_BYTES else 1
    pool = ThreadPoolExecutor(n_threads, thread_name_prefix="dflash-load") if n_threads > 1 else None
    try:
        _read_files(by_file, device, staging, pool, on_done, to_map)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
