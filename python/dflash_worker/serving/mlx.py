"""Load the project's draft exports into MLX (a Mac, or `mlx[cpu]` on Linux) for speculative decoding.

`load_draft(path)` returns z-lab's MLX draft model (`dflash.model_mlx.DFlashDraftModel` or
`DFlash2DraftModel`, from `dflash` 0.1.0) with the export's weights, ready for that package's
`stream_generate` beside a target loaded by mlx-lm (`mlx_lm.utils.load_model` / `mlx_lm.load`).
Both export formats load:

- BF16 (`export/`): tensors as they are; the selector codebooks, stored without `.weight` as
  released drafts store them, are mapped onto z-lab's `nn.Embedding` parameters.
- AF4G64 (`export-af4g64/`): `config.json`'s `quantization` block (`group_size`, `bits`, `mode`)
  is read, as mlx-lm's own loader reads it, and every module with a `<name>.scales` tensor is
  replaced by its quantized form (`mlx.nn.quantize`) with that group size and bits before the
  load. z-lab's own `load_draft` skips this step, which is why it refuses an AF4G64 export
  (`Received 4 parameters not in model: ...biases, ..., fc.scales`).

The load is strict and checked before any weight is assigned: every tensor the model expects must
be in the files with the shape it expects, nothing may be left over, and each quantized tensor's
shapes must agree with the group size and bits the config declares (mlx-lm infers the group size
from the shapes instead, so a config whose block disagrees with its tensors loads there unnoticed).
Every refusal names the file and tensor.

Importing this module imports MLX, mlx-lm and `dflash`; nothing else in `dflash_worker` does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

from ..errors import CheckpointError, ConfigError
from ..model.config import DFLASH2, DraftConfig

# Released drafts store the selector codebooks without `.weight`; z-lab's MLX selector holds them as
# `nn.Embedding` modules, whose parameter is `<name>.weight`.
_CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
_MODES = ("affine",)  # the one mode the project exports (AF4G64); MLX's others carry no biases


def load_draft(path: str | Path):
    """Load the draft export in directory `path` (BF16 or AF4G64) as z-lab's MLX draft model.

    Returns a `dflash.model_mlx.DFlash2DraftModel` (or `DFlashDraftModel` for a DFlash v1 draft)
    in eval mode with every weight evaluated; pass it with an mlx-lm target to
    `dflash.model_mlx.stream_generate`. Raises `ConfigError` for an unreadable config or a
    quantization block it cannot apply, `CheckpointError` for missing, unexpected or mis-shaped
    tensors.
    """
    from dflash.model_mlx import DFlash2DraftModel, DFlashDraftModel

    root = Path(path)
    if not (root / "config.json").is_file():
        raise CheckpointError(f"`{root}` has no config.json\nhint: pass the export directory (`export/` or `export-af4g64/`)")
    config = DraftConfig.from_file(root / "config.json")
    weights, files = _read_weights(root)
    model_class = DFlash2DraftModel if config.kind == DFLASH2 else DFlashDraftModel
    model = model_class(zlab_config(config))
    if config.kind == DFLASH2:
        for name in _CODEBOOKS:
            if name in weights:
                weights[f"{name}.weight"] = weights.pop(name)
                files[f"{name}.weight"] = files.pop(name)
    quantization = _quantization(config, root)
    quantized = sorted(k[: -len(".scales")] for k in weights if k.endswith(".scales"))
    if quantized and quantization is None:
        raise CheckpointError(
            f"`{files[quantized[0] + '.scales']}` holds quantized tensors (`{quantized[0]}.scales`) but "
            f"`{root / 'config.json'}` has no `quantization` block\nhint: an AF4G64 export's config.json carries "
            '`"quantization": {"group_size": 64, "bits": 4, "mode": "affine"}`; restore the exported file'
        )
    if quantization is not None:
        if not quantized:
            raise CheckpointError(
                f"`{root / 'config.json'}` declares `quantization` `{quantization}` but no tensor in `{root}` has `.scales`\n"
                "hint: the weights are not the AF4G64 export this config belongs to"
            )
        _quantize(model, quantized, quantization, weights, files, root)
    _check_against_model(model, weights, files, root)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    return model


def zlab_config(config: DraftConfig):
    """z-lab's `dflash.model_mlx.DFlashConfig` for a parsed draft config (fields read as upstream does:
    `dflash_config` first, then the top level; rope from `rope_theta` or `rope_parameters`)."""
    from dflash.model_mlx import DFlashConfig

    raw = config.raw
    rope = raw.get("rope_parameters") or raw.get("rope_scaling")
    rope_theta = raw.get("rope_theta", (rope or {}).get("rope_theta", 10000.0))
    return DFlashConfig(
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=float(rope_theta),
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        block_size=config.block_size,
        target_layer_ids=tuple(config.target_layer_ids),
        num_target_layers=config.num_target_layers or 0,
        mask_token_id=config.mask_token_id,
        rope_scaling=rope,
        layer_types=tuple(config.layer_types),
        sliding_window=config.sliding_window,
        final_logit_softcapping=config.final_logit_softcapping,
        input_embedding_scale=config.input_embedding_scale,
        output_multiplier=config.output_multiplier,
        conv_kernel_size=config.conv_kernel_size or 0,
        conv_group_size=config.conv_group_size or 0,
        selector_rank=config.selector_rank or 0,
        selector_top_k=config.selector_top_k or 0,
        is_causal=config.is_causal,
    )


def _weight_files(root: Path) -> list[Path]:
    """The safetensors files of `root`: those its index names when it has one, else every `*.safetensors`."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            return [root / f for f in sorted(set(weight_map.values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"cannot read `{index}`: {exc}") from exc
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"`{root}` has no *.safetensors\nhint: pass the export directory")
    return files


