"""The commit step every export format shares: a directory appears whole or not at all.

`commit_dir(out_dir, fill, overwrite=...)`:

1. makes a temporary sibling ``.<name>.tmp-<pid>-<random>`` and calls ``fill(tmp)``,
   which writes the export's files there durably (`write_file` and
   `weights.write.write_safetensors` fsync what they write);
2. fsyncs the temporary directory; if `out_dir` exists by now (it may have
   appeared while exporting), refuses unless `overwrite`, else moves it aside to
   ``.<name>.old-<pid>-<random>``;
3. renames the temporary into place and fsyncs the parent; only then removes the
   old export.

On any failure (``fill`` raising, a rename failing, an interrupt) the temporary is
removed and a moved-aside old export is put back, so `out_dir` is either the old
export, untouched, or the new one, complete. The random suffix keeps two exports
to the same place from sharing a temporary.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..errors import ExportError
from ..manifest import _fsync_dir

T = TypeVar("T")


def write_file(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync it (an export's small files: config, manifest)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sibling(out_dir: Path, kind: str) -> Path:
    return out_dir.parent / f".{out_dir.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def commit_dir(out_dir: Path, fill: Callable[[Path], T], *, overwrite: bool) -> T:
    """Write an export with ``fill(tmp)`` and rename it into `out_dir` (module docstring);
    returns what `fill` returned."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(out_dir, "tmp")
    old: Path | None = None
    try:
        tmp.mkdir()
        result = fill(tmp)
        _fsync_dir(tmp)
        if out_dir.exists():
            if not overwrite:
                raise ExportError(f"refusing to export: `{out_dir}` appeared while exporting\n"
                                  "hint: choose a new directory or pass overwrite")
            old = _sibling(out_dir, "old")
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        _fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out_dir.exists():
            os.replace(old, out_dir)  # put the previous export back
            old = None
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return result


__all__ = ["commit_dir", "write_file"]
