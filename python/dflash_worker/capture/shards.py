"""Capture shards on disk: their records, the writer, resume and the scan of a divided capture.

A shard (`capture.layout` names the files and tensors) is committed in two atomic writes,
the shard (`weights.write`), then its sidecar (`ShardRecord`); a shard is kept on resume
only when its sidecar names the current capture key and its sha256 verifies:

- `resume`: one process's resume; the leading shards that verify are kept, the first one
  that does not and everything after it are removed, a dir holding another capture is
  refused (`ResumeError`);
- `scan_shards`: the resume of a capture divided over ranks or jobs, shard by shard;
- `ShardWriter`: groups captured examples into shards and commits each one on a writer
  thread while the teacher runs the next examples.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, TypedDict

from ..data import Example
from ..errors import ResumeError
from ..manifest import sha256_file, write_json_atomic
from ..weights.write import write_safetensors
from ..worker.events import EventSink, Progress
from .layout import MANIFEST, SHARD_FORMAT, shard_path, sidecar_path
from .plan import CapturePlan


# --------------------------------------------------------------------- records and resume
@dataclass(frozen=True, kw_only=True)
class ShardRecord:
    """A committed shard as its sidecar (`shard-NNNNN.json`) describes it."""

    capture_key: str
    shard: int
    file: str
    first: int  # index of its first example in the capture order
    end: int  # one past its last example
    examples: int
    tokens: int
    loss_tokens: int
    generation_truncated: int  # regenerated responses that hit `max_new_tokens` before a stop token
    sha256: str
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"format": SHARD_FORMAT, **asdict(self)}

    def manifest_entry(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("file", "sha256", "bytes", "first", "end", "examples", "tokens", "loss_tokens")}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ShardRecord | None:
        """The record of a sidecar, or None when a field is missing or of the wrong type."""
        doc = {"generation_truncated": 0, **doc}  # sidecars from before the field existed
        values = {}
        for f in fields(cls):
            v = doc.get(f.name)
            want = str if f.type == "str" else int
            if not isinstance(v, want) or isinstance(v, bool):
                return None
            values[f.name] = v
        return cls(**values)


def _verify_shard(root: Path, i: int, key: str) -> ShardRecord | None:
    """The record of shard `i` if the shard is complete; None if missing or corrupt.

    A sidecar written for another capture key raises ResumeError: the dir holds a different capture.
    """
    sc, sp = sidecar_path(root, i), shard_path(root, i)
    if not sc.is_file() or not sp.is_file():
        return None
    try:
        side = json.loads(sc.read_text(encoding="utf-8"))
        if side.get("format") != SHARD_FORMAT:
            return None
    except (OSError, ValueError, AttributeError):
        return None
    if side.get("capture_key") != key:
        raise ResumeError(
            f"`{sc}` belongs to a different capture (key `{side.get('capture_key')}`, this recipe gives `{key}`)\n"
            "hint: point `[capture].output` at a new dir, or delete the old capture"
        )
    record = ShardRecord.from_json(side)
    if record is None or sp.stat().st_size != record.bytes or sha256_file(sp) != record.sha256:
        return None
    return record


def _remove_shards(root: Path, drop: Callable[[int], bool]) -> int:
    """Delete the shards and sidecars whose index `drop` names, stale temporaries, and the manifest."""
    removed = 0
    for p in root.iterdir():
        name = p.name
        if name.startswith(".shard-") and ".tmp-" in name or name.startswith(f".{MANIFEST}.tmp-"):
            p.unlink(missing_ok=True)
        elif name.startswith("shard-") and name.endswith((".safetensors", ".json")):
            try:
                idx = int(name[6:11])
            except ValueError:
                continue
            if drop(idx):
                p.unlink(missing_ok=True)
                removed += 1
    (root / MANIFEST).unlink(missing_ok=True)
    return removed


def _remove_from(root: Path, first: int) -> int:
    """Delete shards and sidecars with index >= `first`, stale temporaries, and the manifest."""
    return _remove_shards(root, lambda idx: idx >= first)


def _read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest at `path`, or None when it is missing or unreadable (then it is rewritten)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _open_output(out: Path, key: str) -> dict[str, Any] | None:
    """Make the capture dir; its manifest if any, which must be this capture's (`ResumeError` otherwise)."""
    out.mkdir(parents=True, exist_ok=True)
    old = _read_manifest(out / MANIFEST)
    old_key = old.get("capture_key") if old is not None else None
    if old_key is not None and old_key != key:
        raise ResumeError(
            f"`{out}` holds a different capture (key `{old_key}`, this recipe gives `{key}`)\n"
            "hint: point `[capture].output` at a new dir, or delete the old capture"
        )
    return old


