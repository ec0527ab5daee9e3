"""Exports of a trained draft: serving-ready files plus a manifest.

- ``export.af4g64``: MLX affine 4-bit (group 64) safetensors + ``config.json`` + ``manifest.json``
  (re-exported here);
- ``export.bf16``: BF16 export in the released upstream layout (re-exported here);
- ``export.commit``: the directory commit both formats share (temporary sibling renamed
  into place, the old export put back on failure).
"""

from .af4g64 import AF4G64Export, read_manifest, write_af4g64
from .bf16 import BF16Export, verify_bf16, write_bf16

__all__ = ["AF4G64Export", "BF16Export", "read_manifest", "verify_bf16", "write_af4g64", "write_bf16"]
