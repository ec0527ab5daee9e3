"""`capture`: run the frozen teacher over prepared data and cache the draft's target features.

Order of work, cheapest checks first, one function per step; this module holds the run
(steps 3 and 4, and the capture divided over ranks or jobs), the steps before it live in
`capture.plan` and `capture.shards`:

1. `plan_capture` (`capture.plan`): read the recipe sections, verify the prepared data hashes,
   load the tokenizer and run `check_data` (no weights read yet); read
   `target_layer_ids` from the released draft's config.json (`dflash_config`
   first, then top level) and check them against the target's
   `num_hidden_layers`; check the tokenizer fits the target vocab
   (`read_geometry`); hash the teacher files and the tokenizer into the
   *capture key* (`capture_key`): every input that shapes the payload bytes
   (no paths, no timestamps); decide `[capture].on_overlong` for examples
   over `max_length` (`capture.overlong`) and read the stop ids
   (`dflash_worker.stop_tokens`);
2. `resume` (`capture.shards`): shards whose sidecar names the same key and whose sha256 verifies
   are kept; the first one that does not verify, and everything after it, is
   removed and rewritten; a dir holding a different capture is refused;
3. `_run_teacher`: stream the teacher in (`capture.teacher.Teacher`, the component
   online training calls too), optionally regenerate each response (greedy or per-example seeded
   sampling), run the teacher once over prompt+response with
   `output_hidden_states` and keep ``hidden_states[id + 1]`` for each target
   layer id (an example longer than `[capture].chunk_tokens` in chunks through the target's
   cache, `capture.teacher`); a `ShardWriter` (`capture.shards`) writes shards atomically (shard, then sidecar) on
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

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..data import Example
from ..errors import ConfigError, DataError
from ..manifest import device_provenance, fingerprint, sha256_file, software_versions, write_json_atomic
from ..recipe import Recipe
from ..worker.events import Event, EventSink, Log, Progress
from .layout import FORMAT, MANIFEST
from .plan import CapturePlan, plan_capture
from .shards import ShardItem, ShardRecord, ShardWriter, resume, scan_shards, shard_span
from .teacher import Teacher, example_tokens

if TYPE_CHECKING:
    from ..device import DeviceChoice


def _ignore(event: Event) -> None:
    pass


# --------------------------------------------------------------------- 3. teacher and shards
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


def _capture_shards(plan: CapturePlan, teacher: Teacher, examples: list[Example], shards: list[int],
                    records: list[ShardRecord], emit: EventSink) -> None:
    """Capture whole shards `shards` (a rank's share) into `records`: the bytes one rank would write."""
    stops, cut, per = plan.stop_tokens["ids"], plan.overlong.truncate, plan.cap.shard_examples
    with ShardWriter(plan, records, total=len(examples), emit=emit) as writer:
        for k in shards:
            writer.next_index = k
            for i in shard_span(k, per, len(examples)):
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
        teacher = Teacher.load(plan.recipe.model.target, plan.geometry.layer_ids, device=plan.choice.device, dtype=plan.cap.dtype,
                               chunk_tokens=plan.cap.chunk_tokens)
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


# --------------------------------------------------------------------- several ranks (`dflash_worker.dist`), several jobs
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
