"""Load and save drafts in the released upstream layout.

A draft directory holds `config.json` (Qwen3-style, draft fields under
`dflash_config`) and safetensors weights (single file or sharded with an
index). Released DFlash2 checkpoints name the selector codebooks
`candidate_selector.predecessor_codebook` / `.successor_codebook` without a
`.weight` suffix; files written by the upstream `save_pretrained` carry the
suffix. Both load; we always save the released spelling, which the upstream
`DFlash2DraftModel.from_pretrained` maps back itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..errors import CheckpointError, ExportError
from .config import DraftConfig
from .draft import DraftModel

_CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def _codebook_alias(key: str) -> str:
    """Map the `save_pretrained` spelling (`...codebook.weight`) onto our parameter names."""
    for name in _CODEBOOKS:
        if key == name + ".weight":
            return name
    return key


def _checkpoint_dtype(path: Path) -> torch.dtype:
    from ..weights import resolve_checkpoint
    from ..weights.dtypes import TORCH_DTYPES

    for shard in resolve_checkpoint(path).shards:
        for info in shard.tensors.values():
            dt = TORCH_DTYPES[info.dtype]
            if dt.is_floating_point:
                return dt
    return torch.float32


def load_draft(path: str | os.PathLike, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> DraftModel:
    """Load a draft directory by streaming into a model built on the meta device.

    `dtype` None keeps the checkpoint's floating dtype. Raises `ConfigError`
    for a bad config.json and `CheckpointError` for missing, unexpected,
    duplicated or mis-shaped tensors. The `LoadReport` is kept as
    `model.load_report`.
    """
    from ..weights import stream_into

    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"draft checkpoint `{root}` is not a directory\nhint: pass the folder holding config.json and *.safetensors")
    config = DraftConfig.from_file(root / "config.json")
    if dtype is None:
        dtype = _checkpoint_dtype(root)
    with torch.device("meta"):
        model = DraftModel(config)
    report = stream_into(model, root, dtype=dtype, device=device, key_mapping=_codebook_alias, strict=True)
    model.eval()
    model.load_report = report  # type: ignore[attr-defined]
    return model


def save_draft(model: DraftModel, out_dir: str | os.PathLike, *, dtype: torch.dtype | None = None) -> Path:
    """Write `config.json` + `model.safetensors` (released layout) into `out_dir`; returns the directory.

    Files are written to temporaries, fsynced and renamed, so a crash never
    leaves a half-written file under the final name. `dtype` casts floating
    tensors (default: as they are).
    """
    from ..manifest import write_bytes_atomic
    from ..weights.write import safetensors_order, write_safetensors

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if t.is_meta:
            raise ExportError(f"tensor `{name}` was never loaded (meta device); refusing to save")
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        tensors[name] = t.to("cpu").contiguous()
    floats = {t.dtype for t in tensors.values() if t.is_floating_point()}
    cfg = model.config.to_dict()
    if len(floats) == 1:
        cfg["dtype"] = str(next(iter(floats))).removeprefix("torch.")
    # `safetensors_order` with one metadata key: the bytes `safetensors.torch.save_file` wrote
    # here before, so drafts saved by older versions hash the same
    write_safetensors(out / "model.safetensors", safetensors_order(tensors), metadata={"format": "pt"})
    write_bytes_atomic(out / "config.json", (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode("utf-8"))
    return out


def read_target_layer_ids(draft_dir: str | Path) -> list[int]:
    """`target_layer_ids` of a released draft: `dflash_config.target_layer_ids` first, then top level."""
    cfg = Path(draft_dir) / "config.json"
    try:
        doc = json.loads(cfg.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"`{cfg}` not found\nhint: `[model].draft` must be the released draft's dir") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read `{cfg}`: {exc}") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"`{cfg}` is not a JSON object")
    sub = doc.get("dflash_config")
    ids = sub.get("target_layer_ids") if isinstance(sub, dict) else None
    if ids is None:
        ids = doc.get("target_layer_ids")
    if ids is None:
        raise CheckpointError(f"`{cfg}` has no `target_layer_ids` (looked in `dflash_config`, then top level)")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"`{cfg}`: `target_layer_ids` must be a non-empty list of non-negative integers, found `{ids}`")
    if len(set(ids)) != len(ids):
        raise CheckpointError(f"`{cfg}`: `target_layer_ids` has repeats: `{ids}`")
    return list(ids)
