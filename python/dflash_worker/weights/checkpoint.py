"""Resolve a checkpoint path (directory, index, or single file) into validated shard headers.

A checkpoint directory holds either ``model.safetensors.index.json`` (whose
``weight_map`` names the shard of every tensor) or safetensors files without an
index (normally one ``model.safetensors``). Every shard header is validated and
cross-checked against the index before any tensor byte is read:

- a shard named in the index must exist (the error names index and shard);
- a tensor listed in the index must be in its shard, and every tensor of a
  shard must be listed in the index under that shard;
- a tensor name may appear in only one shard.

Imports no torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import NamedTuple

from ..errors import CheckpointError
from ..family_registry import WRAPPER_MODEL_TYPES
from ..strict_json import DuplicateKeyError, no_duplicate_keys
from .header import Header, read_header

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_INDEX_BYTES = 256 * 1024 * 1024


class TensorEntry(NamedTuple):
    """Where a tensor lives: file, safetensors dtype, shape, byte count (unpacks as a 4-tuple)."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Checkpoint:
    """A resolved checkpoint: shard headers in load order; `index` is the index file, if any."""

    root: Path
    index: Path | None
    shards: tuple[Header, ...]

    def tensors(self) -> dict[str, TensorEntry]:
        out: dict[str, TensorEntry] = {}
        for h in self.shards:
            for name, t in h.tensors.items():
                out[name] = TensorEntry(h.path, t.dtype, t.shape, t.nbytes)
        return out

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for h in self.shards for t in h.tensors.values())


def _read_index(index: Path) -> dict[str, str]:
    try:
        size = index.stat().st_size
        if size > MAX_INDEX_BYTES:
            raise CheckpointError(f"`{index}`: index is `{size}` bytes, over the `{MAX_INDEX_BYTES}`-byte limit")
        raw = index.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"`{index}`: cannot read index: {exc.strerror or exc}") from None
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except DuplicateKeyError as exc:
        raise CheckpointError(f"`{index}`: duplicate key `{exc.key}` in index") from None
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"`{index}`: index is not valid UTF-8 (byte {exc.start})") from None
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"`{index}`: index is not valid JSON: {exc}") from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict):
        raise CheckpointError(f"`{index}`: index has no `weight_map` object")
    checked: set[str] = set()  # thousands of names share a few shards: check each shard name once
    for name, shard in wm.items():
        if not isinstance(shard, str) or not shard:
            raise CheckpointError(f"`{index}`: tensor `{name}` maps to `{shard!r}`, expected a shard file name")
        if shard in checked:
            continue
        checked.add(shard)
        p = PurePosixPath(shard)
        if p.is_absolute() or ".." in p.parts or "\\" in shard:
            raise CheckpointError(
                f"`{index}`: tensor `{name}` maps to shard `{shard}` outside the checkpoint directory"
            )
    return wm


def _from_index(root: Path, index: Path) -> Checkpoint:
    wm = _read_index(index)
    by_shard: dict[str, list[str]] = {}
    for name, shard in wm.items():
        by_shard.setdefault(shard, []).append(name)
    shards: list[Header] = []
    # Shard order: as first named by the index (writers list shards in order).
    for shard, names in by_shard.items():
        spath = root / shard
        if not spath.is_file():
            raise CheckpointError(
                f"`{index}` names shard `{shard}` (for tensor `{names[0]}`), but `{spath}` does not exist"
                "\nhint: the download is incomplete; fetch the missing shard"
            )
        h = read_header(spath)
        listed = set(names)
        absent = [n for n in names if n not in h.tensors]
        if absent:
            raise CheckpointError(
                f"`{index}` lists tensor `{absent[0]}` in shard `{spath}`, but the shard does not contain it"
                + (f" ({len(absent)} such tensors)" if len(absent) > 1 else "")
            )
        extra = [n for n in h.tensors if n not in listed]
        if extra:
            where = wm.get(extra[0])
            also = f" (the index puts it in `{where}`)" if where else ""
            raise CheckpointError(
                f"`{spath}`: tensor `{extra[0]}` is not listed under this shard in `{index}`{also}"
                + (f" ({len(extra)} such tensors)" if len(extra) > 1 else "")
            )
        shards.append(h)
    return Checkpoint(root=root, index=index, shards=tuple(shards))


