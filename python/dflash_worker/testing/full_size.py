"""Full-size reference shapes: the public config values of released targets, one name each.

Tests and benches that need a real target's geometry without its weights (header-only contracts,
the standard draft geometry from config.json alone, the load bench's narrowed checkpoints) read
them here instead of typing them again. Values are `config.json` fields as transformers names them;
for the Qwen3.5 families they are the `text_config` (the text tower) of the multimodal wrapper, whose
vision tower keeps transformers' default config. Plain dicts of plain values: nothing is imported.
"""

from __future__ import annotations

from typing import Any

# Qwen/Qwen3-0.6B (dense `qwen3`; tied embeddings).
QWEN3_0_6B: dict[str, Any] = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    bos_token_id=151643,
    eos_token_id=151645,
)

# Qwen/Qwen3.6-35B-A3B (`qwen3_5_moe`): 40 hybrid layers (3 Gated DeltaNet : 1 gated attention),
# 256 routed experts, top-8, and a shared expert.
QWEN3_6_35B_A3B: dict[str, Any] = dict(
    hidden_size=2048,
    num_hidden_layers=40,
    vocab_size=248320,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_conv_kernel_dim=4,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    tie_word_embeddings=False,
)

# The dense Qwen3.6-27B (`qwen3_5`): 64 hybrid layers.
QWEN3_6_27B: dict[str, Any] = dict(
    hidden_size=5120,
    num_hidden_layers=64,
    intermediate_size=17408,
    vocab_size=248320,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=False,
)

__all__ = ["QWEN3_0_6B", "QWEN3_6_27B", "QWEN3_6_35B_A3B"]