@dataclass(frozen=True)
class ResumePoint:
    """What survives in the capture dir: the verified leading shards, and the manifest if it is complete."""

    records: list[ShardRecord]
    complete: dict[str, Any] | None  # the finished manifest when nothing is left to do

    @property
    def start(self) -> int:
        """Index of the first example still to capture."""
        return self.records[-1].end if self.records else 0


def resume(out: Path, key: str) -> ResumePoint:
    """Keep the leading shards that verify under `key`, remove everything after them.

    A finished capture (its manifest counts exactly the verified shards) is left untouched;
    a dir holding another capture is refused with `ResumeError`.
    """
    old = _open_output(out, key)
    records: list[ShardRecord] = []
    while (record := _verify_shard(out, len(records), key)) is not None:
        if record.first != (records[-1].end if records else 0):
            break
        records.append(record)
    if old is not None and records and old.get("shards_total") == len(records):
        return ResumePoint(records, old)
    _remove_from(out, len(records))
    return ResumePoint(records, None)


# --------------------------------------------------------------------- writing
class ShardItem(TypedDict):
    """One captured example as a shard stores it."""

    index: int  # position in the capture order
    ids: list[int]
    mask: list[int]
    features: Any  # CPU tensor [T, F]; None in an online capture (tokens only)


def _write_shard(path: Path, items: list[ShardItem], meta: dict[str, Any]) -> tuple[str, int]:
    """Write one shard to `path` atomically (`weights.write`); returns `(sha256, bytes)`.

    Tensors go in file order by element size, largest first, so every tensor is aligned:
    `index` and `offsets` (int64), `features` (4 or 2 bytes; one part per example, streamed
    to the file and the hash with no concatenated copy), `input_ids` (int32), `loss_mask`
    (uint8). The metadata is one key, `dflash_capture`, a JSON string with sorted keys, so
    the same inputs give the same bytes.
    """
    import torch

    offsets = [0]
    for it in items:
        offsets.append(offsets[-1] + len(it["ids"]))
    tensors: dict[str, Any] = {
        "index": torch.tensor([it["index"] for it in items], dtype=torch.int64),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
    }
    if items[0]["features"] is not None:  # an online capture stores no features (`layout` module docstring)
        tensors["features"] = [it["features"].contiguous() for it in items]
    tensors["input_ids"] = torch.tensor([t for it in items for t in it["ids"]], dtype=torch.int32)
    tensors["loss_mask"] = torch.tensor([m for it in items for m in it["mask"]], dtype=torch.uint8)
    written = write_safetensors(path, tensors, {"dflash_capture": json.dumps(meta, sort_keys=True, separators=(",", ":"))})
    return written.sha256, written.bytes


def _commit_shard(root: Path, items: list[ShardItem], meta: dict[str, Any], side: dict[str, Any]) -> ShardRecord:
    """Write one shard, then its sidecar (both atomic); returns the shard's record."""
    sha, nbytes = _write_shard(shard_path(root, side["shard"]), items, meta)
    record = ShardRecord(**side, sha256=sha, bytes=nbytes)
    write_json_atomic(sidecar_path(root, record.shard), record.to_json())
    return record