def _from_files(root: Path, files: list[Path]) -> Checkpoint:
    shards = [read_header(f) for f in files]
    seen: dict[str, Path] = {}
    for h in shards:
        for name in h.tensors:
            if name in seen:
                raise CheckpointError(f"`{h.path}`: tensor `{name}` also appears in `{seen[name]}`")
            seen[name] = h.path
    return Checkpoint(root=root, index=None, shards=tuple(shards))


def resolve_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Resolve `path` (directory, index json, or `.safetensors` file) and validate every shard header."""
    path = Path(path)
    if path.is_dir():
        index = path / INDEX_NAME
        if index.is_file():
            return _from_index(path, index)
        single = path / SINGLE_NAME
        if single.is_file():
            return _from_files(path, [single])
        files = sorted(p for p in path.glob("*.safetensors") if p.is_file())
        if not files:
            raise CheckpointError(
                f"`{path}`: no `{INDEX_NAME}` and no `.safetensors` files"
                "\nhint: pass a checkpoint directory, a `.safetensors` file or an index json"
            )
        return _from_files(path, files)
    if path.is_file():
        if path.name.endswith(".json"):
            return _from_index(path.parent, path)
        return _from_files(path.parent, [path])
    raise CheckpointError(f"`{path}`: no such file or directory")


def list_tensors(path: str | os.PathLike[str]) -> dict[str, TensorEntry]:
    """Map every tensor name of the checkpoint at `path` to its file, dtype, shape and byte count."""
    return resolve_checkpoint(path).tensors()


def _config_dir(path: Path) -> Path:
    return path if path.is_dir() else path.parent


def read_config_json(path: str | os.PathLike[str]) -> dict:
    """Read ``config.json`` of a checkpoint directory (or of the directory holding a file)."""
    cfg = _config_dir(Path(path)) / "config.json"
    try:
        raw = cfg.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(
            f"`{cfg}`: no config.json next to the checkpoint\nhint: a model checkpoint directory needs its config.json"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"`{cfg}`: cannot read: {exc.strerror or exc}") from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"`{cfg}`: not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"`{cfg}`: expected a JSON object")
    return doc


# Multimodal wrappers whose language model is the target (`WRAPPER_MODEL_TYPES`, from the family
# registry): config.json holds the text tower's geometry under `text_config`, and the checkpoint its
# weights under `model.language_model.*` (next to `model.visual.*` and, in released files, `mtp.*`).
def text_config(config: dict) -> dict:
    """The text tower's view of a target `config.json` dict: `text_config` of a multimodal
    wrapper (`qwen3_5`, `qwen3_5_moe`), the dict itself otherwise (never a copy to mutate)."""
    sub = config.get("text_config")
    if config.get("model_type") in WRAPPER_MODEL_TYPES and isinstance(sub, dict):
        return sub
    return config


def is_wrapper_config(config: dict) -> bool:
    """True for a multimodal wrapper config (the text tower sits under `text_config`)."""
    return text_config(config) is not config


def read_text_config(path: str | os.PathLike[str]) -> dict:
    """`text_config(read_config_json(path))`: the geometry (layers, width, vocabulary) of the text tower."""
    return text_config(read_config_json(path))


# Where a Qwen3.5 checkpoint keeps its text tower, and what a target never needs: the vision
# tower and the multi-token prediction heads. `weights.loader` skips them unread, and
# `families` leaves them out of a target's size, by this one rule.
TEXT_TOWER_PREFIX = "model.language_model."
SKIPPED_PREFIXES = ("model.visual.", "mtp.")


def skips_outside_text_tower(config: dict) -> bool:
    """True when a target load leaves `SKIPPED_PREFIXES` unread: the Qwen3.5 families, wrapper or
    text-only `config.json` (other families read every tensor their checkpoint holds)."""
    return str(config.get("model_type", "")).startswith("qwen3_5")


def is_skipped_tensor(config: dict, name: str) -> bool:
    """True for a checkpoint tensor that a target with `config.json` contents `config` never reads."""
    return skips_outside_text_tower(config) and name.startswith(SKIPPED_PREFIXES)
