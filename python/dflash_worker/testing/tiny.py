"""Tiny Qwen3 / Qwen3-MoE targets built from real transformers configs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .tiny_draft import place_overrides

# The dense geometry both tiny families share (a Qwen3-MoE layer keeps the dense attention).
_TINY_QWEN3: dict[str, Any] = dict(
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

# What the MoE family adds: 4 routed experts, top-2, on every layer.
_TINY_QWEN3_MOE_EXTRA: dict[str, Any] = dict(
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    norm_topk_prob=True,
)


def tiny_qwen3_config(**overrides: Any):
    """A dense Qwen3 config small enough for CPU tests (4 layers, hidden 64)."""
    from transformers import Qwen3Config

    return Qwen3Config(**{**_TINY_QWEN3, **overrides})


def tiny_qwen3_moe_config(**overrides: Any):
    """A Qwen3-MoE config small enough for CPU tests (4 experts, top-2)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**_TINY_QWEN3, **_TINY_QWEN3_MOE_EXTRA, **overrides})


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


def tiny_dflash2_draft_config(target_config, **overrides: Any) -> dict[str, Any]:
    """config.json contents of a tiny DFlash2 draft for `target_config` (a transformers config).

    Qwen3-style top level plus `dflash_config`; `overrides` replace top-level
    keys, except draft fields (`DRAFT_FIELDS`), which go to `dflash_config`.
    """
    n_target = target_config.num_hidden_layers
    cfg: dict[str, Any] = {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "hidden_size": target_config.hidden_size,
        "intermediate_size": 2 * target_config.hidden_size,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": target_config.hidden_size // 4,
        "vocab_size": target_config.vocab_size,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "dflash_config": {
            "target_layer_ids": sorted({1, n_target // 2, n_target - 2} & set(range(n_target))) or [0],
            "block_size": 4,
            "mask_token_id": target_config.vocab_size - 1,
            "selector_rank": 8,
            "selector_top_k": 4,
            "conv_kernel_size": 3,
            "conv_group_size": 16,
        },
    }
    return place_overrides(cfg, overrides)


def dflash2_draft_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a DFlash2 draft checkpoint with draft config `config` (a dict)."""
    dc = config.get("dflash_config", {})

    def val(name: str) -> Any:
        return dc.get(name, config.get(name))

    H = config["hidden_size"]
    I = config["intermediate_size"]
    nq, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or H // nq
    n_ids = len(val("target_layer_ids"))
    r, k, g = val("selector_rank"), val("conv_kernel_size"), val("conv_group_size")
    V = config["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (H, n_ids * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (nq * hd, H),
                p + "self_attn.k_proj.weight": (nkv * hd, H),
                p + "self_attn.v_proj.weight": (nkv * hd, H),
                p + "self_attn.o_proj.weight": (H, nq * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (I, H),
                p + "mlp.up_proj.weight": (I, H),
                p + "mlp.down_proj.weight": (H, I),
                p + "input_layernorm.weight": (H,),
                p + "post_attention_layernorm.weight": (H,),
            }
        )
        for conv in ("attention_conv", "mlp_conv"):
            shapes[p + f"{conv}.base_kernel"] = (2, k, H)
            shapes[p + f"{conv}.kernel_projection.weight"] = (2 * k * (H // g), H)
    shapes["candidate_selector.predecessor_codebook"] = (V, r)
    shapes["candidate_selector.successor_codebook"] = (V, r)
    shapes["candidate_selector.hidden_projection.weight"] = (r, H)
    return shapes


def save_tiny_dflash2_draft(
    path: str | Path,
    target_config,
    *,
    dtype: str = "bfloat16",
    seed: int = 0,
    shapes: dict[str, tuple[int, ...]] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Write a tiny DFlash2 draft (config.json + model.safetensors, random tensors) for `target_config`.

    `overrides` go to the draft config (see `tiny_dflash2_draft_config`);
    `shapes` replaces the tensor layout (to build deliberately broken drafts).
    Returns the config dict written.
    """
    import json

    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = tiny_dflash2_draft_config(target_config, **overrides)
    layout = dflash2_draft_shapes(cfg) if shapes is None else shapes
    gen = torch.Generator().manual_seed(seed)
    tensors = {n: (torch.randn(s, generator=gen) * 0.02).to(getattr(torch, dtype)) for n, s in layout.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return cfg
