"""Training checkpoints: atomic commit, verification, listing and pruning.

Layout of a run directory::

    RUN/checkpoints/step-00000010/
        trainable.safetensors  FP32 master values of the trained tensors
        optimizer.pt           AdamW state_dict (tensors + plain values)
        rng.json               RNG states (python, numpy, torch CPU, CUDA, MPS)
        state.json             step, data cursor, scheduler, resolved recipe,
                               fingerprints, validation history
        manifest.json          sha256 and size of each file above (written last)
    RUN/checkpoints/LATEST     name of the newest committed checkpoint

A checkpoint is written into a hidden temporary sibling directory; every file
and the directory are fsynced, then the directory is renamed into place and
the parent fsynced; only then is ``LATEST`` replaced (itself atomically). A
crash at any point leaves the previous checkpoint and ``LATEST`` intact, and a
leftover temporary directory is ignored and removed by the next commit.

Loading verifies the manifest's hashes before anything is used, and loads
``optimizer.pt`` with ``weights_only=True`` (no arbitrary pickles).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ..errors import CheckpointError
from ..manifest import _fsync_dir, sha256_file, write_bytes_atomic, write_json_atomic
from ..weights.write import safetensors_order, write_safetensors

CHECKPOINTS = "checkpoints"
LATEST = "LATEST"
FORMAT = "dflash-worker-train-checkpoint/1"
_NAME = re.compile(r"^step-(\d{8})$")
_FILES = ("trainable.safetensors", "optimizer.pt", "rng.json", "state.json")
# Steps a checkpoint directory name can hold (`step_name`, `_NAME`: eight digits).
MAX_STEP = 10**8 - 1


def step_name(step: int) -> str:
    return f"step-{step:08d}"


@dataclass
class Loaded:
    """A verified checkpoint read back into memory."""

    path: Path
    step: int
    trainable: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: dict[str, Any]
    state: dict[str, Any]


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    run_dir: str | Path,
    step: int,
    *,
    trainable: dict[str, torch.Tensor],
    optimizer: dict[str, Any],
    rng: dict[str, Any],
    state: dict[str, Any],
) -> Path:
    """Commit checkpoint `step` atomically and point ``LATEST`` at it; returns its directory."""

    def write(tmp: Path) -> None:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in trainable.items()}
        # `safetensors_order` with one metadata key: the bytes `safetensors.torch.save_file` wrote
        # here before, so checkpoints of older versions hash the same
        write_safetensors(tmp / "trainable.safetensors", safetensors_order(tensors), metadata={"format": FORMAT})
        torch.save(optimizer, tmp / "optimizer.pt")
        (tmp / "rng.json").write_bytes(json.dumps(rng, sort_keys=True).encode())
        (tmp / "state.json").write_bytes(
            (json.dumps({"format": FORMAT, "step": step, **state}, sort_keys=True, indent=1, allow_nan=False) + "\n").encode()
        )

    return _commit(run_dir, step, write)


def _commit(run_dir: str | Path, step: int, write: Callable[[Path], None], *, expect: dict[str, Any] | None = None) -> Path:
    """The commit protocol: `write` fills a temporary directory with `_FILES`; each file is
    fsynced and hashed into ``manifest.json`` (written last), the directory fsynced and renamed
    into place, the parent fsynced, then ``LATEST`` replaced atomically. With `expect` (another
    manifest's ``files``), files that hash otherwise are refused before anything is renamed."""
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / step_name(step)
    tmp = root / f".tmp-{step_name(step)}-{os.getpid()}"
    tmp.mkdir()
    try:
        write(tmp)
        files = {}
        for name in _FILES:
            _fsync_file(tmp / name)
            files[name] = {"sha256": sha256_file(tmp / name), "size": (tmp / name).stat().st_size}
        if expect is not None:
            changed = [n for n in _FILES if files[n] != expect.get(n)]
            if changed:
                raise CheckpointError(
                    f"checkpoint files {', '.join(f'`{n}`' for n in changed)} changed while they were copied; nothing was committed"
                )
        (tmp / "manifest.json").write_bytes(
            (json.dumps({"format": FORMAT, "step": step, "files": files}, sort_keys=True, indent=1) + "\n").encode()
        )
        _fsync_file(tmp / "manifest.json")
        _fsync_dir(tmp)
        if final.exists():
            # Re-committing a step (a stop right after a resume): the new copy replaces the old one.
            trash = root / f".tmp-old-{step_name(step)}-{os.getpid()}"
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_bytes_atomic(root / LATEST, (final.name + "\n").encode())
    return final


def seed(run_dir: str | Path, manifest: str | Path) -> int | None:
    """Seed an empty run directory from another run's checkpoint (a lease's resume checkpoint).

    `manifest` is the checkpoint's ``manifest.json`` (the one checkpoint reference the worker
    reports and the run-manager hands back). Its files are verified against it before anything
    is copied and committed here with the commit protocol of `save`, so the copy is byte-for-byte
    the checkpoint (same manifest). Returns the seeded step, or None when the run directory
    already has a committed checkpoint (it resumes from its own).
    """
    if latest(run_dir) is not None:
        return None
    src = Path(manifest)
    if src.name != "manifest.json":
        raise CheckpointError(f"resume checkpoint `{src}` is not a checkpoint's `manifest.json`")
    source = verify(src.parent)
    step = source.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise CheckpointError(f"checkpoint `{src}` has no valid `step` (an integer in [0, {MAX_STEP}]), got `{str(step)[:40]}`")

    def write(tmp: Path) -> None:
        for name in _FILES:
            shutil.copyfile(src.parent / name, tmp / name)

    # the copy is what the manifest promised: a file changed while it was copied is refused before the rename
    _commit(run_dir, step, write, expect=source["files"])
    return step


def verify(path: str | Path) -> dict[str, Any]:
    """Check a checkpoint directory against its manifest; returns the manifest."""
    path = Path(path)
    mpath = path / "manifest.json"
    try:
        manifest = json.loads(mpath.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint `{path}` has no `manifest.json` (not committed)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint `{mpath}` is unreadable: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"checkpoint `{mpath}` is not a `{FORMAT}` manifest")
    for name in _FILES:
        want = manifest["files"].get(name)
        f = path / name
        if not isinstance(want, dict) or not f.is_file():
            raise CheckpointError(f"checkpoint `{path}` lacks `{name}`")
        got = sha256_file(f)
        if got != want.get("sha256"):
            raise CheckpointError(
                f"checkpoint file `{f}` has sha256 `{got}`, its manifest says `{want.get('sha256')}`\n"
                "hint: the file was changed or damaged after it was committed"
            )
    return manifest


def load(path: str | Path, *, map_location: str = "cpu") -> Loaded:
    """Verify and read a checkpoint directory."""
    path = Path(path)
    manifest = verify(path)
    try:
        state = json.loads((path / "state.json").read_bytes())
        trainable = load_file(str(path / "trainable.safetensors"), device=map_location)
        optimizer = torch.load(path / "optimizer.pt", map_location=map_location, weights_only=True)
        rng = json.loads((path / "rng.json").read_bytes())
    except Exception as exc:  # noqa: BLE001 - every decode failure is a corrupt checkpoint
        raise CheckpointError(f"checkpoint `{path}` cannot be read: {exc}") from None
    if state.get("step") != manifest.get("step"):
        raise CheckpointError(f"checkpoint `{path}`: `state.json` step `{state.get('step')}` != manifest `{manifest.get('step')}`")
    return Loaded(path, int(state["step"]), trainable, optimizer, rng, state)


def committed(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Committed checkpoints (those with a manifest), oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    out = []
    if root.is_dir():
        for p in root.iterdir():
            m = _NAME.match(p.name)
            if m and (p / "manifest.json").is_file():
                out.append((int(m.group(1)), p))
    return sorted(out)


def latest(run_dir: str | Path) -> Path | None:
    """The checkpoint ``LATEST`` names, else the newest committed one, else None."""
    root = Path(run_dir) / CHECKPOINTS
    try:
        name = (root / LATEST).read_text().strip()
    except OSError:
        name = ""
    if _NAME.match(name) and (root / name / "manifest.json").is_file():
        return root / name
    found = committed(run_dir)
    return found[-1][1] if found else None


def prune(run_dir: str | Path, *, keep: int, protect: set[int]) -> list[int]:
    """Delete all but the newest `keep` checkpoints and those in `protect`; returns deleted steps."""
    found = committed(run_dir)
    newest = {s for s, _ in found[-keep:]}
    gone = []
    for s, p in found:
        if s not in newest and s not in protect:
            shutil.rmtree(p, ignore_errors=True)
            gone.append(s)
    return gone


def write_json(path: Path, obj: Any) -> None:
    write_json_atomic(path, obj)
