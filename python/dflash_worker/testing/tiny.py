"""Tiny Qwen3 / Qwen3-MoE / Qwen3.5 / Qwen3.5-MoE targets built from real transformers configs.

Every target is saved as transformers' `save_pretrained` saves a large checkpoint:
sharded (`model-000NN-of-000MM.safetensors` plus `model.safetensors.index.json`;
the default `max_shard_size` gives several shards even for these tiny models), so
the project's loader and other engines' loaders (mlx-lm reads `model*.safetensors`)
see the layout of a released checkpoint.

The Qwen3.5 families are saved the way they are released: transformers' own
multimodal wrapper (`Qwen3_5ForConditionalGeneration`,
`Qwen3_5MoeForConditionalGeneration`) with a small vision tower, text weights
under `model.language_model.*`, plus `mtp.*` tensors that transformers does not
write; released checkpoints carry them in their numbered shards (the last ones),
and so do these. Experts are stored as transformers saves them: individually
(`experts.{e}.{gate,up,down}_proj.weight`, what `save_pretrained` writes by
default) or packed (`experts.gate_up_proj [E, 2I, H]` / `experts.down_proj
[E, H, I]`, gate rows first, `expert_layout="packed"`: transformers' own layout,
written with `save_original_format=False`, the layout released Qwen3.5-MoE
checkpoints use and the one mlx-lm's `qwen3_5_moe` reads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..families import FAMILIES as _REGISTRY
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


# The text tower of the tiny Qwen3.5 families: 4 layers, 3 Gated DeltaNet + 1 gated attention
# (transformers' default `full_attention_interval` 4), the dense geometry's width.
_TINY_QWEN3_5_TEXT: dict[str, Any] = {
    **{k: v for k, v in _TINY_QWEN3.items() if k != "rope_theta"},  # rope lives in `rope_parameters` there
    **dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
           linear_conv_kernel_dim=4),
}
_TINY_QWEN3_5_MOE_EXTRA: dict[str, Any] = dict(
    moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2
)
_TINY_VISION: dict[str, Any] = dict(
    depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4, num_position_embeddings=16
)

FAMILIES = tuple(_REGISTRY)  # every registered family has a tiny builder here
HYBRID_FAMILIES = tuple(name for name, fam in _REGISTRY.items() if fam.hybrid)  # saved as the Qwen3.5 wrapper


def tiny_qwen3_config(**overrides: Any):
    """A dense Qwen3 config small enough for CPU tests (4 layers, hidden 64)."""
    from transformers import Qwen3Config

    return Qwen3Config(**{**_TINY_QWEN3, **overrides})


def tiny_qwen3_moe_config(**overrides: Any):
    """A Qwen3-MoE config small enough for CPU tests (4 experts, top-2)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**_TINY_QWEN3, **_TINY_QWEN3_MOE_EXTRA, **overrides})


def tiny_qwen3_5_config(*, moe: bool = False, **text_overrides: Any):
    """A Qwen3.5 (or Qwen3.5-MoE) multimodal wrapper config: a tiny hybrid text tower and vision tower."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    text = {**_TINY_QWEN3_5_TEXT, **(_TINY_QWEN3_5_MOE_EXTRA if moe else {}), **text_overrides}
    if moe:
        text.pop("intermediate_size", None)  # the MoE text config has no dense MLP width
    cls = Qwen3_5MoeConfig if moe else Qwen3_5Config
    return cls(text_config=text, vision_config=dict(_TINY_VISION), tie_word_embeddings=text["tie_word_embeddings"])


def target_text_config(config):
    """The text tower's config of a transformers target config (a wrapper's `text_config`, else itself)."""
    return getattr(config, "text_config", None) or config


def save_tiny_target(
    path: str | Path,
    *,
    family: str = "qwen3",
    dtype: str = "float32",
    seed: int = 0,
    max_shard_size: str | int = "64KB",
    expert_layout: str = "individual",
    mtp: bool = True,
    **overrides: Any,
):
    """Build a randomly initialised tiny target and `save_pretrained` it (sharded).

    `family`: one of `FAMILIES`. Qwen3.5 families are saved as the multimodal
    wrapper with `mtp.*` tensors added (`mtp=False` leaves them out);
    `expert_layout="packed"` rewrites MoE experts into the packed tensors.
    Returns the in-memory model (in `dtype`) that was saved: the wrapper for
    Qwen3.5 families.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if family not in FAMILIES:
        raise ValueError(f"unknown tiny family `{family}`; use one of {FAMILIES}")
    if expert_layout not in ("individual", "packed"):
        raise ValueError(f"expert_layout must be `individual` or `packed`, found `{expert_layout}`")
    torch.manual_seed(seed)
    if family in HYBRID_FAMILIES:
        from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

        config = tiny_qwen3_5_config(moe=family == "qwen3_5_moe", **overrides)
        cls = Qwen3_5MoeForConditionalGeneration if family == "qwen3_5_moe" else Qwen3_5ForConditionalGeneration
        model = cls(config)
    else:
        config = tiny_qwen3_config(**overrides) if family == "qwen3" else tiny_qwen3_moe_config(**overrides)
        model = AutoModelForCausalLM.from_config(config)
    model = model.to(getattr(torch, dtype)).eval()
    packed = expert_layout == "packed" and family.endswith("_moe")
    # transformers keeps MoE experts packed in memory and converts them back to per-expert tensors on
    # save unless told to keep its own (packed) format
    model.save_pretrained(str(path), max_shard_size=max_shard_size, save_original_format=not packed)
    if mtp and family in HYBRID_FAMILIES:
        add_mtp_tensors(path, target_text_config(config), dtype=getattr(torch, dtype), seed=seed, max_shard_size=max_shard_size)
    return model


