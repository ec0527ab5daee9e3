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

This module is the entry point and steps 2 and 4; the plan (step 1) is
`weights.stream_plan`, the reads (step 3) `weights.stream_read`, the
non-persistent buffers (step 5) `weights.stream_buffers`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError
from .checkpoint import resolve_checkpoint
from .dtypes import TORCH_DTYPES
from .stream_buffers import _nonpersistent_plan, _recompute_nonpersistent
from .stream_plan import KeyMapping, LoadReport, _collect_slots, _dest, _Item, _list, _plan, _Slot
from .stream_read import _mappable, _read_items

Source = str | os.PathLike | Mapping[str, torch.Tensor]
SkipFn = Callable[[str], bool] | None
ProgressFn = Callable[[int, int], None]
# (checkpoint key, where (file or "<mapping>"), dtype, shape, nbytes)
_Entry = tuple[str, str, torch.dtype, tuple[int, ...], int]


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
    mapping = source if isinstance(source, Mapping) else None
    entries, file_of = _entries(source, skip, report)
    # 1. plan: every mismatch raises here, before a byte is read
    items = _plan(slots, by_name, entries, key_mapping, report)
    buffer_plan = _nonpersistent_plan(module)
    if strict:
        _check_strict(report, "in-memory source" if mapping is not None else f"`{source}`")
    item_slots = {id(it.slot): it.slot for it in items}
    if dry_run:
        report.loaded = [s.name for s in item_slots.values()]
        return report
    if mapping is None:
        for it in items:
            it.file, it.begin = file_of[it.key]
    # 2. allocate; mapped candidates (the whole of a slot from one file, as stored) get no storage
    to_map: set[int] = set()
    if mmap and mapping is None and dev.type == "cpu" and os.name == "posix":
        to_map = {id(it.slot) for it in items if _mappable(it)}
    for slot in item_slots.values():
        if id(slot) not in to_map:
            slot.new = torch.empty(slot.shape, dtype=slot.dtype, device=dev)
    # 3. read
    total = sum(it.nbytes for it in items)
    if mapping is not None:
        _copy_mapping(items, mapping, progress, total)
    else:
        _read_items(items, dev, to_map, _on_done(report, progress, total), total)
    # 4. swap in, 5. non-persistent buffers
    _swap_in(slots, dev)
    _recompute_nonpersistent(module, buffer_plan, dev)
    report.loaded = [s.name for s in item_slots.values()]
    return report


def _entries(source: Source, skip: SkipFn, report: LoadReport) -> tuple[list[_Entry], dict[str, tuple[Path, int]]]:
    """Every tensor of `source` that `skip` keeps, in read order, and (files only) each key's file and
    absolute offset; the skipped ones are counted in `report`. Reads headers only."""
    entries: list[_Entry] = []
    file_of: dict[str, tuple[Path, int]] = {}
    if isinstance(source, Mapping):
        for key, t in source.items():
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
        return entries, file_of
    for h in resolve_checkpoint(source).shards:
        report.files.append(str(h.path))
        for key, info in h.tensors.items():  # already in file order
            if skip is not None and skip(key):
                report.skipped.append(key)
                report.bytes_skipped += info.nbytes
                continue
            entries.append((key, str(h.path), TORCH_DTYPES[info.dtype], info.shape, info.nbytes))
            file_of[key] = (h.path, info.begin)
    return entries, file_of


def _check_strict(report: LoadReport, what: str) -> None:
    """`CheckpointError` listing the missing and unexpected keys, if any."""
    if not (report.missing or report.unexpected):
        return
    parts = []
    if report.missing:
        parts.append(f"missing keys ({len(report.missing)}): {_list(report.missing)}")
    if report.unexpected:
        parts.append(f"unexpected keys ({len(report.unexpected)}): {_list(report.unexpected)}")
    raise CheckpointError(
        f"{what} does not match the model: " + "; ".join(parts)
        + "\nhint: check that the checkpoint belongs to this model config (or pass `key_mapping`)"
    )


def _copy_mapping(items: list[_Item], mapping: Mapping[str, torch.Tensor], progress: ProgressFn | None, total: int) -> None:
    """Fill every item from the caller's in-memory tensors (nothing is read from files)."""
    done = 0
    with torch.no_grad():
        for it in items:
            _dest(it).copy_(mapping[it.key])
            done += it.nbytes
            if progress:
                progress(done, total)


def _on_done(report: LoadReport, progress: ProgressFn | None, total: int) -> Callable[[_Item, bool], None]:
    """What runs after each item is read (file by file, in order): the report's counts, then `progress`."""
    done = 0

    def on_done(it: _Item, mapped: bool) -> None:
        nonlocal done
        done += it.nbytes
        report.bytes_read += it.nbytes
        if mapped:
            report.bytes_mapped += it.nbytes
            report.mapped.append(it.slot.name)
        if progress:
            progress(done, total)

    return on_done


def _swap_in(slots: dict[str, _Slot], dev: torch.device) -> None:
    """Put each slot's new tensor into the module; every owner of one slot gets the same tensor object."""
    # Missing tensors in non-strict mode: keep real ones, zero-fill meta ones.
    for slot in slots.values():
        if slot.new is None:
            if slot.old.is_meta:
                slot.new = torch.zeros(slot.shape, dtype=slot.dtype, device=dev)
            else:
                slot.new = slot.old.detach().to(device=dev, dtype=slot.dtype)
    # Ties stay ties: one Parameter object for every name of a slot.
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


__all__ = ["LoadReport", "stream_into"]