class ShardWriter:
    """Groups captured examples into shards, commits each one on a writer thread, reports progress.

    Shards are encoded, hashed and written on one writer thread while the teacher runs the
    next examples; at most one shard is in flight, so memory stays at two shards. A shard is
    reported (a `Progress` event, from the caller's thread) once its write has finished,
    before the next shard is handed to the writer. Use as a context manager and call
    `close()` after the last example: leaving the block on an error waits for the shard in
    flight (it stays valid on disk) but commits nothing more.
    """

    def __init__(self, plan: CapturePlan, records: list[ShardRecord], *, total: int, emit: EventSink) -> None:
        self.root = plan.cap.output
        self.shard_examples = plan.cap.shard_examples
        self.shard_tokens = plan.cap.shard_tokens
        self.key = plan.key.key
        self.meta = {
            "format": SHARD_FORMAT,
            "capture_key": self.key,
            "target_layer_ids": plan.geometry.layer_ids,
            "hidden_size": plan.geometry.hidden,
            "dtype": plan.cap.dtype,
            **({"features": "online"} if plan.online else {}),
        }
        self.records = records  # committed shards; the writer appends to the caller's list
        self.total = total
        self.emit = emit
        self.position = records[-1].end if records else 0  # examples captured so far
        self._items: list[ShardItem] = []
        self._names: list[list[str]] = []  # [split, id] of each open item
        self._tokens = 0
        self._truncated = 0
        self._pending: Future[ShardRecord] | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-capture-writer")
        # the index of the shard being filled: the next in order, unless a rank names its own (`capture.run._capture_shards`)
        self.next_index: int | None = None

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True)

    def make_room(self, tokens: int) -> None:
        """Under `shard_tokens`, commit the open shard if an example of `tokens` tokens would overflow it."""
        if self.shard_tokens is not None and self._items and self._tokens + tokens > self.shard_tokens:
            self._flush()

    def add(self, item: ShardItem, example: Example, *, truncated: bool) -> None:
        """Append one captured example, report it, and commit the shard when `shard_examples` is reached."""
        self._items.append(item)
        self._names.append([example.split, example.id])
        self._tokens += len(item["ids"])
        self._truncated += int(truncated)
        self.position = item["index"] + 1
        self.emit(Progress(phase="capture", step=self.position, total_steps=self.total, metrics={"tokens": len(item["ids"])}))
        if self.shard_tokens is None and len(self._items) >= self.shard_examples:
            self._flush()

    def end_shard(self) -> None:
        """Commit the open shard now, however full (a rank's shard ends where the next rank's begins)."""
        if self._items:
            self._flush()

    def close(self) -> None:
        """Commit the last, partly filled shard and wait for every write."""
        if self._items:
            self._flush()
        self._settle()

    def _settle(self) -> None:
        if self._pending is None:
            return
        record = self._pending.result()
        self._pending = None
        self.records.append(record)
        metrics = {
            "shard": record.shard,
            "shards_committed": len(self.records),
            "examples_committed": record.end,
            "shard_examples": record.examples,
            "shard_tokens": record.tokens,
        }
        self.emit(Progress(phase="capture", step=self.position, total_steps=self.total, metrics=metrics))

    def _flush(self) -> None:
        self._settle()
        idx = len(self.records) if self.next_index is None else self.next_index
        items = self._items
        side = {
            "capture_key": self.key,
            "shard": idx,
            "file": shard_path(self.root, idx).name,
            "first": items[0]["index"],
            "end": items[-1]["index"] + 1,
            "examples": len(items),
            "tokens": self._tokens,
            "loss_tokens": sum(sum(it["mask"]) for it in items),
            "generation_truncated": self._truncated,
        }
        meta = {**self.meta, "examples": self._names}
        self._pending = self._pool.submit(_commit_shard, self.root, items, meta, side)
        self._items, self._names, self._tokens, self._truncated = [], [], 0, 0


# --------------------------------------------------------------------- a divided capture (ranks, jobs)
def shard_span(k: int, per: int, n: int) -> range:
    """Example indices of shard `k` when every shard holds `per` examples (the last one the rest)."""
    return range(k * per, min((k + 1) * per, n))


def scan_shards(out: Path, key: str, n: int, per: int, ours: list[int] | None = None) -> tuple[dict[int, ShardRecord], dict[str, Any] | None]:
    """Rank 0's resume for a divided capture: keep each shard that verifies under `key` and covers exactly its
    span, remove the others, temporaries and an unfinished manifest; the manifest too when complete.
    `ours`: a part's shards (`CapturePart`), the only ones kept; a part has no manifest, so it is never complete."""
    old = _open_output(out, key)
    total = -(-n // per)
    kept: dict[int, ShardRecord] = {}
    for k in range(total) if ours is None else ours:
        record = _verify_shard(out, k, key)
        span = shard_span(k, per, n)
        if record is not None and (record.first, record.end) == (span.start, span.stop):
            kept[k] = record
    if ours is None and old is not None and len(kept) == total and old.get("shards_total") == total:
        return kept, old
    _remove_shards(out, lambda idx: idx not in kept)
    return kept, None