def _weight_files(path: Path) -> list[str]:
    """The checkpoint's weight files: those its index names, else the single `model.safetensors`."""
    import json

    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["model.safetensors"]


def _read_tensors(path: Path) -> dict[str, Any]:
    """Every tensor of a saved checkpoint."""
    from safetensors.torch import load_file

    return {k: v for file in _weight_files(path) for k, v in load_file(str(path / file)).items()}


def _save_sharded(path: Path, tensors: dict[str, Any], max_shard_size: str | int) -> None:
    """Replace the checkpoint's weight files by `tensors` sharded as `save_pretrained` shards them:
    huggingface_hub's `split_torch_state_dict_into_shards` (what transformers calls), files
    `model-000NN-of-000MM.safetensors` (or one `model.safetensors`) and the index json."""
    import json

    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    # in name order, so the files depend only on the tensors: a checkpoint packed after saving equals one
    # saved packed, file for file (`mtp.*` sorts after `model.*`, into the last shards, as released)
    tensors = dict(sorted(tensors.items()))
    split = split_torch_state_dict_into_shards(tensors, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size)
    index = path / "model.safetensors.index.json"
    for file in _weight_files(path):
        (path / file).unlink()
    index.unlink(missing_ok=True)
    for file, names in split.filename_to_tensors.items():
        save_file({n: tensors[n].contiguous() for n in names}, str(path / file), metadata={"format": "pt"})
    if split.is_sharded:
        doc = {"metadata": {"total_parameters": sum(t.numel() for t in tensors.values()), **split.metadata},
               "weight_map": split.tensor_to_filename}
        index.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def add_mtp_tensors(path: str | Path, text_config, *, dtype, seed: int = 0, max_shard_size: str | int = "64KB") -> list[str]:
    """Add `mtp.*` tensors (one MTP layer's worth, shapes as released) after the model's own, re-sharded
    as `save_pretrained` would shard them (so they land in the last numbered shards).

    transformers does not write the multi-token-prediction heads; released Qwen3.5
    checkpoints carry them, and the loader must skip them unread. Returns their names.
    """
    import torch

    path = Path(path)
    H = text_config.hidden_size
    gen = torch.Generator().manual_seed(seed + 1)
    shapes = {
        "mtp.fc.weight": (H, 2 * H),
        "mtp.pre_fc_norm_embedding.weight": (H,),
        "mtp.pre_fc_norm_hidden.weight": (H,),
        "mtp.norm.weight": (H,),
        "mtp.layers.0.input_layernorm.weight": (H,),
        "mtp.layers.0.post_attention_layernorm.weight": (H,),
        "mtp.layers.0.mlp.down_proj.weight": (H, 2 * H),
    }
    mtp = {n: (torch.randn(s, generator=gen) * 0.02).to(dtype) for n, s in shapes.items()}
    _save_sharded(path, {**_read_tensors(path), **mtp}, max_shard_size)
    return sorted(mtp)


def pack_experts(path: str | Path, *, max_shard_size: str | int = "64KB") -> int:
    """Rewrite per-expert MoE tensors (`experts.{e}.{gate,up,down}_proj.weight`) of a saved
    checkpoint as packed `experts.gate_up_proj [E, 2I, H]` and `experts.down_proj [E, H, I]`
    (gate rows first: transformers' own layout), re-sharded as `save_pretrained` shards.
    Returns the number of packed layers."""
    import re

    import torch

    path = Path(path)
    pat = re.compile(r"^(?P<base>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
    out: dict[str, Any] = {}
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, t in _read_tensors(path).items():
        m = pat.match(name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(m["base"], {})[(int(m["e"]), m["proj"])] = t
    for base, parts in experts.items():
        n = 1 + max(e for e, _ in parts)
        out[f"{base}.gate_up_proj"] = torch.stack([torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(n)])
        out[f"{base}.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(n)])
    _save_sharded(path, out, max_shard_size)
    return len(experts)


def tiny_dflash2_draft_config(target_config, **overrides: Any) -> dict[str, Any]:
    """config.json contents of a tiny DFlash2 draft for `target_config` (a transformers config).

    Qwen3-style top level plus `dflash_config`; `overrides` replace top-level
    keys, except draft fields (`DRAFT_FIELDS`), which go to `dflash_config`.
    """
    target_config = target_text_config(target_config)
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
    target_config = target_text_config(target_config)
    cfg = tiny_dflash2_draft_config(target_config, **overrides)
    layout = dflash2_draft_shapes(cfg) if shapes is None else shapes
    gen = torch.Generator().manual_seed(seed)
    tensors = {n: (torch.randn(s, generator=gen) * 0.02).to(getattr(torch, dtype)) for n, s in layout.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return cfg
