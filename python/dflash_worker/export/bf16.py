"""BF16 export of a trained draft in the released upstream layout.

``write_bf16(released_dir, trained, out_dir)`` writes ``model.safetensors`` +
``config.json`` + ``manifest.json``:

- tensor names, order and spelling follow the released draft (selector
  codebooks without ``.weight``, which the upstream
  ``DFlash2DraftModel.from_pretrained`` maps itself; a released file using the
  ``.weight`` spelling is written in the released spelling too);
- every tensor in `trained` (BF16, produced by
  `dflash_worker.train.params.export_values`) replaces the released tensor of
  the same name; every other tensor is copied byte for byte from the released
  file (same dtype, same bytes), so tensors outside the trained scope are
  identical to the released draft;
- ``config.json`` is the released draft's file, byte for byte, when every
  serving engine finds each field it reads where it reads it; otherwise the
  released dict plus the missing copies (`export_config`,
  `serving.fields.complete_config`: e.g. `block_size` at the top level for
  llama.cpp's converter, `final_logit_softcapping` inside `dflash_config` for
  vLLM), never a changed value; the manifest's ``config_added`` lists them;
- every floating tensor is checked finite first; a NaN or Inf raises
  `ExportError` naming the tensor, and nothing is written;
- ``manifest.json`` holds sha256 and size per file, sha256 per tensor (so
  "untouched" is checkable against the released file) and the caller's
  provenance;
- the directory is committed by `export.commit.commit_dir` (a temporary
  sibling, fsynced and renamed into place); an existing `out_dir` is replaced
  only when `overwrite` is set, only after the new one is complete, and is put
  back if the commit fails.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ExportError
from ..manifest import pretty_json, sha256_file, software_versions
from .commit import commit_dir, write_file

FORMAT = "dflash-worker/export-bf16/v1"
WEIGHTS = "model.safetensors"
_CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


@dataclass(frozen=True)
class BF16Export:
    out_dir: Path
    manifest: dict[str, Any]


def _our_name(released_key: str) -> str:
    for name in _CODEBOOKS:
        if released_key == name + ".weight":
            return name
    return released_key


def _released_tensors(released_dir: Path):
    """[(released key, TensorInfo, file path)] in file order across shards."""
    from ..weights import resolve_checkpoint

    out = []
    for shard in resolve_checkpoint(released_dir).shards:
        for key, info in shard.tensors.items():
            out.append((key, info, shard.path))
    return out


def export_config(released_dir: str | Path) -> tuple[bytes, dict[str, Any], list[str]]:
    """The export's `config.json` from the released draft's: `(bytes, dict, added paths)`.

    The released bytes when nothing is missing, so an export of a complete config keeps the file
    byte for byte; else the completed dict as pretty JSON."""
    from ..serving.fields import complete_config

    path = Path(released_dir) / "config.json"
    try:
        data = path.read_bytes()
        raw = json.loads(data)
    except (OSError, ValueError) as exc:
        raise ExportError(f"released draft config `{path}` is not readable JSON: {exc}") from None
    cfg, added = complete_config(raw, source=str(path))
    return (pretty_json(cfg) if added else data), cfg, added


def _read(path: Path, begin: int, end: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(begin)
        data = f.read(end - begin)
    if len(data) != end - begin:
        raise ExportError(f"released draft file `{path}` is truncated")
    return data


def _check_finite(name: str, t: torch.Tensor) -> None:
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ExportError(
            f"refusing to export: tensor `{name}` has `{bad}` non-finite values (NaN or Inf)\n"
            "hint: the run diverged; lower `[train].lr` or select an earlier checkpoint"
        )


def _plan(entries: list, trained: Mapping[str, torch.Tensor], released_dir: Path) -> list[tuple[str, str, list[int], bytes]]:
    """`(released key, dtype, shape, bytes)` of every tensor to write, in released order: the trained
    value where there is one, else the released bytes. Checks every tensor first; nothing is written."""
    from ..weights.dtypes import TORCH_DTYPES

    released_names = {_our_name(k) for k, _, _ in entries}
    unknown = sorted(set(trained) - released_names)
    if unknown:
        raise ExportError(f"trained tensors `{unknown[:5]}` do not exist in the released draft `{released_dir}`")
    plan = []
    for key, info, path in entries:
        name = _our_name(key)
        if name in trained:
            t = trained[name].detach().to("cpu")
            if t.dtype != torch.bfloat16:
                raise ExportError(f"trained tensor `{name}` is `{t.dtype}`, expected `torch.bfloat16`")
            if tuple(t.shape) != tuple(info.shape):
                raise ExportError(f"trained tensor `{name}` has shape `{tuple(t.shape)}`, released `{tuple(info.shape)}`")
            _check_finite(name, t)
            plan.append((key, "BF16", list(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes()))
        else:
            raw = _read(path, info.begin, info.end)
            dt = TORCH_DTYPES[info.dtype]
            if dt.is_floating_point and info.numel:
                _check_finite(name, torch.frombuffer(bytearray(raw), dtype=dt).float())
            plan.append((key, info.dtype, list(info.shape), raw))
    return plan


def _write_weights(path: Path, plan: list[tuple[str, str, list[int], bytes]], fault: Any) -> None:
    """`model.safetensors` (`weights.write`): the planned tensors in order, metadata `{"format": "pt"}`.
    `fault(i, key)`, when given, runs before tensor `i`'s bytes are written (tests inject failures)."""
    from ..weights.write import RawTensor, write_safetensors

    def parts(i: int, key: str, data: bytes):
        if fault is not None:
            fault(i, key)
        yield data

    tensors = {key: RawTensor(dtype, tuple(shape), parts(i, key, data)) for i, (key, dtype, shape, data) in enumerate(plan)}
    write_safetensors(path, tensors, {"format": "pt"})


