"""Safetensors header reader: parse and validate a file's header without touching tensor bytes.

Format: ``u64`` little-endian header length ``N``, then ``N`` bytes of UTF-8 JSON
(an object: tensor name -> ``{"dtype", "shape", "data_offsets"}`` plus an
optional ``"__metadata__"`` object of str -> str), then the data section.
``data_offsets`` are ``[begin, end)`` byte offsets relative to the start of the
data section.

Everything is validated here, before any tensor byte is read, so a loader that
trusts a returned `Header` never reads out of range or into a neighbour:

- the length prefix must fit in the file and stay under `MAX_HEADER_BYTES`;
- the header must be valid UTF-8 JSON with no duplicate keys at any level;
- every entry needs exactly ``dtype``, ``shape`` and ``data_offsets`` (unknown
  fields are rejected: a writer that adds fields is more likely corrupt than new);
- shapes are non-negative integers, offsets ``0 <= begin <= end``, and
  ``end - begin == prod(shape) * itemsize``;
- sorted by offset, tensors tile the data section exactly: no overlap, no hole,
  no trailing bytes. Holes are rejected on purpose, like the reference
  implementation does: a gap is unaddressable data that no writer produces, and
  usually means a damaged or hand-edited file.

This module imports no torch, so listing a checkpoint stays cheap.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..strict_json import DuplicateKeyError, no_duplicate_keys

# Upper bound on the JSON header. Real headers are a few MB at most (about 100
# bytes per tensor); anything larger is corrupt or hostile and would be read
# into memory whole.
MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype -> bytes per element
DTYPE_SIZES: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "BOOL": 1,
}

INTEGER_DTYPES = frozenset({"I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64"})

_ENTRY_FIELDS = frozenset({"dtype", "shape", "data_offsets"})


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file; `begin`/`end` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Header:
    """A validated safetensors header. Tensors are ordered by their position in the file."""

    path: Path
    header_bytes: int  # length of the JSON header (without the 8-byte prefix)
    data_start: int  # absolute file offset of the data section
    file_size: int
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo] = field(repr=False)

    @property
    def data_bytes(self) -> int:
        return self.file_size - self.data_start


def _err(path: Path, msg: str, tensor: str | None = None, hint: str | None = None) -> CheckpointError:
    where = f"`{path}`" + (f", tensor `{tensor}`" if tensor is not None else "")
    text = f"{where}: {msg}"
    if hint:
        text += f"\nhint: {hint}"
    return CheckpointError(text)


def _reject_constant(name: str) -> Any:
    # json accepts NaN/Infinity by default; they are not JSON and never valid here
    raise ValueError(f"non-standard JSON constant `{name}`")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_json(path: Path, raw: bytes) -> dict[str, Any]:
    """The header's JSON object: UTF-8, no duplicate key at any level, no NaN/Infinity."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _err(path, f"header is not valid UTF-8 (byte {exc.start} of the header)") from None
    try:
        doc = json.loads(text, object_pairs_hook=no_duplicate_keys, parse_constant=_reject_constant)
    except DuplicateKeyError as exc:
        raise _err(path, f"header has duplicate key `{exc.key}`", tensor=exc.key) from None
    except (ValueError, RecursionError) as exc:
        raise _err(path, f"header is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise _err(path, f"header must be a JSON object, found `{type(doc).__name__}`")
    return doc


def _parse_metadata(path: Path, raw_meta: Any) -> dict[str, str]:
    """`__metadata__` (absent: empty): an object of strings."""
    if raw_meta is None:
        return {}
    if not isinstance(raw_meta, dict):
        raise _err(path, "`__metadata__` must be an object of strings", tensor="__metadata__")
    for k, v in raw_meta.items():
        if not isinstance(v, str):
            raise _err(path, f"`__metadata__` value of `{k}` must be a string, found `{type(v).__name__}`", tensor="__metadata__")
    return dict(raw_meta)


def _parse_entry(path: Path, name: str, entry: Any, data_start: int, data_bytes: int) -> TensorInfo:
    """One tensor's entry: exactly `dtype`, `shape`, `data_offsets`, consistent with each other and in range."""
    if not name:
        raise _err(path, "empty tensor name in header", tensor=name)
    if not isinstance(entry, dict):
        raise _err(path, f"header entry must be an object, found `{type(entry).__name__}`", tensor=name)
    missing = _ENTRY_FIELDS - entry.keys()
    if missing:
        raise _err(path, f"header entry lacks {', '.join(f'`{m}`' for m in sorted(missing))}", tensor=name)
    extra = entry.keys() - _ENTRY_FIELDS
    if extra:
        raise _err(path, f"header entry has unknown field(s) {', '.join(f'`{m}`' for m in sorted(extra))}", tensor=name)
    dtype = entry["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise _err(path, f"unknown dtype `{dtype}`", tensor=name, hint=f"supported dtypes: {', '.join(DTYPE_SIZES)}")
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise _err(path, f"shape must be a list of integers, found `{shape}`", tensor=name)
    if any(d < 0 for d in shape):
        raise _err(path, f"shape has a negative dimension: `{shape}`", tensor=name)
    offsets = entry["data_offsets"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise _err(path, f"`data_offsets` must be two integers, found `{offsets}`", tensor=name)
    begin, end = offsets
    if begin < 0 or end < begin:
        raise _err(path, f"invalid `data_offsets` `{offsets}` (need 0 <= begin <= end)", tensor=name)
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - begin != expected:
        raise _err(
            path, f"byte count `{end - begin}` does not match shape `{shape}` x `{dtype}` (`{expected}` bytes)", tensor=name
        )
    if end > data_bytes:
        raise _err(
            path,
            f"data_offsets `{offsets}` run past the end of the data section (`{data_bytes}` bytes): "
            "offsets out of range or file truncated",
            tensor=name,
            hint="re-download or re-save the file",
        )
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _check_tiling(path: Path, infos: list[TensorInfo], data_start: int, file_size: int) -> None:
    """Sorted by offset (`infos` is), the tensors tile the data section: no overlap, no hole, no trailing bytes."""
    cursor = data_start
    prev: TensorInfo | None = None
    for info in infos:
        if info.begin < cursor:
            raise _err(
                path,
                f"data_offsets overlap tensor `{prev.name if prev else '?'}` "
                f"(starts at `{info.begin - data_start}`, previous ends at `{cursor - data_start}`)",
                tensor=info.name,
            )
        if info.begin > cursor:
            raise _err(
                path,
                f"hole of `{info.begin - cursor}` bytes before this tensor (data_offsets must tile the data section)",
                tensor=info.name,
            )
        cursor = info.end
        prev = info
    if cursor != file_size:
        raise _err(
            path,
            f"`{file_size - cursor}` trailing bytes after the last tensor (data section is `{file_size - data_start}` bytes, "
            f"tensors cover `{cursor - data_start}`)",
            tensor=prev.name if prev else None,
        )


def parse_header_bytes(path: Path, raw: bytes, file_size: int) -> Header:
    """Validate header JSON `raw` (the bytes after the length prefix) of a file of `file_size` bytes."""
    doc = _parse_json(path, raw)
    data_start = 8 + len(raw)
    metadata = _parse_metadata(path, doc.pop("__metadata__", None))
    infos = [_parse_entry(path, name, entry, data_start, file_size - data_start) for name, entry in doc.items()]
    # Sort by (begin, end) so zero-sized tensors sharing an offset are not "overlaps".
    infos.sort(key=lambda t: (t.begin, t.end))
    _check_tiling(path, infos, data_start, file_size)
    return Header(
        path=path,
        header_bytes=len(raw),
        data_start=data_start,
        file_size=file_size,
        metadata=metadata,
        tensors={t.name: t for t in infos},
    )


def read_header(path: str | os.PathLike[str]) -> Header:
    """Read and validate the header of the safetensors file at `path`; reads no tensor data."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _err(path, f"file truncated: `{file_size}` bytes, shorter than the 8-byte header length prefix")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES:
                raise _err(
                    path,
                    f"header length `{n}` exceeds the `{MAX_HEADER_BYTES}`-byte limit",
                    hint="the file is corrupt or not a safetensors file",
                )
            if 8 + n > file_size:
                raise _err(
                    path,
                    f"header length `{n}` runs past the end of the file (`{file_size}` bytes)",
                    hint="the file is truncated or not a safetensors file",
                )
            raw = f.read(n)
            if len(raw) != n:  # file shrank while reading
                raise _err(path, "file truncated while reading the header")
    except IsADirectoryError:
        raise _err(path, "is a directory, expected a `.safetensors` file") from None
    except FileNotFoundError:
        raise _err(path, "no such file") from None
    except PermissionError:
        raise _err(path, "permission denied") from None
    except OSError as exc:
        raise _err(path, f"cannot read: {exc.strerror or exc}") from None
    return parse_header_bytes(path, raw, file_size)