def _read_weights(root: Path) -> tuple[dict[str, Any], dict[str, Path]]:
    """Every tensor of the export as an MLX array, and the file each came from."""
    weights: dict[str, Any] = {}
    files: dict[str, Path] = {}
    for file in _weight_files(root):
        try:
            arrays = mx.load(str(file))
        except (OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"cannot read `{file}`: {exc}") from exc
        for name, array in arrays.items():
            if name in weights:
                raise CheckpointError(f"tensor `{name}` is in both `{files[name]}` and `{file}`")
            weights[name], files[name] = array, file
    return weights, files


def _quantization(config: DraftConfig, root: Path) -> dict[str, Any] | None:
    """config.json's `quantization` block, validated (None when the export is not quantized)."""
    q = config.raw.get("quantization")
    if q is None:
        return None
    where = root / "config.json"
    if not isinstance(q, dict):
        raise ConfigError(f"{where}: `quantization` must be an object, found `{q!r}`")
    for key in ("group_size", "bits"):
        v = q.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{where}: `quantization.{key}` must be a positive integer, found `{v!r}`")
    mode = q.get("mode", "affine")
    if mode not in _MODES:
        raise ConfigError(f"{where}: `quantization.mode` `{mode}` is not supported\nhint: the project exports `affine` (AF4G64)")
    return {"group_size": q["group_size"], "bits": q["bits"], "mode": mode}


def _quantize(model, names: list[str], q: dict[str, Any], weights: dict[str, Any], files: dict[str, Path], root: Path) -> None:
    """Replace each module in `names` by its quantized form with the config's group size and bits,
    after checking that the stored tensors have the shapes those settings give."""
    modules = dict(model.named_modules())
    gs, bits = q["group_size"], q["bits"]
    for name in names:
        module = modules.get(name)
        where = files[f"{name}.scales"]
        if module is None or not hasattr(module, "to_quantized"):
            raise CheckpointError(
                f"`{where}`: `{name}.scales` belongs to no quantizable module of the draft "
                f"(`{type(module).__name__ if module is not None else 'missing'}`)\nhint: the tensor was renamed or the export is of another draft"
            )
        in_dims = module.weight.shape[-1]
        expected = {
            "weight": (module.weight.shape[0], in_dims * bits // 32),
            "scales": (module.weight.shape[0], in_dims // gs),
            "biases": (module.weight.shape[0], in_dims // gs),
        }
        for suffix, shape in expected.items():
            t = weights.get(f"{name}.{suffix}")
            if t is None:
                raise CheckpointError(f"`{where}`: quantized `{name}` has no `{name}.{suffix}`")
            if in_dims % gs or tuple(t.shape) != shape:
                raise CheckpointError(
                    f"`{files[name + '.' + suffix]}`: `{name}.{suffix}` has shape `{list(t.shape)}`, but "
                    f"`quantization` (group_size `{gs}`, bits `{bits}`) in `{root / 'config.json'}` gives "
                    f"`{list(shape)}` for in-features `{in_dims}`\nhint: the config's quantization block does not match "
                    "the tensors; an AF4G64 export is group_size 64, bits 4"
                )
    wanted = set(names)
    nn.quantize(model, group_size=gs, bits=bits, mode=q["mode"], class_predicate=lambda path, _m: path in wanted)


def _check_against_model(model, weights: dict[str, Any], files: dict[str, Path], root: Path) -> None:
    """Refuse missing, unexpected and mis-shaped tensors, naming them and their files."""
    expected = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing `{missing}`")
        if unexpected:
            parts.append("unexpected " + ", ".join(f"`{k}` (in `{files[k]}`)" for k in unexpected))
        raise CheckpointError(
            f"draft export `{root}` does not match its config.json: " + "; ".join(parts)
            + "\nhint: export again from the run (`dflash-worker export`); tensor names follow the released draft"
        )
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise CheckpointError(
                f"`{files[name]}`: tensor `{name}` has shape `{list(weights[name].shape)}`, the draft config gives `{list(shape)}`"
            )
