"""`prepare-data`: normalise JSONL inputs, deduplicate, and split by prompt group.

Pipeline: read every input (strict reader, `jsonl.py`) -> normalise each row
to chat messages (`schema.py`) -> drop exact duplicates (the same normalised
conversation, any source; the first occurrence in input order wins, the
others are counted as `duplicate`) -> group by prompt identity (NFKC +
folded whitespace, across sources) -> assign each group a split from a
seeded hash of its key -> write ``train.jsonl``, ``val.jsonl``, ``test.jsonl``
and ``manifest.json``.

A prompt that appears in two sources (or with different spacing) is one
group: all of its rows land in the same split, each keeping its own `source`
tag; only rows identical in every message are duplicates.

Output is a pure function of the input bytes, their file names, the order
they are given in, the seed and the fractions: rows keep input order within
a split, JSON is written with sorted keys, and the manifest holds no
timestamps or absolute paths. Every file is written atomically (temporary
file, fsync, rename), manifest last, and nothing is written until every input
has been read, so a failure never touches what is already in the output dir.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import ConfigError, DataError
from ..manifest import fingerprint, sha256_bytes, sha256_file, write_bytes_atomic, write_json_atomic
from .jsonl import DEFAULT_MAX_LINE_BYTES, FileStats, LineError, iter_jsonl
from .schema import Row, exact_key, normalize_row, prompt_key

FORMAT = "dflash-worker/prepared-data/v1"
SPLIT_NAMES = ("train", "val", "test")
MAX_LISTED_DROPS = 50


@dataclass(frozen=True)
class _Kept:
    row: Row
    file: str
    line: int
    group: str
    exact: str


def split_of(group: str, *, seed: int, val_fraction: float, test_fraction: float) -> str:
    """The split of a prompt group: a uniform draw in [0, 1) from sha256(seed, group)."""
    digest = hashlib.sha256(f"dflash-split\0{seed}\0{group}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0**64
    if u < test_fraction:
        return "test"
    if u < test_fraction + val_fraction:
        return "val"
    return "train"


def _check_args(inputs: Sequence[Path], seed: int, val_fraction: float, test_fraction: float, max_line_bytes: int) -> None:
    if not inputs:
        raise ConfigError("no `--input` files given")
    names = [p.name for p in inputs]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ConfigError(
            f"two inputs share the file name `{dup}`\nhint: file names tag rows and key the manifest; rename one"
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"`--seed` must be a non-negative integer, found `{seed}`")
    for name, f in (("--val-fraction", val_fraction), ("--test-fraction", test_fraction)):
        if not (0.0 <= f < 1.0):
            raise ConfigError(f"`{name}` must be in [0, 1), found `{f}`")
    if val_fraction + test_fraction >= 1.0:
        raise ConfigError(
            f"`--val-fraction` + `--test-fraction` is `{val_fraction + test_fraction}`, leaving nothing to train on"
        )
    if max_line_bytes < 2:
        raise ConfigError(f"`--max-line-bytes` must be at least 2, found `{max_line_bytes}`")


def _row_json(kept: _Kept) -> dict[str, Any]:
    return {
        "id": kept.exact[:16],
        "messages": list(kept.row.messages),
        "origin": {"file": kept.file, "line": kept.line},
        "schema": kept.row.schema,
        "source": kept.row.source,
    }


def dumps_row(obj: dict[str, Any]) -> bytes:
    """One output line: sorted keys, compact, UTF-8 (not ASCII-escaped), newline-terminated."""
    return (json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")


def prepare_data(
    inputs: Sequence[str | Path],
    output: str | Path,
    *,
    seed: int = 0,
    val_fraction: float = 0.05,
    test_fraction: float = 0.05,
    skip_invalid: bool = False,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    on_drop: Callable[[str, int, str, str], None] | None = None,
) -> dict[str, Any]:
    """Prepare `inputs` into `output`; returns the manifest that was written.

    Raises DataError naming file and line for the first unusable row unless
    `skip_invalid`, in which case each one is dropped, counted by reason in the
    manifest, listed (first 50) and reported through `on_drop(file, line, reason, message)`.
    """
    paths = [Path(p) for p in inputs]
    _check_args(paths, seed, val_fraction, test_fraction, max_line_bytes)
    output = Path(output)

    kept: list[_Kept] = []
    seen: dict[str, tuple[str, int]] = {}
    dropped: Counter[str] = Counter()
    drops: list[dict[str, Any]] = []
    ignored: Counter[str] = Counter()
    schema_counts: Counter[str] = Counter()
    inputs_meta: list[dict[str, Any]] = []

    def drop(file: str, line: int, reason: str, message: str) -> None:
        dropped[reason] += 1
        if len(drops) < MAX_LISTED_DROPS:
            drops.append({"file": file, "line": line, "reason": reason, "message": message})
        if on_drop is not None:
            on_drop(file, line, reason, message)

    for path in paths:
        name = path.name
        if not path.is_file():
            raise DataError(f"input `{path}` does not exist or is not a file")
        stats = FileStats()
        read = kept_here = 0
        try:
            lines = iter_jsonl(path, stats, max_line_bytes=max_line_bytes)
            for lineno, value in lines:
                read += 1
                row = value if isinstance(value, LineError) else normalize_row(value, line=lineno, default_source=name)
                if isinstance(row, LineError):
                    if not skip_invalid:
                        raise DataError(
                            f"`{path}` line {lineno}: {row.message}"
                            + ("" if "\nhint:" in row.message else "\nhint: fix the line, or pass `--skip-invalid` to drop and count bad rows")
                        )
                    drop(name, lineno, row.reason, row.message)
                    continue
                ek = exact_key(row)
                if ek in seen:
                    f0, l0 = seen[ek]
                    drop(name, lineno, "duplicate", f"exact duplicate of `{f0}` line {l0}")
                    continue
                seen[ek] = (name, lineno)
                kept.append(_Kept(row=row, file=name, line=lineno, group=prompt_key(row), exact=ek))
                kept_here += 1
                schema_counts[row.schema] += 1
                ignored.update(row.ignored)
        except OSError as exc:
            raise DataError(f"cannot read input `{path}`: {exc.strerror or exc}") from None
        inputs_meta.append(
            {
                "file": name,
                "sha256": sha256_file(path),
                "bytes": path.stat().st_size,
                "lines": stats.lines,
                "rows_read": read,
                "rows_kept": kept_here,
                "blank_lines": stats.blank_lines,
                "crlf_lines": stats.crlf_lines,
                "bom": stats.bom,
            }
        )

    if not kept:
        raise DataError("no usable rows in " + ", ".join(f"`{p}`" for p in paths))

    # Every row of a group gets the group's split; the group key ignores the source.
    sources_of: dict[str, set[str]] = {}
    for k in kept:
        sources_of.setdefault(k.group, set()).add(k.row.source)
    split_rows: dict[str, list[bytes]] = {s: [] for s in SPLIT_NAMES}
    by_split: Counter[str] = Counter()
    source_counts: Counter[str] = Counter()
    source_split: dict[str, Counter[str]] = {}
    groups_split: dict[str, set[str]] = {s: set() for s in SPLIT_NAMES}
    prompt_only: Counter[str] = Counter()
    for k in kept:
        s = split_of(k.group, seed=seed, val_fraction=val_fraction, test_fraction=test_fraction)
        split_rows[s].append(dumps_row(_row_json(k)))
        by_split[s] += 1
        source_counts[k.row.source] += 1
        source_split.setdefault(k.row.source, Counter())[s] += 1
        groups_split[s].add(k.group)
        if not k.row.has_response:
            prompt_only[s] += 1

    blobs = {f"{s}.jsonl": b"".join(split_rows[s]) for s in SPLIT_NAMES}
    files = {
        name: {"sha256": sha256_bytes(blob), "bytes": len(blob), "rows": by_split[name.split(".")[0]]}
        for name, blob in blobs.items()
    }
    params = {"seed": seed, "val_fraction": val_fraction, "test_fraction": test_fraction}
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "params": {**params, "skip_invalid": skip_invalid, "max_line_bytes": max_line_bytes},
        "inputs": inputs_meta,
        "counts": {
            "rows": len(kept),
            "schema": dict(sorted(schema_counts.items())),
            "source": dict(sorted(source_counts.items())),
            "split": {s: by_split[s] for s in SPLIT_NAMES},
            "source_split": {src: {s: c[s] for s in SPLIT_NAMES} for src, c in sorted(source_split.items())},
            "groups_split": {s: len(groups_split[s]) for s in SPLIT_NAMES},
            "prompt_only_split": {s: prompt_only[s] for s in SPLIT_NAMES},
            "groups_in_several_sources": sum(1 for v in sources_of.values() if len(v) > 1),
        },
        "dropped": dict(sorted(dropped.items())),
        "dropped_total": sum(dropped.values()),
        "drops_listed": drops,
        "ignored_fields": dict(sorted(ignored.items())),
        "files": files,
        # Identifies the exact split contents; capture and training record it.
        "split_fingerprint": fingerprint({"files": {n: f["sha256"] for n, f in files.items()}, **params}),
        "inputs_fingerprint": fingerprint([[m["file"], m["sha256"]] for m in inputs_meta]),
        "software": {"dflash-worker": __version__},
    }
    manifest["fingerprint"] = fingerprint(manifest)

    output.mkdir(parents=True, exist_ok=True)
    for name, blob in blobs.items():
        write_bytes_atomic(output / name, blob)
    write_json_atomic(output / "manifest.json", manifest)
    return manifest
