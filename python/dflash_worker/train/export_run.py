"""Export the selected checkpoint of a run (BF16 or AF4G64) with its provenance chain.

The values written come from `params.export_values`, the same conversion
validation measured. Export never touches a live model's parameters: it reads
the committed checkpoint, so a failed export cannot disturb training state.

Which tensors AF4G64 quantizes: the recipe's `[train].qat_scope` selector
(``selector_context`` by default, ``full_projection`` for every projection),
applied to the whole draft; a tensor that is quantized but was not trained is
quantized from its released value.

Provenance chain in ``manifest.json`` (``provenance``): data (prepared-data
manifest sha256) -> split (split fingerprint) -> capture (capture manifest
sha256) -> recipe (fingerprint and resolved recipe) -> checkpoint (step and
checkpoint manifest sha256; with an interpolated selection, ``interpolation_alpha``: the values are
``theta(alpha)`` between the released draft and that checkpoint, `interpolate`) -> export (format).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, ExportError
from ..manifest import sha256_file
from ..recipe import Recipe
from . import checkpoint as ckpt
from .interpolate import selected_trainable
from .params import export_values

SELECTION = "selection.json"


@dataclass(frozen=True)
class RunExport:
    out_dir: Path
    fmt: str
    manifest: dict[str, Any]


def export_dir_name(fmt: str) -> str:
    return "export" if fmt == "bf16" else f"export-{fmt}"


def quant_names_for(draft_dir: Path, qat_scope: str) -> list[str]:
    """Names the AF4G64 scope selector picks on the draft (built on the meta device)."""
    from ..model import DraftConfig, DraftModel, quant

    with torch.device("meta"):
        model = DraftModel(DraftConfig.from_file(draft_dir))
    sel = quant.selector_context if qat_scope == "selector_context" else quant.full_projection
    return list(sel(model).names)


def provenance(recipe: Recipe, checkpoint_dir: Path, fmt: str, alpha: float | None = None) -> dict[str, Any]:
    """The provenance chain of an export of `checkpoint_dir` (module docstring); `alpha`: the export is
    ``theta(alpha)`` between the released draft and that checkpoint (`interpolate`), recorded in
    ``checkpoint.interpolation_alpha``."""
    from ..data import PreparedData

    cap = recipe.require("capture")
    data_manifest = recipe.data.dir / "manifest.json"
    split_fp = None
    try:
        split_fp = PreparedData(recipe.data.dir, verify=False).split_fingerprint
    except Exception:  # noqa: BLE001 - provenance records what it can; the hash below still pins the data
        split_fp = None
    return {
        "data": {"dir": str(recipe.data.dir), "manifest_sha256": sha256_file(data_manifest) if data_manifest.is_file() else None},
        "split": {"fingerprint": split_fp},
        "capture": {"dir": str(cap.output), "manifest_sha256": sha256_file(cap.output / "manifest.json")},
        "recipe": {"fingerprint": recipe.fingerprint(), "resolved": recipe.resolved()},
        "checkpoint": {
            "step": int(checkpoint_dir.name.split("-")[1]),
            "name": checkpoint_dir.name,
            "manifest_sha256": sha256_file(checkpoint_dir / "manifest.json"),
            **({} if alpha is None else {"interpolation_alpha": alpha}),
        },
        "export": {"format": fmt},
        # manifests are written with sorted keys; this keeps the order of the chain
        "chain": ["data", "split", "capture", "recipe", "checkpoint", "export"],
    }


def _drop_none(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _drop_none(v) for k, v in obj.items() if v is not None}
    return obj


def recipe_from_state(run_dir: str | Path, selection: dict[str, Any]) -> Recipe:
    """The resolved recipe stored in the selected checkpoint (the run's source of truth)."""
    from ..recipe import recipe_from_dict

    run_dir = Path(run_dir)
    path = run_dir / ckpt.CHECKPOINTS / selection["checkpoint"]
    state = ckpt.load(path).state
    return recipe_from_dict(_drop_none(state["recipe"]), base=run_dir, source=str(path / "state.json"))


def read_selection(run_dir: str | Path) -> dict[str, Any]:
    """The run's `selection.json` (written last by `train`: it marks a completed run)."""
    run_dir = Path(run_dir)
    try:
        return json.loads((run_dir / SELECTION).read_text())
    except FileNotFoundError:
        raise ExportError(
            f"run `{run_dir}` has no `{SELECTION}`: training has not completed\nhint: finish it with `dflash-worker train --resume`"
        ) from None


def export_run(
    run_dir: str | Path,
    *,
    fmt: str,
    recipe: Recipe,
    selection: dict[str, Any] | None = None,
    out_dir: str | Path | None = None,
    overwrite: bool = True,
) -> RunExport:
    """Export the selected (or given) checkpoint of `run_dir` in `fmt` (``bf16`` | ``af4g64``)."""
    run_dir = Path(run_dir)
    if fmt not in ("bf16", "af4g64"):
        raise ConfigError(f"unknown export format `{fmt}`\nhint: use `bf16` or `af4g64`")
    if selection is None:
        selection = read_selection(run_dir)
    path = run_dir / ckpt.CHECKPOINTS / selection["checkpoint"]
    released = recipe.model.draft
    loaded, trainable = selected_trainable(run_dir, released, selection)
    names = list(loaded.state["trainable"])
    cfg = recipe.require("train")
    out = Path(out_dir) if out_dir is not None else run_dir / export_dir_name(fmt)
    extra = {"provenance": provenance(recipe, path, fmt, (selection.get("interpolation") or {}).get("alpha"))}
    if fmt == "bf16":
        from ..export.bf16 import write_bf16

        values = export_values(trainable, names)
        res = write_bf16(released, values, out, manifest_extra=extra, overwrite=overwrite)
        return RunExport(res.out_dir, fmt, res.manifest)

    from safetensors.torch import load_file

    from ..export.af4g64 import write_af4g64

    qnames = quant_names_for(released, cfg.qat_scope)
    tensors: dict[str, torch.Tensor] = {}
    from ..weights import resolve_checkpoint

    for shard in resolve_checkpoint(released).shards:
        for key, t in load_file(str(shard.path)).items():
            name = key[: -len(".weight")] if key.endswith("_codebook.weight") else key
            tensors[name] = t
    trained_bf16 = export_values(trainable, [n for n in names if n not in qnames])
    for n in names:
        tensors[n] = trainable[n].float() if n in qnames else trained_bf16[n]
    from ..export.bf16 import export_config

    _, config, extra["config_added"] = export_config(released)  # the fields serving engines read, where they read them
    res = write_af4g64(tensors, config, out, qnames, manifest_extra=extra, overwrite=overwrite)
    return RunExport(res.out_dir, fmt, res.manifest)


def verify_export(out_dir: str | Path) -> dict[str, Any]:
    """Check an export directory's files against its manifest (either format)."""
    from ..export.bf16 import read_export_manifest, verify_bf16

    out_dir = Path(out_dir)
    manifest = read_export_manifest(out_dir)
    if str(manifest.get("format", "")).endswith("bf16/v1"):
        return verify_bf16(out_dir, manifest)
    from ..export.af4g64 import read_manifest

    return read_manifest(out_dir)
