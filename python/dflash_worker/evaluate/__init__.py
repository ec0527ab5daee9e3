"""Evaluation: speculative generation with a draft and its target, acceptance statistics."""

from .speculate import SpeculativeResult, greedy_generate, speculative_generate

__all__ = ["SpeculativeResult", "greedy_generate", "speculative_generate"]
