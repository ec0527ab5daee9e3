"""Builders of tiny real models and checkpoints for tests, benchmarks and the demo.

Nothing binary is committed: every fixture is made from real transformers
configs (Qwen3, Qwen3-MoE) and saved as real sharded safetensors.
"""

from .tiny import save_tiny_target, tiny_qwen3_config, tiny_qwen3_moe_config

__all__ = ["save_tiny_target", "tiny_qwen3_config", "tiny_qwen3_moe_config"]
