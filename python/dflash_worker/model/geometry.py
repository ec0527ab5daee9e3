"""Geometry of a fresh draft for a target: the rules behind `dflash-worker init-draft`.

A draft shares the target's width, vocabulary, attention shape and rotary
setup (its blocks are embedded with the target's embedding and scored by the
target's head), so those always come from the target's `config.json`. What a
geometry chooses is the rest:

``standard``
    5 decoder layers (all full attention), block size 16, the MLP width of
    the target, 5 feature taps spread evenly over target layers 1 .. L-3
    (`default_target_layer_ids`, repeats dropped on a shallow target). A
    DFlash2 draft adds a rank-64, top-16 candidate selector and convolutions
    of kernel 4 with the largest group size in (64, 32, 16, 8, 4, 2, 1)
    that divides the width. These are this project's defaults for a new
    draft, not a copy of any released file: to match a released draft, pass
    its `config.json` as the geometry.

    Qwen3.5 targets follow the layout of the drafts released for them: dense
    (``qwen3_5``, e.g. 27B: 64 layers) 5 full-attention layers with 5 taps
    (1,16,31,46,61 of 64); MoE (``qwen3_5_moe``, e.g. 35B-A3B: 40 layers)
    6 layers, 5 sliding-window (window 2048) and a last full-attention one,
    with 8 taps spread the same way; block size 16, 8 for DFlash2. The draft's rotary embedding is the
    plain (``default``) one at the target's ``rope_theta`` over the whole
    head: the target's partial and multimodal rotary settings belong to its
    own attention, not to the draft's.
``tiny``
    The layout of the test world (`dflash_worker.testing.tiny_draft`): 2
    layers (the first a causal sliding-window layer of 6 positions), block
    size 4, MLP width 2 x hidden, taps at target layers {0, L/2, L-2}; for
    DFlash2 a rank-8, top-64 selector (top-k capped at the vocabulary) and
    kernel-3, group-16 convolutions.
``FILE``
    A draft `config.json` (or a directory holding one): its layer count,
    layer types, sliding window, MLP width, block size, taps and DFlash2
    fields are kept; width and vocabulary must equal the target's.

The mask token, unless given, is the tokenizer's own mask token when it has
one, else the first vocabulary id the tokenizer never produces (ids from
`len(tokenizer)` up to `vocab_size`; this is the id a `<|MASK|>` token added
to a Qwen3 tokenizer gets), else the last vocabulary id, with a warning that
it shadows a real token.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .config import DFLASH, DFLASH2, DRAFT_FIELDS, FULL_ATTENTION, SLIDING_ATTENTION, DraftConfig, default_target_layer_ids

GEOMETRIES = ("standard", "tiny")

# Target config keys a draft copies as they are (rotary setup and context length).
_ROTARY_KEYS = ("rope_parameters", "rope_theta", "rope_scaling", "max_position_embeddings", "partial_rotary_factor")
_DFLASH2_FIELDS = ("selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size")


@dataclass
class DraftPlan:
    """A draft `config.json` dict (released layout) and the decisions behind it, for the summary."""

    config: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _target_int(cfg: dict[str, Any], name: str, where: Path) -> int:
    value = cfg.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"target config `{where}`: `{name}` must be a positive integer, found `{value!r}`")
    return value


def _group_size(hidden: int) -> int:
    return next(g for g in (64, 32, 16, 8, 4, 2, 1) if hidden % g == 0)


def _draft_rope(t: dict[str, Any]) -> dict[str, Any]:
    """The rotary keys a draft copies from a (text) target config; see the module docstring."""
    rp = t.get("rope_parameters")
    if t.get("model_type", "").startswith("qwen3_5") and isinstance(rp, dict):
        theta = rp.get("rope_theta", t.get("rope_theta", 10000.0))
        out = {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
        if "max_position_embeddings" in t:
            out["max_position_embeddings"] = t["max_position_embeddings"]
        return out
    return {key: copy.deepcopy(t[key]) for key in _ROTARY_KEYS if key in t}


def _shared_with_target(t: dict[str, Any], where: Path) -> dict[str, Any]:
    """The fields a draft must share with its target (`t`: the text tower's config)."""
    hidden = _target_int(t, "hidden_size", where)
    heads = _target_int(t, "num_attention_heads", where)
    out = {
        "model_type": "qwen3",
        "vocab_size": _target_int(t, "vocab_size", where),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": t.get("num_key_value_heads") or heads,
        "head_dim": t.get("head_dim") or hidden // heads,
        "rms_norm_eps": t.get("rms_norm_eps", 1e-6),
        "num_target_layers": _target_int(t, "num_hidden_layers", where),
    }
    out.update(_draft_rope(t))
    return out


# Released-draft layouts for the Qwen3.5 families: (layers, sliding-window layers, taps, sliding window).
_QWEN3_5_STANDARD = {"qwen3_5": (5, 0, 5, None), "qwen3_5_moe": (6, 5, 8, 2048)}


def _standard(t: dict[str, Any], shared: dict[str, Any], kind: str, layers: int | None, family: str) -> dict[str, Any]:
    n_default, n_sliding, n_taps, window = _QWEN3_5_STANDARD.get(family, (5, 0, None, None))
    n = layers or n_default
    n_sliding = min(n_sliding, n - 1)
    L = shared["num_target_layers"]
    taps = sorted(set(default_target_layer_ids(L, n_taps or n))) if L >= 4 else [L // 2]
    cfg = {
        **shared,
        "intermediate_size": t.get("intermediate_size") or 4 * shared["hidden_size"],
        "num_hidden_layers": n,
        "layer_types": [SLIDING_ATTENTION] * n_sliding + [FULL_ATTENTION] * (n - n_sliding),
        "dflash_config": {"target_layer_ids": taps, "block_size": 16},
    }
    if n_sliding:
        cfg.update(use_sliding_window=True, sliding_window=window)
    if family in _QWEN3_5_STANDARD and kind == DFLASH2:
        cfg["dflash_config"]["block_size"] = 8  # the released DFlash2 drafts' block; DFlash (v1) keeps 16
    if kind == DFLASH2:
        cfg["dflash_config"].update(
            selector_rank=64, selector_top_k=min(16, shared["vocab_size"]), conv_kernel_size=4,
            conv_group_size=_group_size(shared["hidden_size"]),
        )
    return cfg


def _tiny(shared: dict[str, Any], kind: str, layers: int | None) -> dict[str, Any]:
    n = layers or 2
    L = shared["num_target_layers"]
    cfg = {
        **shared,
        "intermediate_size": 2 * shared["hidden_size"],
        "num_hidden_layers": n,
        "layer_types": ([SLIDING_ATTENTION] + [FULL_ATTENTION] * n)[:n],
        "use_sliding_window": True,
        "sliding_window": 6,
        "dflash_config": {"target_layer_ids": sorted({0, L // 2, max(L - 2, 0)}), "block_size": 4},
    }
    if kind == DFLASH2:
        cfg["dflash_config"].update(
            selector_rank=8, selector_top_k=min(64, shared["vocab_size"]), conv_kernel_size=3,
            conv_group_size=math.gcd(16, shared["hidden_size"]),
        )
    return cfg


def _from_file(path: Path, shared: dict[str, Any], kind: str | None, layers: int | None) -> tuple[dict[str, Any], str]:
    file = path / "config.json" if path.is_dir() else path
    src = DraftConfig.from_file(file)  # validates the geometry file on its own
    for name, mine in (("hidden_size", src.hidden_size), ("vocab_size", src.vocab_size)):
        if mine != shared[name]:
            raise ConfigError(
                f"geometry `{file}`: `{name}` is `{mine}` but the target's is `{shared[name]}`"
                "\nhint: a draft shares its target's width and vocabulary; use `--geometry standard` or a draft made for this target"
            )
    if layers is not None and layers != src.num_layers:
        raise ConfigError(
            f"`--layers {layers}` contradicts geometry `{file}` ({src.num_layers} layers)\nhint: drop one of the two"
        )
    # The file's own layer geometry (heads, widths, layer types) stays; the target's rotary setup and depth replace its own.
    cfg = src.to_dict()
    for key in ("dtype", "torch_dtype", "transformers_version", "architectures", *_ROTARY_KEYS):
        cfg.pop(key, None)
    cfg["dflash_config"] = {n: v for n, v in cfg["dflash_config"].items() if n in DRAFT_FIELDS}
    cfg.update({k: v for k, v in shared.items() if k in (*_ROTARY_KEYS, "num_target_layers")})
    return cfg, kind or src.kind


# Files a saved tokenizer consists of (one of them at least). transformers 5 builds an empty
# tokenizer from config.json alone, so loading without them "succeeds" with 1 token.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _mask_token(target: Path, vocab: int, warnings: list[str]) -> tuple[int, str]:
    directory = target if target.is_dir() else target.parent
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        raise ConfigError(
            f"target `{target}` has no tokenizer ({', '.join(f'`{n}`' for n in _TOKENIZER_FILES)}) to choose a mask token from"
            "\nhint: pass `--mask-token-id ID`"
        )
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(target))
    except Exception as exc:  # no tokenizer, or one transformers cannot read
        raise ConfigError(
            f"cannot read the tokenizer of target `{target}` to choose a mask token: {exc}"
            "\nhint: pass `--mask-token-id ID`"
        ) from None
    if tok.mask_token_id is not None and 0 <= tok.mask_token_id < vocab:
        return tok.mask_token_id, f"the tokenizer's mask token `{tok.mask_token}`"
    if len(tok) < vocab:
        return len(tok), f"the first id the tokenizer never produces (tokenizer has {len(tok)} tokens, vocabulary {vocab})"
    last = vocab - 1
    warnings.append(
        f"the tokenizer uses every one of the {vocab} vocabulary ids; mask token {last} shadows the real token "
        f"`{tok.convert_ids_to_tokens(last)}`\nhint: pass `--mask-token-id ID` to choose another"
    )
    return last, "the last vocabulary id"


def plan_draft(
    target: str | Path,
    *,
    geometry: str = "standard",
    kind: str | None = None,
    layers: int | None = None,
    block_size: int | None = None,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
) -> DraftPlan:
    """The config of a fresh draft for `target` (see the module docstring for the rules)."""
    from ..families import detect_family
    from ..weights.checkpoint import read_config_json, text_config

    target = Path(target)
    raw = read_config_json(target)
    where = target / "config.json"
    family = detect_family(raw, where=str(where))
    t = text_config(raw)
    if kind is not None and kind not in (DFLASH, DFLASH2):
        raise ConfigError(f"unknown draft kind `{kind}`\nhint: use `dflash2` or `dflash` (v1)")
    if layers is not None and layers <= 0:
        raise ConfigError(f"`--layers` must be a positive integer, found `{layers}`")
    shared = _shared_with_target(t, where)
    plan = DraftPlan(config={})
    if geometry in GEOMETRIES:
        kind = kind or DFLASH2
        cfg = _standard(t, shared, kind, layers, family.name) if geometry == "standard" else _tiny(shared, kind, layers)
        plan.notes.append(f"geometry `{geometry}` for a {family.name} target of {shared['num_target_layers']} layers")
    else:
        path = Path(geometry)
        if not path.exists():
            raise ConfigError(
                f"geometry `{geometry}` is neither a built-in geometry nor an existing file"
                f"\nhint: use one of {', '.join(f'`{g}`' for g in GEOMETRIES)}, or a draft's config.json"
            )
        cfg, kind = _from_file(path, shared, kind, layers)
        plan.notes.append(f"geometry from `{path}`")
    sub = cfg["dflash_config"]
    if kind == DFLASH:
        for name in _DFLASH2_FIELDS:
            sub.pop(name, None)
    elif any(sub.get(name) is None for name in _DFLASH2_FIELDS):
        raise ConfigError(
            f"geometry `{geometry}` has no DFlash2 selector and convolution fields ({', '.join(_DFLASH2_FIELDS)})"
            "\nhint: pass `--kind dflash` for a DFlash (v1) draft, or a DFlash2 geometry"
        )
    if block_size is not None:
        sub["block_size"] = block_size
    if target_layer_ids is not None:
        sub["target_layer_ids"] = list(target_layer_ids)
    if mask_token_id is None:
        mask_token_id, why = _mask_token(target, shared["vocab_size"], plan.warnings)
        plan.notes.append(f"mask_token_id {mask_token_id}: {why}")
    sub["mask_token_id"] = mask_token_id
    cfg["architectures"] = ["DFlash2DraftModel" if kind == DFLASH2 else "DFlashDraftModel"]
    DraftConfig.from_dict(cfg, source=f"draft for `{target}`")  # every field validated, taps in range
    plan.config = cfg
    return plan


def write_fresh_draft(plan: DraftPlan, out_dir: str | Path, *, seed: int = 0, dtype: str = "bfloat16") -> dict[str, Any]:
    """Build the planned draft with seeded random weights and save it in the released layout.

    Returns a summary: kind, parameter count, the saved files' sha256."""
    import torch

    from ..manifest import sha256_file
    from .draft import build_draft
    from .io import save_draft

    cfg = DraftConfig.from_dict(plan.config)
    model = build_draft(cfg, seed=seed)
    out = save_draft(model, out_dir, dtype={"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype])
    return {
        "output": str(out),
        "kind": cfg.kind,
        "parameters": sum(p.numel() for p in model.parameters()),
        "num_layers": cfg.num_layers,
        "block_size": cfg.block_size,
        "target_layer_ids": list(cfg.target_layer_ids),
        "mask_token_id": cfg.mask_token_id,
        "seed": seed,
        "dtype": dtype,
        "files": {p.name: sha256_file(p) for p in sorted(out.iterdir()) if p.is_file()},
        "notes": plan.notes,
        "warnings": plan.warnings,
    }


def parse_ids(text: str) -> list[int]:
    """`--target-layer-ids 1,5,9` (or a JSON list) -> [1, 5, 9]."""
    text = text.strip()
    try:
        ids = json.loads(text) if text.startswith("[") else [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"`--target-layer-ids` is `{text}`\nhint: give integers separated by commas, e.g. `1,5,9`") from None
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"`--target-layer-ids` is `{text}`\nhint: give integers separated by commas, e.g. `1,5,9`")
    return ids
