"""Safetensors checkpoints: header validation, shard resolution, streamed loading and the writer.

`read_header` and `list_tensors` read headers only and import no torch; the
loaders (`stream_into`, `load_model`) and the one safetensors writer
(`write_safetensors`, `weights.write`) are imported lazily on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .checkpoint import Checkpoint, TensorEntry, list_tensors, resolve_checkpoint
from .header import DTYPE_SIZES, MAX_HEADER_BYTES, Header, TensorInfo, read_header

if TYPE_CHECKING:
    from .loader import check_model_checkpoint, load_model
    from .stream import LoadReport, stream_into
    from .write import write_safetensors

_LAZY = {"load_model": ".loader", "check_model_checkpoint": ".loader", "stream_into": ".stream", "LoadReport": ".stream",
         "write_safetensors": ".write"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Checkpoint",
    "DTYPE_SIZES",
    "Header",
    "LoadReport",
    "MAX_HEADER_BYTES",
    "TensorEntry",
    "TensorInfo",
    "check_model_checkpoint",
    "list_tensors",
    "load_model",
    "read_header",
    "resolve_checkpoint",
    "stream_into",
    "write_safetensors",
]
