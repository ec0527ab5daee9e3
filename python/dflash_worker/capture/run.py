"""`capture`: run the frozen teacher over prepared data and cache the draft's target features.

Order of work, cheapest checks first, one function per step:

1. `plan_capture`: read the recipe sections, verify the prepared data hashes,
   load the tokenizer and run `check_data` (no weights read yet); read
   `target_layer_ids` from the released draft's config.json (`dflash_config`
   first, then top level) and check them against the target's
   `num_hidden_layers`; check the tokenizer fits the target vocab
   (`read_geometry`); hash the teacher files and the tokenizer into the
   *capture key* (`capture_key`): every input that shapes the payload bytes
   (no paths, no timestamps); decide `[capture].on_overlong` for examples
   over `max_length` (`capture.overlong`) and read the stop ids
   (`dflash_worker.stop_tokens`);
2. `resume`: shards whose sidecar names the same key and whose sha256 verifies
   are kept; the first one that does not verify, and everything after it, is
   removed and rewritten; a dir holding a different capture is refused;
3. `_run_teacher`: stream the teacher in (`capture.teacher.Teacher`, the component
   online training calls too), optionally regenerate each response (greedy or per-example seeded
   sampling), run the teacher once over prompt+response with
   `output_hidden_states` and keep ``hidden_states[id + 1]`` for each target
   layer id; a `ShardWriter` writes shards atomically (shard, then sidecar) on
   a writer thread that overlaps the next examples' forward passes; release
   the teacher (``del`` + ``gc``);
4. `capture_manifest`: ``manifest.json``, written last.

Examples run one at a time (batch 1, no padding), so a stored feature equals a
plain forward of that example bit for bit.

Events (`worker.events`, to the `on_event` sink, in this order):

- ``Log`` (debug) ``data checked: ...`` after the data check;
- ``Log`` (warning) ``N examples over max_length ...`` when some example is
  over the limit and `on_overlong` skips or truncates it;
- ``Log`` ``already complete (K shards verified)`` and nothing more when every
  shard and the manifest verify (the manifest is returned as it is);
- ``Log`` ``N examples, resuming at S (K shards reused)`` and
  ``Progress(phase="capture", step=S, total_steps=N, metrics={"shards_reused": K})``;
- ``Log`` ``teacher loaded in X.Xs`` (only when examples are left to capture; a multimodal
  target's line adds the vision / MTP tensors skipped unread); an online capture
  (`[train].features = "online"`) without `regenerate` needs no weights and logs
  ``online features: storing tokens only, the teacher is not loaded`` instead;
- per example i: ``Progress(step=i + 1, total_steps=N, metrics={"tokens": ...})``;
- per committed shard: ``Progress(step=<examples captured so far>, total_steps=N,
  metrics={"shard": index, "shards_committed": count, "examples_committed": end,
  "shard_examples": ..., "shard_tokens": ...})``, reported once the shard and its
  sidecar are on disk and before the next shard is handed to the writer;
- ``Log`` (debug) ``K shards committed``, ``Log`` (debug) ``teacher released``
  (a warning when something still holds it), ``Log`` (debug) after the manifest.

The sink may raise (a job stops this way): shards already committed stay, the
shard being filled is redone on resume.

Note on the last layer: in transformers 5, ``hidden_states[num_layers]`` is the
*final-normed* output (it equals ``last_hidden_state``), not the raw output of
the last decoder layer. Drafts pick earlier layers, so this only matters if a
draft names the last layer; the value stored is what `output_hidden_states`
returns, as the reference does.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from .. import __version__
from ..data import Example, PreparedData, check_data, load_tokenizer
from ..errors import CheckpointError, ConfigError, DataError, ResumeError
from ..families import check_recipe_pair
from ..manifest import (
    commit_file,
    device_provenance,
    fingerprint,
    sha256_bytes,
    sha256_file,
    software_versions,
    write_json_atomic,
)
from ..model.io import read_target_layer_ids
from ..recipe import CaptureConfig, Recipe
from ..stop_tokens import stop_tokens_record
from ..worker.events import Event, EventSink, Log, Progress
from .layout import FORMAT, MANIFEST, SHARD_FORMAT, shard_path, sidecar_path
from .overlong import OverlongDecision
from .teacher import Teacher, example_tokens, teacher_features  # noqa: F401  (`teacher_features` re-exported)

if TYPE_CHECKING:
    from ..device import DeviceChoice

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def _ignore(event: Event) -> None:
    pass


# --------------------------------------------------------------------- 1. plan
@dataclass(frozen=True)
class TeacherGeometry:
    """The target's shape as far as capture cares, and the layers the draft reads."""

    config: dict[str, Any]  # the target's config.json
    layer_ids: list[int]
    num_layers: int
    hidden: int
    vocab: int


