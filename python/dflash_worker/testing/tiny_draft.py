"""Tiny DFlash / DFlash2 draft configs that fit a tiny target, for tests and benchmarks.

The configs are plain `config.json` dicts in the released upstream layout
(draft fields under `dflash_config`), so the same dict builds our draft
(`DraftConfig.from_dict`) and the upstream reference (`Qwen3Config(**d)`).
"""

from __future__ import annotations

import copy
from typing import Any

from ..model.config import DRAFT_FIELDS

_SELECTOR_AND_CONV = ("selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size")


def _base(target_config, num_layers: int) -> dict[str, Any]:
    t = target_config
    n_target = t.num_hidden_layers
    rope = copy.deepcopy(dict(getattr(t, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}))
    if str(getattr(t, "model_type", "")).startswith("qwen3_5"):
        # a Qwen3.5 target's partial / multimodal rotary is its own; the draft's is plain (as `init-draft` does)
        rope = {"rope_type": "default", "rope_theta": rope.get("rope_theta", 10000.0)}
    return {
        "model_type": "qwen3",
        "vocab_size": t.vocab_size,
        "hidden_size": t.hidden_size,
        "intermediate_size": 2 * t.hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "head_dim": getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
        "rms_norm_eps": t.rms_norm_eps,
        "rope_parameters": rope,
        "max_position_embeddings": t.max_position_embeddings,
        "num_target_layers": n_target,
        "layer_types": ["sliding_attention"] + ["full_attention"] * (num_layers - 1),
        "use_sliding_window": True,
        "sliding_window": 6,
        "dflash_config": {
            # taps spread over the target, including its last layer's input
            "target_layer_ids": sorted({0, n_target // 2, n_target - 2}),
            "block_size": 4,
            "mask_token_id": t.vocab_size - 1,
        },
    }


def place_overrides(cfg: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set each override in draft config `cfg`: draft fields (`DRAFT_FIELDS`) in `dflash_config`, the rest at the top level."""
    for key, value in overrides.items():
        if key in DRAFT_FIELDS:
            cfg["dflash_config"][key] = value
        else:
            cfg[key] = value
    return cfg


def _apply(cfg: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    place_overrides(cfg, overrides)
    n = cfg["num_hidden_layers"]
    if len(cfg["layer_types"]) != n and "layer_types" not in overrides:
        cfg["layer_types"] = (["sliding_attention"] + ["full_attention"] * n)[:n]
    return cfg


def tiny_dflash2_config(target_config, **overrides: Any) -> dict[str, Any]:
    """A 2-layer DFlash2 draft for `target_config`: one sliding-window layer, block 4,
    convolutions (kernel 3, group 16) and a rank-8, top-8 selector.

    Override any field by name; draft fields land in `dflash_config`.
    """
    cfg = _base(target_config, overrides.pop("num_hidden_layers", 2))
    cfg["architectures"] = ["DFlash2DraftModel"]
    cfg["dflash_config"].update(selector_rank=8, selector_top_k=8, conv_kernel_size=3, conv_group_size=16)
    return _apply(cfg, overrides)


def tiny_dflash_config(target_config, **overrides: Any) -> dict[str, Any]:
    """A 2-layer DFlash (v1) draft for `target_config` (no convolutions, no selector)."""
    cfg = _base(target_config, overrides.pop("num_hidden_layers", 2))
    cfg["architectures"] = ["DFlashDraftModel"]
    return _apply(cfg, overrides)
