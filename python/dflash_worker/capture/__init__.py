"""Teacher capture: run the frozen target over prepared data and cache the draft's target features.

`run_capture(recipe)` writes a resumable, byte-deterministic cache of sharded
safetensors plus a manifest; `open_capture(dir)` reads it back for training.
With `[train].features = "online"` the shards hold token ids only and training computes the
features through the same `Teacher` (`capture.teacher`).
A capture divided over the jobs of a run: `run_capture(recipe, part=CapturePart(i, N))`
in each, then `assemble_capture(recipe)` where the shards meet.
"""

from .layout import FORMAT
from .reader import CapturedExample, CaptureReader, open_capture
from .run import CapturePart, assemble_capture, run_capture
from .teacher import Teacher, teacher_features

__all__ = [
    "FORMAT",
    "CapturePart",
    "assemble_capture",
    "CaptureReader",
    "CapturedExample",
    "open_capture",
    "run_capture",
    "Teacher",
    "teacher_features",
]