def read_geometry(target: Path, draft: Path, tokenizer: Any) -> TeacherGeometry:
    """The target's geometry from its config.json, checked against the draft's layer ids and the tokenizer."""
    from ..weights.checkpoint import read_text_config

    tcfg = read_text_config(target)  # a multimodal wrapper's text tower
    layer_ids = read_target_layer_ids(draft)
    n_layers, hidden, vocab = tcfg.get("num_hidden_layers"), tcfg.get("hidden_size"), tcfg.get("vocab_size")
    if not (isinstance(n_layers, int) and isinstance(hidden, int) and isinstance(vocab, int)):
        raise CheckpointError(f"`{target / 'config.json'}` lacks `num_hidden_layers`/`hidden_size`/`vocab_size`")
    bad = [i for i in layer_ids if i >= n_layers]
    if bad:
        raise CheckpointError(
            f"draft `target_layer_ids` `{layer_ids}` name layer `{bad[0]}`, but the target has `{n_layers}` layers\n"
            "hint: this draft was released for a different target"
        )
    if len(tokenizer) > vocab:
        raise CheckpointError(
            f"the tokenizer has `{len(tokenizer)}` tokens but the target's `vocab_size` is `{vocab}`\n"
            "hint: tokenizer and weights of `[model].target` do not belong together"
        )
    return TeacherGeometry(tcfg, layer_ids, n_layers, hidden, vocab)


def _teacher_hashes(target: Path) -> dict[str, str]:
    files = sorted(p for p in target.iterdir() if p.is_file() and (p.suffix == ".safetensors" or p.name == "model.safetensors.index.json" or p.name == "config.json"))
    if not any(p.suffix == ".safetensors" for p in files):
        raise CheckpointError(f"no `.safetensors` files in target dir `{target}`")
    return {p.name: sha256_file(p) for p in files}


def _tokenizer_hashes(target: Path) -> dict[str, str]:
    return {n: sha256_file(target / n) for n in TOKENIZER_FILES if (target / n).is_file()}


@dataclass(frozen=True)
class CaptureKey:
    """The capture key and the inputs it hashes (recorded in the manifest as `key_inputs`)."""

    key: str
    inputs: dict[str, Any]
    teacher_files: dict[str, str]
    tokenizer_files: dict[str, str]
    chat_template_sha256: str
    generation: dict[str, Any] | None  # the regeneration settings; None without `regenerate`


def features_mode(recipe: Recipe) -> str:
    """`[train].features` (`cache` without a `[train]` section): what the capture stores."""
    return recipe.train.features if recipe.train is not None else "cache"


def _generation(cap: CaptureConfig) -> dict[str, Any] | None:
    if not cap.regenerate:
        return None
    sampled = cap.sampling == "sampled"
    return {
        "sampling": cap.sampling,
        "temperature": cap.temperature if sampled else None,
        "top_p": cap.top_p if sampled else None,
        "seed": cap.seed if sampled else None,
        "max_new_tokens": cap.max_new_tokens,
    }


