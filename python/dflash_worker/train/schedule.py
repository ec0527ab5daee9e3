"""Learning-rate schedule: linear warmup, then cosine, linear or constant decay.

The factor is a pure function of the optimizer step, so the scheduler's only
state is its step counter (saved in every checkpoint with the rest of
`LambdaLR.state_dict()`).
"""

from __future__ import annotations

import math


def lr_factor(step: int, *, total: int, warmup: int, kind: str, min_ratio: float) -> float:
    """Multiplier of the base learning rate for optimizer step `step` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    if kind == "linear":
        decay = 1.0 - progress
    elif kind == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown schedule {kind}")
    return min_ratio + (1.0 - min_ratio) * decay
