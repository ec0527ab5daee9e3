"""Write an AF4G64 (MLX affine 4-bit, group 64) export directory.

Layout of ``out_dir`` after :func:`write_af4g64`:

- ``model.safetensors`` (metadata ``{"format": "mlx"}``): each quantized
  projection ``<name>.weight`` becomes ``<name>.weight`` (``uint32 [out, in/8]``,
  packed codes), ``<name>.scales`` and ``<name>.biases`` (``bf16 [out, in/64]``);
  every other floating tensor is stored in BF16 (round to nearest even);
  integer tensors keep their dtype.
- ``config.json``: the caller's config plus
  ``"quantization": {"group_size": 64, "bits": 4, "mode": "affine"}``, which is
  what MLX loaders (mlx-lm's ``nn.quantize`` with a ``.scales`` predicate) read.
- ``manifest.json``: sha256 of every other file, the quantized tensor names,
  the quantizer variant, software versions and the caller's ``manifest_extra``.

``model.safetensors`` is written by `weights.write.write_safetensors` in
`safetensors_order` (dtype, largest element first, then name): the layout
``safetensors.torch.save_file`` gives, which this export used before, so the
bytes are the same and every tensor is aligned to its element size.

Everything is validated before a byte is written (unknown or unquantizable
names, name collisions, non-finite values, BF16 overflow), and the directory is
committed by `export.commit.commit_dir` (a temporary sibling renamed into place),
so a failed export leaves no partial ``out_dir`` behind and an existing one untouched.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, ExportError
from ..manifest import pretty_json, sha256_files, software_versions
from ..model.quant import GROUP_SIZE, MLX_QUANTIZATION, VARIANTS, quantize_af4g64
from .commit import commit_dir, write_file

FORMAT = "af4g64"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.json"
SAFETENSORS_METADATA = {"format": "mlx"}

_RESERVED_MANIFEST_KEYS = ("format", "quantization", "variant", "quantized", "files", "software", "tensors")


@dataclass(frozen=True)
class AF4G64Export:
    """What :func:`write_af4g64` wrote."""

    out_dir: Path
    files: dict[str, str]  # file name -> sha256
    quantized: tuple[str, ...]  # parameter names (with `.weight`) that were quantized
    manifest: dict[str, Any]


def _base(name: str) -> str:
    return name[: -len(".weight")]


def _nonfinite_message(name: str, t: torch.Tensor, what: str) -> str:
    bad = ~torch.isfinite(t)
    count = int(bad.sum())
    first = [int(i) for i in torch.nonzero(bad)[0].tolist()] if count else []
    return (
        f"refusing to export: tensor `{name}` {what} {count} non-finite value(s) "
        f"(first at index `{first}`)\nhint: the weights diverged or were corrupted; export an earlier checkpoint"
    )


def _validate(
    named_tensors: Mapping[str, torch.Tensor], quantize_names: list[str]
) -> None:
    for name, t in named_tensors.items():
        if not isinstance(name, str) or not name:
            raise ExportError(f"refusing to export: tensor name `{name!r}` is not a non-empty string")
        if not isinstance(t, torch.Tensor):
            raise ExportError(f"refusing to export: `{name}` is a `{type(t).__name__}`, expected a torch.Tensor")
        if t.is_complex():
            raise ExportError(f"refusing to export: tensor `{name}` is complex (`{t.dtype}`)")
    for name in quantize_names:
        if name not in named_tensors:
            raise ExportError(
                f"refusing to export: `{name}` is listed for quantization but is not among the tensors\n"
                "hint: names come from the draft's `named_parameters()` and end in `.weight`"
            )
        if not name.endswith(".weight"):
            raise ExportError(f"refusing to export: only `.weight` tensors can be quantized, got `{name}`")
        t = named_tensors[name]
        if not t.is_floating_point() or t.dim() != 2 or t.shape[1] == 0 or t.shape[1] % GROUP_SIZE:
            raise ExportError(
                f"refusing to export: `{name}` (shape `{list(t.shape)}`, dtype `{t.dtype}`) cannot be "
                f"quantized: expected a 2-D float weight whose last dim is a multiple of {GROUP_SIZE}\n"
                "hint: use the scope selectors in `dflash_worker.model.quant`, which skip such tensors"
            )
        for suffix in ("scales", "biases"):
            clash = f"{_base(name)}.{suffix}"
            if clash in named_tensors:
                raise ExportError(
                    f"refusing to export: `{clash}` already exists, so quantized `{name}` cannot be stored"
                )
    for name, t in named_tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ExportError(_nonfinite_message(name, t, "has"))


def _convert(
    named_tensors: Mapping[str, torch.Tensor], quantize_names: list[str], variant: str
) -> dict[str, torch.Tensor]:
    qset = set(quantize_names)
    out: dict[str, torch.Tensor] = {}
    for name, t in named_tensors.items():
        t = t.detach().to("cpu")
        if name in qset:
            try:
                packed, scales, biases = quantize_af4g64(t, variant=variant, name=name)
            except ConfigError as exc:  # pre-validated; kept so nothing escapes untyped
                raise ExportError(str(exc)) from exc
            for suffix, q in (("scales", scales), ("biases", biases)):
                if not bool(torch.isfinite(q).all()):
                    raise ExportError(
                        f"refusing to export: tensor `{name}` quantizes to non-finite {suffix} "
                        f"({int((~torch.isfinite(q)).sum())} group(s)): a group's range overflows "
                        "float32/BF16\nhint: the weights diverged; export an earlier checkpoint"
                    )
            base = _base(name)
            out[f"{base}.weight"] = packed.contiguous()
            out[f"{base}.scales"] = scales.contiguous()
            out[f"{base}.biases"] = biases.contiguous()
        elif t.is_floating_point():
            b = t.to(torch.bfloat16)
            if not bool(torch.isfinite(b).all()):
                raise ExportError(_nonfinite_message(name, b, "overflows BF16 with"))
            # The writer reads each tensor's own bytes, so tied weights and views of one
            # buffer need no copy; `.contiguous()` only where the layout requires one.
            out[name] = b.contiguous()
        else:
            out[name] = t.contiguous()
    return out


def _config(config_dict: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(config_dict, Mapping):
        raise ExportError(f"refusing to export: config is a `{type(config_dict).__name__}`, expected a dict")
    cfg = copy.deepcopy(dict(config_dict))
    existing = cfg.get("quantization")
    if existing is not None and existing != MLX_QUANTIZATION:
        raise ExportError(
            f"refusing to export: config already declares quantization `{existing}`, "
            f"which is not AF4G64 `{MLX_QUANTIZATION}`\nhint: export from an unquantized draft config"
        )
    cfg["quantization"] = dict(MLX_QUANTIZATION)
    try:
        pretty_json(cfg)
    except (TypeError, ValueError) as exc:
        raise ExportError(f"refusing to export: config is not JSON-serialisable: {exc}") from exc
    return cfg


def write_af4g64(
    named_tensors: Mapping[str, torch.Tensor],
    config_dict: Mapping[str, Any],
    out_dir: str | Path,
    quantize_names: Iterable[str],
    manifest_extra: Mapping[str, Any] | None = None,
    *,
    variant: str = "mlx_cpu",
    overwrite: bool = False,
) -> AF4G64Export:
    """Write an AF4G64 export of `named_tensors` to `out_dir` (see the module docstring).

    Args:
        named_tensors: parameter name -> tensor (e.g. a draft's ``named_parameters()``);
            never modified.
        config_dict: the draft's ``config.json`` content; copied, never modified.
        out_dir: destination directory; must not exist unless `overwrite`.
        quantize_names: names (ending in ``.weight``) to store as AF4G64.
        manifest_extra: provenance merged into ``manifest.json`` (input hashes,
            recipe fingerprint, ...); may not reuse the writer's own keys.
        variant: quantizer variant (``"mlx_cpu"`` matches ``mlx.core.quantize`` on CPU).
        overwrite: replace an existing `out_dir` (the old one is removed only
            after the new one is complete).

    Raises:
        ExportError: naming the offending tensor, for every refused input.
    """
    out_dir = Path(out_dir)
    qnames, extra = _check_args(named_tensors, out_dir, quantize_names, manifest_extra, variant=variant, overwrite=overwrite)
    _validate(named_tensors, qnames)
    cfg = _config(config_dict)
    tensors = _convert(named_tensors, qnames, variant)
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "quantization": dict(MLX_QUANTIZATION),
        "variant": variant,
        "quantized": sorted(qnames),
        "tensors": {k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)} for k, v in sorted(tensors.items())},
        "software": software_versions(),
        **extra,
    }
    try:
        pretty_json(manifest)
    except (TypeError, ValueError) as exc:
        raise ExportError(f"refusing to export: manifest_extra is not JSON-serialisable: {exc}") from exc
    files = _write_dir(out_dir, tensors, cfg, manifest, overwrite=overwrite)
    return AF4G64Export(out_dir=out_dir, files=files, quantized=tuple(sorted(qnames)), manifest=manifest)


def _check_args(
    named_tensors: Any, out_dir: Path, quantize_names: Any, manifest_extra: Mapping[str, Any] | None, *,
    variant: str, overwrite: bool,
) -> tuple[list[str], dict[str, Any]]:
    """The arguments' own checks, before any tensor is looked at: `(quantize names, manifest_extra)`."""
    if variant not in VARIANTS:
        raise ExportError(f"refusing to export: unknown af4g64 variant `{variant}`")
    if out_dir.exists() and not overwrite:
        raise ExportError(f"refusing to export: `{out_dir}` already exists\nhint: choose a new directory or pass overwrite")
    if not isinstance(named_tensors, Mapping):
        raise ExportError(
            f"refusing to export: tensors are a `{type(named_tensors).__name__}`, expected a name -> tensor mapping"
        )
    if isinstance(quantize_names, str):
        raise ExportError("refusing to export: quantize_names must be a list of names, not one string")
    qnames = list(dict.fromkeys(quantize_names))
    extra = dict(manifest_extra or {})
    reserved = sorted(set(extra) & set(_RESERVED_MANIFEST_KEYS))
    if reserved:
        raise ExportError(f"refusing to export: manifest_extra reuses reserved key(s) `{reserved}`")
    return qnames, extra


def _write_dir(
    out_dir: Path, tensors: dict[str, torch.Tensor], cfg: dict[str, Any], manifest: dict[str, Any], *, overwrite: bool
) -> dict[str, str]:
    """Write the three files and commit the directory (`commit_dir`: an existing `out_dir` is put
    back if anything fails); fills `manifest["files"]` and returns it."""
    from ..weights.write import safetensors_order, write_safetensors

    def fill(tmp: Path) -> dict[str, str]:
        write_safetensors(tmp / WEIGHTS_FILE, safetensors_order(tensors), SAFETENSORS_METADATA)
        write_file(tmp / CONFIG_FILE, pretty_json(cfg))
        files = sha256_files([tmp / WEIGHTS_FILE, tmp / CONFIG_FILE], root=tmp)
        manifest["files"] = files
        write_file(tmp / MANIFEST_FILE, pretty_json(manifest))
        return files

    return commit_dir(out_dir, fill, overwrite=overwrite)


def read_manifest(out_dir: str | Path) -> dict[str, Any]:
    """Load an export's ``manifest.json`` and check every listed file's sha256.

    Raises:
        ExportError: missing/corrupt manifest or a file whose hash differs.
    """
    out_dir = Path(out_dir)
    try:
        manifest = json.loads((out_dir / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read `{out_dir / MANIFEST_FILE}`: {exc}") from exc
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:
        raise ExportError(f"`{out_dir / MANIFEST_FILE}` lists no files")
    for name, expected in files.items():
        path = out_dir / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ExportError(f"`{out_dir / MANIFEST_FILE}` names a file outside the export: `{name}`")
        if not path.is_file():
            raise ExportError(f"export file `{path}` is missing")
        got = sha256_files([path], root=out_dir)[name]
        if got != expected:
            raise ExportError(f"export file `{path}` has sha256 `{got}`, manifest says `{expected}`")
    return manifest