def capture_key(
    recipe: Recipe, prepared: PreparedData, tokenizer: Any, layer_ids: list[int], device_type: str,
    overlong: OverlongDecision | None = None,
) -> CaptureKey:
    """Fingerprint of everything that shapes the payload bytes (no paths, no timestamps).

    `on_overlong` enters the key only when some example is over `max_length`: otherwise it
    changes no byte, and keys (hence training data fingerprints) stay what they were.
    """
    cap, dcfg = recipe.require("capture"), recipe.data
    teacher = _teacher_hashes(recipe.model.target)
    tok_files = _tokenizer_hashes(recipe.model.target)
    chat_sha = sha256_bytes(tokenizer.chat_template.encode("utf-8"))
    generation = _generation(cap)
    inputs = {
        "format": FORMAT,
        "teacher_files": teacher,
        "tokenizer_files": tok_files,
        "chat_template_sha256": chat_sha,
        "thinking": dcfg.thinking,
        "max_length": dcfg.max_length,
        "target_layer_ids": layer_ids,
        "dtype": cap.dtype,
        "device_type": device_type,
        "split_fingerprint": prepared.split_fingerprint,
        "splits": list(cap.splits),
        "regenerate": generation,
        "shard_policy": {"examples": cap.shard_examples} if cap.shard_tokens is None else {"tokens": cap.shard_tokens},
    }
    if overlong is not None and overlong.items:
        inputs["on_overlong"] = overlong.policy
    if features_mode(recipe) == "online":  # only then: a cache capture's key stays what it was
        inputs["features"] = "online"
    return CaptureKey(fingerprint(inputs), inputs, teacher, tok_files, chat_sha, generation)


@dataclass(frozen=True)
class CapturePlan:
    """Everything checked and decided before any weight is read."""

    recipe: Recipe
    cap: CaptureConfig
    prepared: PreparedData
    tokenizer: Any
    geometry: TeacherGeometry
    choice: DeviceChoice
    key: CaptureKey
    overlong: OverlongDecision
    stop_tokens: dict[str, Any]  # `stop_tokens_record`: ids, sources, rule

    @property
    def online(self) -> bool:
        """`[train].features = "online"`: shards hold the tokens only, training computes the features."""
        return features_mode(self.recipe) == "online"

    def examples(self) -> list[Example]:
        """The examples to capture, in capture order: `splits`, less those `on_overlong` skips."""
        skip = self.overlong.skip_keys()
        return [ex for ex in self.prepared.examples(self.cap.splits) if (ex.split, ex.id) not in skip]


def plan_capture(recipe: Recipe, emit: EventSink, device: DeviceChoice | None = None) -> CapturePlan:
    """Data check, pair check, geometry, device and capture key: every refusal before weights load.

    `device`: where to run (the job runner's placement); None resolves `[capture].device` here.
    """
    cap = recipe.require("capture")
    mcfg, dcfg = recipe.model, recipe.data
    prepared = PreparedData(dcfg.dir)
    tokenizer = load_tokenizer(mcfg.target)
    report = check_data(
        prepared, tokenizer, thinking=dcfg.thinking, max_length=dcfg.max_length, regenerate=cap.regenerate, splits=cap.splits
    )
    report.raise_if_failed(overlong=cap.on_overlong)
    emit(Log(level="debug", message=f"data checked: `{report.examples}` examples"))
    overlong = OverlongDecision.decide(cap.on_overlong, dcfg.max_length, report.overlong)
    if len(overlong.skipped) == report.examples:
        raise DataError(
            f"every one of the `{report.examples}` examples is over max_length `{dcfg.max_length}`, nothing is left to capture\n"
            "hint: raise `[data].max_length`"
        )
    if (warning := overlong.warning()) is not None:
        emit(Log(level="warning", message=warning))
    check_recipe_pair(mcfg.target, mcfg.draft, mcfg.family)  # headers and config.json only
    geometry = read_geometry(mcfg.target, mcfg.draft, tokenizer)

    from ..device import resolve_device

    choice = device or resolve_device(cap.device)
    key = capture_key(recipe, prepared, tokenizer, geometry.layer_ids, choice.type, overlong)
    stops = stop_tokens_record(mcfg.target, tokenizer)
    return CapturePlan(recipe, cap, prepared, tokenizer, geometry, choice, key, overlong, stops)


