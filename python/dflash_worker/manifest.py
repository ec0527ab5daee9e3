"""Hashing, fingerprints, atomic writes and provenance shared by every stage's manifest.

Every artifact this package writes (prepared data, capture caches, checkpoints,
exports) carries a ``manifest.json`` built from these helpers, so the same
input always hashes the same way:

- ``sha256_file`` streams a file in 1 MiB chunks (never reads it whole);
- ``canonical_json`` is the one JSON encoding used for fingerprints: sorted
  keys, no whitespace, UTF-8, NaN/Infinity refused;
- ``fingerprint`` is the sha256 of that encoding;
- ``write_bytes_atomic`` / ``write_json_atomic`` write a sibling temporary file,
  fsync it, ``os.replace`` it over the destination and fsync the directory,
  so a crash leaves either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20

# Distributions whose versions go into every manifest. Read from package
# metadata so recording them never imports torch.
_SOFTWARE = ("dflash-worker", "torch", "transformers", "safetensors", "tokenizers", "numpy")


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, streamed."""
    return update_with_file(hashlib.sha256(), path).hexdigest()


def update_with_file(h, path: str | Path):
    """Feed a file's bytes, streamed, into hash object `h`; returns `h` (to go on hashing what follows)."""
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h


def sha256_files(paths: Iterable[str | Path], *, root: str | Path | None = None) -> dict[str, str]:
    """`{name: sha256}` for each file, keyed by its path relative to `root` (or its name), sorted."""
    out: dict[str, str] = {}
    for p in paths:
        p = Path(p)
        key = p.relative_to(root).as_posix() if root is not None else p.name
        out[key] = sha256_file(p)
    return dict(sorted(out.items()))


def canonical_json(obj: Any) -> bytes:
    """The canonical encoding used for fingerprints: sorted keys, compact, UTF-8, finite numbers only."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode(
        "utf-8"
    )


def fingerprint(obj: Any) -> str:
    """sha256 of `canonical_json(obj)`."""
    return sha256_bytes(canonical_json(obj))


def pretty_json(obj: Any) -> bytes:
    """Human-readable but still deterministic JSON (sorted keys, 2-space indent, trailing newline)."""
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


def _fsync_dir(path: Path) -> None:
    # Directory fsync makes the rename itself durable; not supported everywhere (e.g. Windows).
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` via a temporary sibling + fsync + rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """`write_bytes_atomic` of `pretty_json(obj)`."""
    write_bytes_atomic(path, pretty_json(obj))


def commit_file(tmp: str | Path, path: str | Path) -> None:
    """fsync an already written temporary file and rename it over `path` (same directory)."""
    tmp, path = Path(tmp), Path(path)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def read_manifest_json(path: Path, *, fmt: str, kind: str, missing_hint: str) -> dict[str, Any]:
    """Read a stage's `manifest.json` and check its `format`; `DataError` names the file."""
    from .errors import DataError

    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"`{path}` not found{missing_hint}") from None
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read `{path}`: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != fmt:
        raise DataError(f"`{path}` is not a {kind} manifest (format `{fmt}` expected)")
    return manifest


def software_versions() -> dict[str, str]:
    """Versions of Python, the platform and the packages that shape an artifact's bytes."""
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for dist in _SOFTWARE:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def device_provenance(device: Any = None) -> dict[str, Any]:
    """Where a computation ran: `dflash_worker.device.provenance()` when that module exists.

    Falls back to a minimal record (torch build, CUDA/MPS availability) so manifests are
    never missing the field while the device module is absent.
    """
    try:
        from . import device as _device  # type: ignore[attr-defined]

        prov = getattr(_device, "provenance", None)
    except ImportError:
        prov = None
    if prov is not None:
        try:
            return dict(prov(device)) if device is not None else dict(prov())
        except TypeError:
            return dict(prov())
    import torch

    rec: dict[str, Any] = {
        "source": "dflash_worker.manifest fallback",
        "device": str(device) if device is not None else "cpu",
        "torch": torch.__version__,
        "cuda_available": bool(torch.cuda.is_available()),
        "mps_available": bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()),
        "machine": platform.machine(),
        "python_executable": sys.executable,
    }
    if rec["cuda_available"]:
        rec["cuda_device_name"] = torch.cuda.get_device_name(0)
        rec["cuda_version"] = torch.version.cuda
    return rec
