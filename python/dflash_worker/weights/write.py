"""Safetensors writer: the one place this package writes a ``.safetensors`` file.

`write_safetensors(path, tensors, metadata)` writes the format `weights.header` reads
(``u64`` little-endian header length ``N``, ``N`` bytes of JSON header, the data section)
and fixes every free choice, so the same inputs give the same bytes (capture shards and
BF16 exports are compared by hash):

- the header is ``{"__metadata__": {...}, name: {"dtype", "shape", "data_offsets"}, ...}``:
  metadata first in the order given (safetensors' own writer orders ``__metadata__`` from
  a hash map that changes between processes, which would break byte-identical files),
  then the tensors in the order given; compact JSON (``,`` and ``:``, ASCII), padded with
  spaces to a multiple of 8 bytes, as the format allows;
- the tensors' bytes follow in the same order, back to back. Nothing is inserted between
  them, so a tensor is aligned to its element size only if the caller orders tensors by
  element size, largest first (capture does; the BF16 export keeps the released order;
  the AF4G64 export passes `safetensors_order(tensors)`, the order safetensors' own
  ``save_file`` uses, so its files are the bytes that ``save_file`` wrote before);
- bytes go from each tensor to the file and the sha256 with no concatenated copy and no
  in-memory file: a value may be a list of tensors stored as one (their concatenation on
  the first dim: capture's features, one tensor per example), or a `RawTensor` whose
  parts are read once, while the file is written;
- the file is written to ``.<name>.tmp-<pid>`` beside `path`, fsynced and renamed into
  place (`manifest.commit_file`); on any error the temporary is removed and `path` is
  left as it was. Capture's resume removes such temporaries by that name.

Every input is checked before the file is opened; `CheckpointError` names the file and
the tensor (a non-CPU, non-contiguous or unsupported tensor, a shape that does not match
its bytes).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .header import DTYPE_SIZES, _err

if TYPE_CHECKING:
    import torch

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class RawTensor:
    """A tensor given as its safetensors `dtype` (``"BF16"``, ``"I64"``, ...), `shape` and
    little-endian bytes in `parts` (iterated once, while the file is written; together
    exactly ``prod(shape) * itemsize`` bytes)."""

    dtype: str
    shape: tuple[int, ...]
    parts: Iterable[Buffer]


@dataclass(frozen=True)
class Written:
    """What `write_safetensors` wrote: the file's sha256 and size in bytes."""

    sha256: str
    bytes: int


@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: str
    shape: list[int]
    nbytes: int
    parts: Iterable[Buffer]


# Safetensors' own writer (`safetensors.torch.save_file`, Rust `tensor::prepare`) sorts tensors by
# its `Dtype` enum, descending, then by name; this is that enum's order, descending, for the dtypes
# `weights.header.DTYPE_SIZES` knows. Element sizes never grow along it, so every tensor is aligned.
SAFETENSORS_ORDER: tuple[str, ...] = (
    "U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL",
)


def _dtype_name(value: Any) -> str | None:
    """The safetensors dtype name of a writer value (tensor, list of tensors or `RawTensor`), if it has one."""
    if isinstance(value, RawTensor):
        return value.dtype
    first = value[0] if isinstance(value, list) and value else value
    from .dtypes import SAFETENSORS_DTYPES

    return SAFETENSORS_DTYPES.get(getattr(first, "dtype", None))


