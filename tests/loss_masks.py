"""Reading a 0/1 loss mask as the runs of trained tokens it holds (tests of chat logs and their worlds)."""

from __future__ import annotations

from collections.abc import Sequence


def mask_runs(mask: Sequence[int]) -> list[tuple[int, int]]:
    """`(start, end)` of every run of 1s in `mask`, end exclusive, in order."""
    out, start = [], None
    for t, m in enumerate([*mask, 0]):
        if m and start is None:
            start = t
        if not m and start is not None:
            out.append((start, t))
            start = None
    return out