# --------------------------------------------------------------------- 2. resume
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


# --------------------------------------------------------------------- 3. teacher and shards
class ShardItem(TypedDict):
    """One captured example as a shard stores it."""

    index: int  # position in the capture order
    ids: list[int]
    mask: list[int]
    features: Any  # CPU tensor [T, F]; None in an online capture (tokens only)


_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int32": "I32", "int64": "I64", "uint8": "U8"}


def _raw(t: Any) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (works for bf16, which numpy lacks)."""
    import torch

    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def _write_shard(path: Path, items: list[ShardItem], meta: dict[str, Any]) -> tuple[str, int]:
    """Stream one shard to `path` atomically in safetensors format; returns `(sha256, bytes)`.

    Written by hand instead of `safetensors.torch.save` so each example's features go
    from their own tensor to the file and the hash with no concatenated copy and no
    in-memory blob; the result is a regular safetensors file (`safe_open` reads it).
    Tensors are laid out by element size, largest first, so every tensor is aligned;
    the header is padded with spaces to 8 bytes, as the format allows. Only one
    metadata key is written: safetensors' own writer orders `__metadata__` from a
    hash map that changes between processes, which would break byte-identical shards.
    """
    import torch

    ids = torch.tensor([t for it in items for t in it["ids"]], dtype=torch.int32)
    mask = torch.tensor([m for it in items for m in it["mask"]], dtype=torch.uint8)
    offsets = [0]
    for it in items:
        offsets.append(offsets[-1] + len(it["ids"]))
    index_t = torch.tensor([it["index"] for it in items], dtype=torch.int64)
    offsets_t = torch.tensor(offsets, dtype=torch.int64)
    # an online capture stores no features (`layout` module docstring)
    feats = [it["features"].contiguous() for it in items] if items[0]["features"] is not None else []
    layout = [  # (name, dtype, shape, nbytes) in file order: 8-byte, then 4/2-byte, then 1-byte elements
        ("index", "int64", [len(items)], index_t.numel() * 8),
        ("offsets", "int64", [len(offsets)], offsets_t.numel() * 8),
    ]
    if feats:
        fdtype = str(feats[0].dtype).removeprefix("torch.")
        fbytes = sum(f.numel() * f.element_size() for f in feats)
        layout.append(("features", fdtype, [offsets[-1], feats[0].shape[1]], fbytes))
    layout += [
        ("input_ids", "int32", [offsets[-1]], ids.numel() * 4),
        ("loss_mask", "uint8", [offsets[-1]], mask.numel()),
    ]
    header: dict[str, Any] = {"__metadata__": {"dflash_capture": json.dumps(meta, sort_keys=True, separators=(",", ":"))}}
    pos = 0
    for name, dt, shape, n in layout:
        header[name] = {"dtype": _ST_DTYPES[dt], "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * (-len(hb) % 8)
    chunks = [struct.pack("<Q", len(hb)), hb, _raw(index_t), _raw(offsets_t)]
    chunks += [_raw(x) for x in feats] + [_raw(ids), _raw(mask)]
    h = hashlib.sha256()
    total = 0
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                h.update(c)
                f.write(c)
                total += len(c)
        commit_file(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return h.hexdigest(), total


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
        # the index of the shard being filled: the next in order, unless a rank names its own (`capture_shards`)
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


def _capture_examples(plan: CapturePlan, teacher: Teacher, examples: list[Example], records: list[ShardRecord], emit: EventSink) -> None:
    """Capture `examples[start:]` into shards appended to `records`."""
    stops, cut = plan.stop_tokens["ids"], plan.overlong.truncate
    with ShardWriter(plan, records, total=len(examples), emit=emit) as writer:
        for i in range(writer.position, len(examples)):
            ex = examples[i]
            ids, mask, truncated = example_tokens(plan, teacher.model, ex, stops, cut)
            writer.make_room(len(ids))
            feats = None if plan.online else teacher.features(ids)
            writer.add(ShardItem(index=i, ids=ids, mask=mask, features=feats), ex, truncated=truncated)
        writer.close()
    emit(Log(level="debug", message=f"{len(records)} shards committed"))


def _shard_span(k: int, per: int, n: int) -> range:
    """Example indices of shard `k` when every shard holds `per` examples (the last one the rest)."""
    return range(k * per, min((k + 1) * per, n))


def _capture_shards(plan: CapturePlan, teacher: Teacher, examples: list[Example], shards: list[int],
                    records: list[ShardRecord], emit: EventSink) -> None:
    """Capture whole shards `shards` (a rank's share) into `records`: the bytes one rank would write."""
    stops, cut, per = plan.stop_tokens["ids"], plan.overlong.truncate, plan.cap.shard_examples
    with ShardWriter(plan, records, total=len(examples), emit=emit) as writer:
        for k in shards:
            writer.next_index = k
            for i in _shard_span(k, per, len(examples)):
                ids, mask, truncated = example_tokens(plan, teacher.model, examples[i], stops, cut)
                feats = None if plan.online else teacher.features(ids)
                writer.add(ShardItem(index=i, ids=ids, mask=mask, features=feats), examples[i], truncated=truncated)
            writer.end_shard()
        writer.close()
    emit(Log(level="debug", message=f"{len(records)} shards committed by this rank"))


@dataclass(frozen=True)
class TeacherRun:
    """Facts of one pass of the teacher, for the manifest's `run` section."""

    load_seconds: float
    released: bool


def _run_teacher(plan: CapturePlan, examples: list[Example], records: list[ShardRecord], emit: EventSink,
                 shards: list[int] | None = None) -> TeacherRun:
    """Load the teacher, capture the examples the committed `records` do not cover (or, for a rank,
    the `shards` it owns), release it."""
    # online features, none generated: nothing here needs the teacher's weights
    unloaded = plan.online and not plan.cap.regenerate
    if unloaded:
        teacher = Teacher(None, plan.geometry.layer_ids, device=plan.choice.device, dtype=plan.cap.dtype)
        emit(Log(message="online features: storing tokens only, the teacher is not loaded"))
    else:
        teacher = Teacher.load(plan.recipe.model.target, plan.geometry.layer_ids, device=plan.choice.device, dtype=plan.cap.dtype)
        emit(Log(message=f"teacher loaded in {teacher.load_seconds:.1f}s{teacher.skipped_note()}"))
    if shards is None:
        _capture_examples(plan, teacher, examples, records, emit)
    else:
        _capture_shards(plan, teacher, examples, shards, records, emit)
    if unloaded:
        return TeacherRun(0.0, True)
    # release the teacher before anything else allocates
    released = teacher.release()
    if released:
        emit(Log(level="debug", message="teacher released"))
    else:
        emit(Log(level="warning", message="the teacher is still referenced after capture; its memory was not released"))
    return TeacherRun(teacher.load_seconds, released)


# --------------------------------------------------------------------- 4. manifest
def capture_manifest(plan: CapturePlan, records: list[ShardRecord], examples: list[Example], run: dict[str, Any]) -> dict[str, Any]:
    """The manifest of a finished capture; `run` (timings, memory) is the only part that differs between runs."""
    recipe, cap, geo, key = plan.recipe, plan.cap, plan.geometry, plan.key
    mcfg, dcfg, tokenizer = recipe.model, recipe.data, plan.tokenizer
    by_split: dict[str, int] = {s: 0 for s in cap.splits}
    for ex in examples:
        by_split[ex.split] += 1
    return {
        "format": FORMAT,
        "capture_key": key.key,
        "key_inputs": key.inputs,
        "recipe_fingerprint": recipe.fingerprint(),
        "recipe": recipe.resolved(),
        "teacher": {
            "path": str(mcfg.target), "family": mcfg.family, "files": key.teacher_files,
            "num_hidden_layers": geo.num_layers, "hidden_size": geo.hidden, "vocab_size": geo.vocab,
        },
        "draft": {"path": str(mcfg.draft), "config_sha256": sha256_file(mcfg.draft / "config.json")},
        "tokenizer": {
            "files": key.tokenizer_files, "fingerprint": fingerprint(key.tokenizer_files),
            "chat_template_sha256": key.chat_template_sha256, "tokens": len(tokenizer),
        },
        "thinking": dcfg.thinking,
        "max_length": dcfg.max_length,
        "target_layer_ids": geo.layer_ids,
        "hidden_size": geo.hidden,
        "feature_dim": geo.hidden * len(geo.layer_ids),
        # "online": the shards hold tokens only; training computes the features (`capture.teacher`)
        "features": "online" if plan.online else "cache",
        "dtype": cap.dtype,
        "data": {
            "dir": str(dcfg.dir), "split_fingerprint": plan.prepared.split_fingerprint,
            "manifest_fingerprint": plan.prepared.manifest.get("fingerprint"), "splits": list(cap.splits),
            # the general rows mixed into train (`prepare-data --replay`), as prepare-data recorded them
            **({"replay": plan.prepared.manifest["replay"]} if "replay" in plan.prepared.manifest else {}),
        },
        "generation": key.generation,
        "stop_token_ids": plan.stop_tokens["ids"],
        "stop_token_sources": plan.stop_tokens["sources"],
        "stop_token_rule": plan.stop_tokens["rule"],
        "overlong": plan.overlong.to_manifest(),
        "shards": [r.manifest_entry() for r in records],
        "shards_total": len(records),
        "totals": {
            "examples": sum(r.examples for r in records),
            "tokens": sum(r.tokens for r in records),
            "loss_tokens": sum(r.loss_tokens for r in records),
            "payload_bytes": sum(r.bytes for r in records),
            "examples_by_split": by_split,
            "generation_truncated": sum(r.generation_truncated for r in records),
        },
        "software": software_versions() | {"dflash-worker": __version__},
        "device": device_provenance(plan.choice),
        # Everything below describes this run, not the payload; it differs between runs.
        "run": run,
    }


@dataclass(frozen=True)
class CapturePart:
    """One job's share of a capture divided over the jobs of a run's graph (`dflash_worker.worker`):
    the shards k with ``k % count == index``, the same split ranks use, so the union of the parts'
    shards is the bytes one process writes. A part writes no manifest; `assemble_capture` does."""

    index: int
    count: int

    def owns(self, k: int) -> bool:
        return k % self.count == self.index


def run_capture(recipe: Recipe, *, on_event: EventSink | None = None, device: DeviceChoice | None = None,
                part: CapturePart | None = None) -> dict[str, Any]:
    """Run (or resume) the capture described by `recipe`; returns the manifest written.

    Progress and milestones go to `on_event` as `worker.events` objects (module docstring).
    `device`: where to run (a job's placement); None resolves `[capture].device`.
    `part`: capture only that share of the shards and write no manifest; returns the part's
    summary (`shards`: the records of the part's shards) instead.
    """
    from .. import dist

    ranks = dist.ranks_from_env()
    emit = (on_event or _ignore) if ranks.main else _ignore
    t0 = time.perf_counter()
    plan = plan_capture(recipe, emit, device)
    if ranks.active or part is not None:
        return _run_capture_shared(plan, ranks, emit, t0, part)
    point = resume(plan.cap.output, plan.key.key)
    records = list(point.records)
    if point.complete is not None:
        emit(Log(message=f"already complete ({len(records)} shards verified)"))
        return point.complete
    examples = plan.examples()
    reused, n = len(records), len(examples)
    emit(Log(message=f"{n} examples, resuming at {point.start} ({reused} shards reused)"))
    emit(Progress(phase="capture", step=point.start, total_steps=n, metrics={"shards_reused": reused}))

    import torch

    from ..device import memory_peak, reset_peak

    reset_peak(plan.choice)
    teacher = _run_teacher(plan, examples, records, emit) if point.start < n else TeacherRun(0.0, True)
    run = {
        "shards_reused": reused,
        "shards_written": len(records) - reused,
        "teacher_load_seconds": round(teacher.load_seconds, 3),
        "seconds": round(time.perf_counter() - t0, 3),
        "teacher_released": teacher.released,
        "peak_memory": memory_peak(plan.choice),
        # CPU float results can depend on the intra-op thread count; byte-identity holds at equal counts
        "torch_threads": torch.get_num_threads(),
    }
    return _write_manifest(plan, records, examples, run, emit)


def _write_manifest(plan: CapturePlan, records: list[ShardRecord], examples: list[Example], run: dict[str, Any],
                    emit: EventSink) -> dict[str, Any]:
    n = len(examples)
    manifest = capture_manifest(plan, records, examples, run)
    assert manifest["totals"]["examples"] == n, "shards must cover every example exactly once"
    write_json_atomic(plan.cap.output / MANIFEST, manifest)
    emit(Log(level="debug", message=f"wrote `{MANIFEST}`: {len(records)} shards, {manifest['totals']['tokens']} tokens"))
    return manifest


# --------------------------------------------------------------------- several ranks (`dflash_worker.dist`)
def scan_shards(out: Path, key: str, n: int, per: int, ours: list[int] | None = None) -> tuple[dict[int, ShardRecord], dict[str, Any] | None]:
    """Rank 0's resume for a divided capture: keep each shard that verifies under `key` and covers exactly its
    span, remove the others, temporaries and an unfinished manifest; the manifest too when complete.
    `ours`: a part's shards (`CapturePart`), the only ones kept; a part has no manifest, so it is never complete."""
    old = _open_output(out, key)
    total = -(-n // per)
    kept: dict[int, ShardRecord] = {}
    for k in range(total) if ours is None else ours:
        record = _verify_shard(out, k, key)
        span = _shard_span(k, per, n)
        if record is not None and (record.first, record.end) == (span.start, span.stop):
            kept[k] = record
    if ours is None and old is not None and len(kept) == total and old.get("shards_total") == total:
        return kept, old
    _remove_shards(out, lambda idx: idx not in kept)
    return kept, None


def _split_shards(plan: CapturePlan, what: str) -> None:
    if plan.cap.shard_tokens is not None:
        raise ConfigError(
            f"`[capture].shard_tokens` with {what}: a shard's first example is not known before the earlier "
            "shards are captured\nhint: use `shard_examples` when the capture is divided"
        )


def _run_capture_shared(plan: CapturePlan, ranks: Any, emit: EventSink, t0: float, part: CapturePart | None) -> dict[str, Any]:
    """Capture as one of several ranks (module docstring of `dflash_worker.dist`) and/or as one `part` of a
    capture divided over jobs; returns the manifest (the part's summary for a part)."""
    import dataclasses

    import torch

    from .. import dist

    _split_shards(plan, f"{ranks.world} ranks" if part is None else f"the capture divided over {part.count} jobs")
    cap = plan.cap
    if ranks.active:
        device = dist.place(ranks, plan.choice.torch_device)
        if str(device) != plan.choice.device:
            plan = dataclasses.replace(plan, choice=dataclasses.replace(plan.choice, device=str(device)))
        dist.init(ranks, device)
    try:
        examples = plan.examples()
        n, per = len(examples), cap.shard_examples
        total = -(-n // per)
        ours = [k for k in range(total) if part is None or part.owns(k)]
        kept, complete = scan_shards(cap.output, plan.key.key, n, per, None if part is None else ours) if ranks.main else ({}, None)
        kept, complete = dist.broadcast(ranks, (kept, complete))
        if complete is not None:
            emit(Log(message=f"already complete ({len(kept)} shards verified)"))
            return complete
        # a rank's shards: every world-th of the job's, by position, so the split does not depend on what was kept
        mine = [k for j, k in enumerate(ours) if j % ranks.world == ranks.rank and k not in kept]
        where = f" over {ranks.world} ranks" if ranks.active else ""
        share = f"shards {_ranges(ours)} of {total} (part {part.index + 1} of {part.count})" if part is not None else f"{total} shards"
        emit(Log(message=f"{n} examples in {share}{where} ({len(kept)} shards reused)"))
        records: list[ShardRecord] = []
        from ..device import memory_peak, reset_peak

        reset_peak(plan.choice)
        teacher = _run_teacher(plan, examples, records, emit, shards=mine) if mine else TeacherRun(0.0, True)
        written = dist.gather(ranks, [r.to_json() for r in records])  # waits for every rank
        every = dict(kept)
        for piece in written:
            for doc in piece:
                rec = ShardRecord.from_json(doc)
                assert rec is not None
                every[rec.shard] = rec
        assert sorted(every) == ours, "ranks must cover every shard of the job exactly once"
        manifest = None
        if ranks.main and part is not None:
            manifest = {"part": part.index, "parts": part.count, "shards_total": total,
                        "shards": [every[k].manifest_entry() | {"shard": k} for k in ours],
                        "shards_reused": len(kept), "seconds": round(time.perf_counter() - t0, 3)}
        elif ranks.main:
            run = {
                "shards_reused": len(kept),
                "shards_written": total - len(kept),
                "ranks": ranks.world,
                "teacher_load_seconds": round(teacher.load_seconds, 3),
                "seconds": round(time.perf_counter() - t0, 3),
                "teacher_released": teacher.released,
                "peak_memory": memory_peak(plan.choice),  # rank 0's
                "torch_threads": torch.get_num_threads(),
            }
            manifest = _write_manifest(plan, [every[k] for k in range(total)], examples, run, emit)
        manifest = dist.broadcast(ranks, manifest)
        dist.barrier(ranks)  # every rank has the manifest before any leaves the group
        return manifest
    finally:
        dist.shutdown(ranks)


def _ranges(ks: list[int]) -> str:
    """`0, 3, 6` for a short list, else its first and last with the count."""
    return ", ".join(map(str, ks)) if len(ks) <= 6 else f"{ks[0]}, {ks[1]}, ... {ks[-1]} ({len(ks)})"


def assemble_capture(recipe: Recipe, *, on_event: EventSink | None = None, device: DeviceChoice | None = None) -> dict[str, Any]:
    """The manifest of a capture whose shards other jobs wrote (`CapturePart`) and that now lie in
    `[capture].output`: every shard must verify under this recipe's capture key and cover its span,
    or `DataError` names the first missing ones. Writes the manifest one process would have written
    (its `run` section aside); returns it."""
    emit = on_event or _ignore
    t0 = time.perf_counter()
    plan = plan_capture(recipe, emit, device)
    _split_shards(plan, "the capture divided over jobs")
    examples = plan.examples()
    n, per = len(examples), plan.cap.shard_examples
    total = -(-n // per)
    kept, complete = scan_shards(plan.cap.output, plan.key.key, n, per)
    if complete is not None:
        emit(Log(message=f"already complete ({len(kept)} shards verified)"))
        return complete
    missing = [k for k in range(total) if k not in kept]
    if missing:
        raise DataError(
            f"`{plan.cap.output}`: {len(missing)} of {total} capture shards are missing or do not verify under capture key "
            f"`{plan.key.key}`: shard {_ranges(missing)}\nhint: every capture job of the run must succeed with this recipe first"
        )
    run = {"shards_reused": total, "shards_written": 0, "assembled": True, "seconds": round(time.perf_counter() - t0, 3)}
    emit(Log(message=f"assembled {total} capture shards ({n} examples) from the run's capture jobs"))
    return _write_manifest(plan, [kept[k] for k in range(total)], examples, run, emit)
