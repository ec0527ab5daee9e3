"""Evaluation: speculative generation with a draft and its target, acceptance statistics.

The generation functions import torch, so they are loaded when first used: the coordinator
reads `evaluate.report`'s verdict rule (its regression gate) without the training stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .speculate import SpeculativeResult, greedy_generate, speculative_generate

__all__ = ["SpeculativeResult", "greedy_generate", "speculative_generate"]


def __getattr__(name: str):
    if name in __all__:
        from . import speculate

        return getattr(speculate, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