def safetensors_order(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """`tensors` reordered as ``safetensors.torch.save_file`` lays them out: dtype in
    `SAFETENSORS_ORDER` (largest element first), then name. `write_safetensors` given this
    order writes the same bytes as ``save_file`` when there is at most one metadata key
    (``save_file`` orders several from a hash map) and names and metadata are ASCII below
    DEL (this writer escapes the rest as ``\\uXXXX``, ``save_file`` writes them as UTF-8).
    A dtype the writer does not know goes last; the writer then refuses it by name."""
    rank = {name: i for i, name in enumerate(SAFETENSORS_ORDER)}
    return dict(sorted(tensors.items(), key=lambda kv: (rank.get(_dtype_name(kv[1]), len(rank)), kv[0])))


def _tensor_bytes(t: Any) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (works for bf16, which numpy lacks)."""
    import torch

    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _check_tensor(path: Path, name: str, t: Any) -> str:
    """The safetensors dtype of torch tensor `t`, after checking it can be written as it is."""
    import torch

    from .dtypes import SAFETENSORS_DTYPES

    if not isinstance(t, torch.Tensor):
        raise _err(path, f"expected a torch.Tensor, a list of them or a `RawTensor`, found `{type(t).__name__}`", tensor=name)
    if t.device.type != "cpu":
        raise _err(path, f"is on `{t.device}`, not the CPU", tensor=name, hint="move it first (`t.cpu()`)")
    if not t.is_contiguous():
        raise _err(path, f"is not contiguous (strides `{list(t.stride())}`)", tensor=name, hint="pass `t.contiguous()`")
    if t.dtype not in SAFETENSORS_DTYPES:
        raise _err(path, f"dtype `{t.dtype}` has no safetensors name", tensor=name,
                   hint=f"supported dtypes: {', '.join(str(d) for d in SAFETENSORS_DTYPES)}")
    return SAFETENSORS_DTYPES[t.dtype]


def _entry(path: Path, name: str, value: Any) -> _Entry:
    """Check one named value and describe it; reads no tensor bytes."""
    if not isinstance(name, str) or not name or name == "__metadata__":
        raise _err(path, f"invalid tensor name `{name!r}`", hint="names are non-empty strings other than `__metadata__`")
    if isinstance(value, RawTensor):
        shape = list(value.shape)
        if value.dtype not in DTYPE_SIZES:
            raise _err(path, f"unknown dtype `{value.dtype}`", tensor=name, hint=f"supported dtypes: {', '.join(DTYPE_SIZES)}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise _err(path, f"shape must be non-negative integers, found `{shape}`", tensor=name)
        return _Entry(name, value.dtype, shape, math.prod(shape) * DTYPE_SIZES[value.dtype], value.parts)
    if isinstance(value, list):
        if not value:
            raise _err(path, "is an empty list of tensors", tensor=name)
        dtypes = {_check_tensor(path, name, t) for t in value}
        rests = {tuple(t.shape[1:]) for t in value}
        if len(dtypes) > 1 or len(rests) > 1 or any(t.dim() == 0 for t in value):
            raise _err(path, f"parts do not concatenate on the first dim (dtypes `{sorted(dtypes)}`, "
                             f"shapes `{[list(t.shape) for t in value]}`)", tensor=name)
        shape = [sum(t.shape[0] for t in value), *value[0].shape[1:]]
        return _Entry(name, dtypes.pop(), shape, sum(t.numel() * t.element_size() for t in value),
                      [_tensor_bytes(t) for t in value])
    dtype = _check_tensor(path, name, value)
    return _Entry(name, dtype, list(value.shape), value.numel() * value.element_size(), [_tensor_bytes(value)])


def _header_bytes(entries: list[_Entry], metadata: Mapping[str, str] | None) -> bytes:
    """The length prefix and the padded JSON header of a file holding `entries` in order."""
    header: dict[str, Any] = {} if metadata is None else {"__metadata__": dict(metadata)}
    pos = 0
    for e in entries:
        header[e.name] = {"dtype": e.dtype, "shape": e.shape, "data_offsets": [pos, pos + e.nbytes]}
        pos += e.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb


def _chunks(path: Path, prefix: bytes, entries: list[_Entry]) -> Iterator[Buffer]:
    """The file's bytes in order; each tensor's parts counted against its shape as they come."""
    yield prefix
    for e in entries:
        seen = 0
        for part in e.parts:
            seen += len(part) if not isinstance(part, memoryview) else part.nbytes
            if seen > e.nbytes:
                break
            yield part
        if seen != e.nbytes:
            what = f"more than `{e.nbytes}`" if seen > e.nbytes else f"`{seen}`"
            raise _err(path, f"its parts hold {what} bytes, shape `{e.shape}` x `{e.dtype}` needs `{e.nbytes}`", tensor=e.name)


def write_safetensors(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor | list[torch.Tensor] | RawTensor],
                      metadata: Mapping[str, str] | None = None) -> Written:
    """Write `tensors` (name -> tensor, list of tensors or `RawTensor`, in file order) and
    `metadata` (str -> str) to `path` atomically; returns its sha256 and size (module docstring)."""
    from ..manifest import commit_file

    path = Path(path)
    if metadata is not None:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise _err(path, f"metadata `{k!r}` -> `{type(v).__name__}`: keys and values must be strings",
                           tensor="__metadata__")
    entries = [_entry(path, name, value) for name, value in tensors.items()]
    h = hashlib.sha256()
    total = 0
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            for chunk in _chunks(path, _header_bytes(entries, metadata), entries):
                h.update(chunk)
                f.write(chunk)
                total += len(chunk) if not isinstance(chunk, memoryview) else chunk.nbytes
        commit_file(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return Written(h.hexdigest(), total)


__all__ = ["SAFETENSORS_ORDER", "RawTensor", "Written", "safetensors_order", "write_safetensors"]
