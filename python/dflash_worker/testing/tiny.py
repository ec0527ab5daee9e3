"""Tiny Qwen3 / Qwen3-MoE targets built from real transformers configs."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def tiny_qwen3_config(**overrides: Any):
    """A dense Qwen3 config small enough for CPU tests (4 layers, hidden 64)."""
    from transformers import Qwen3Config

    kw: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kw.update(overrides)
    return Qwen3Config(**kw)


def tiny_qwen3_moe_config(**overrides: Any):
    """A Qwen3-MoE config small enough for CPU tests (4 experts, top-2)."""
    from transformers import Qwen3MoeConfig

    kw: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def save_tiny_target(
    path: str | Path,
    *,
    family: str = "qwen3",
    dtype: str = "float32",
    seed: int = 0,
    max_shard_size: str | int = "64KB",
    **overrides: Any,
):
    """Build a randomly initialised tiny target and `save_pretrained` it (sharded).

    Returns the in-memory model (in `dtype`) that was saved.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_qwen3_config(**overrides) if family == "qwen3" else tiny_qwen3_moe_config(**overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model = model.to(getattr(torch, dtype)).eval()
    model.save_pretrained(str(path), max_shard_size=max_shard_size)
    return model
