"""Teacher capture: run the frozen target over prepared data and cache the draft's target features.

`run_capture(recipe)` writes a resumable, byte-deterministic cache of sharded
safetensors plus a manifest; `open_capture(dir)` reads it back for training.
"""

from .layout import FORMAT
from .reader import CapturedExample, CaptureReader, open_capture
from .run import read_target_layer_ids, run_capture, teacher_features

__all__ = [
    "FORMAT",
    "CaptureReader",
    "CapturedExample",
    "open_capture",
    "read_target_layer_ids",
    "run_capture",
    "teacher_features",
]