def write_bf16(
    released_dir: str | Path,
    trained: Mapping[str, torch.Tensor],
    out_dir: str | Path,
    *,
    manifest_extra: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    _fault: Any = None,
) -> BF16Export:
    """Write the export (see module docstring). `trained`: our parameter name -> BF16 tensor."""
    released_dir, out_dir = Path(released_dir), Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise ExportError(f"export directory `{out_dir}` already exists\nhint: pass `overwrite=True` (CLI: `--overwrite`)")
    entries = _released_tensors(released_dir)
    plan = _plan(entries, trained, released_dir)  # every tensor checked before anything is written
    config_bytes, _, config_added = export_config(released_dir)

    def fill(tmp: Path) -> dict[str, Any]:
        _write_weights(tmp / WEIGHTS, plan, _fault)
        write_file(tmp / "config.json", config_bytes)
        files = {name: {"sha256": sha256_file(tmp / name), "size": (tmp / name).stat().st_size} for name in (WEIGHTS, "config.json")}
        manifest = {
            "format": FORMAT,
            "files": files,
            "tensors": {key: hashlib.sha256(data).hexdigest() for key, _, _, data in plan},
            "trained": sorted(k for k, *_ in plan if _our_name(k) in trained),
            "config_added": config_added,
            "released": {
                "dir": str(released_dir),
                "files": {p.name: sha256_file(p) for p in sorted({p for _, _, p in entries})},
                "config_sha256": sha256_file(released_dir / "config.json"),
            },
            "software": software_versions(),
            **dict(manifest_extra or {}),
        }
        write_file(tmp / "manifest.json", pretty_json(manifest))
        return manifest

    manifest = commit_dir(out_dir, fill, overwrite=overwrite)
    return BF16Export(out_dir, manifest)


def read_export_manifest(out_dir: str | Path) -> dict[str, Any]:
    """An export directory's `manifest.json` (either format), or an `ExportError` naming the directory."""
    out_dir = Path(out_dir)
    try:
        return json.loads((out_dir / "manifest.json").read_bytes())
    except (OSError, ValueError) as exc:
        raise ExportError(f"export `{out_dir}` has no readable `manifest.json`: {exc}") from None


def verify_bf16(out_dir: str | Path, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check an export directory against its manifest (file sha256s); returns the manifest."""
    out_dir = Path(out_dir)
    if manifest is None:
        manifest = read_export_manifest(out_dir)
    for name, want in (manifest.get("files") or {}).items():
        p = out_dir / name
        if not p.is_file() or sha256_file(p) != want.get("sha256"):
            raise ExportError(f"export file `{p}` is missing or does not match its manifest sha256")
    return manifest
