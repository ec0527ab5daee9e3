"""Safetensors dtype names and their torch dtypes, both ways.

The names are the format's (`weights.header.DTYPE_SIZES` holds their sizes and imports no
torch); this module is the torch side, shared by the loader (`weights.stream`) and the
writer (`weights.write`).
"""

from __future__ import annotations

import torch

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
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}

__all__ = ["SAFETENSORS_DTYPES", "TORCH_DTYPES"]
