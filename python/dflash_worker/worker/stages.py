"""The stages of a coordinator job (``spec.stages``, run in order by `dflash_worker.job`).

Each stage is idempotent, so a restarted attempt re-runs the list and finished work is
verified or skipped:

- ``prepare``: ``prepare-data`` of ``spec.inputs`` into ``DIR/data``;
- ``check``: ``check-data`` against the target's tokenizer (no weights); examples over
  ``max_length`` fail it only under ``[capture].on_overlong = "fail"``;
- ``capture``: teacher features into ``DIR/capture`` (resumes by shard);
- ``train``: ``DIR/run``; resumes from its newest committed checkpoint, or from the
  lease's ``resume_checkpoint`` (a checkpoint's ``manifest.json``) when this directory
  has none; a checkpoint that fails to load or does not fit the run is skipped with a
  warning for the next older one, else training starts fresh (never the job's failure:
  it may be another attempt's); exports the selected checkpoint in ``[export].format``;
- ``export``: further formats listed in ``spec.export_formats``;
- ``evaluate``: released vs trained draft on held-out prompts, ``DIR/eval``;
- ``noop``: a counting stage the run-manager's tests use (`dflash_worker.worker.noop`).

A job of a run's job graph (``spec.graph``, `spec.GraphInfo`) runs its kind's stages
(`spec.GRAPH_KIND_STAGES`) on the inputs the run-manager downloaded into the job directory,
and reports what later jobs need:

- ``prepare``: every file of ``DIR/data`` (kind ``data``; the manifest as ``manifest``);
- ``capture`` shard i of N: the capture shards k with ``k % N == i`` and their sidecars
  (kind ``capture``), no manifest (`capture.CapturePart`);
- ``train``: first ``assemble``: the shards of every capture job become one capture with
  its manifest (`capture.assemble_capture`); then training and export as in a pipeline,
  plus ``run/selection.json`` (kind ``manifest``) for the evaluate jobs;
- ``evaluate`` shard j of M: the prompts with ``i % M == j`` of the train job's BF16
  export; shard j > 0 reports ``eval/part-J.json``, shard 0 (which runs last) merges them
  into the one report (`evaluate.report.EvalPart`);
- ``verify`` shard i of N (a run's `verify_fraction`): capture shard i again into ``DIR/verify``
  and report the files as ``verify/capture/...`` (kind ``capture``), whose digests the
  coordinator compares with the capture job's (`run_verify`); of the train job (handed its
  ``run/selection.json``): assemble the capture, replay training from the lease's resume
  checkpoint (or step 0) to the selected step into ``DIR/verify/run``, export that checkpoint,
  and report its files and the exports as ``verify/run/...`` (`run_verify_train`).

Library calls report through typed events (`dflash_worker.worker.events`); a stage
forwards ``Progress`` and ``Artifact`` (renamed relative to the job directory) to the
run-manager and writes ``Log`` events to the log. Torch and the training stack are
imported inside the stages, so reading a spec never needs them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .context import StageContext, Stopped
from .events import Artifact, Event, Log, Progress
from .noop import run_noop
from .spec import ASSEMBLE_STAGE, CAPTURE_DIR, DATA_DIR, EVAL_DIR, RUN_DIR, VERIFY_DIR, VERIFY_STAGE, VERIFY_TRAIN_STAGE

log = logging.getLogger("dflash_worker.job")


def _progress(ctx: StageContext, phase: str, step: int, total: int, **metrics: float) -> None:
    ctx.emit(Progress(phase=phase, step=step, total_steps=total, metrics=metrics))


def _relay(ctx: StageContext, event: Event) -> None:
    """Forward a library event: progress and artifacts to the run-manager, logs to the log."""
    if isinstance(event, Progress):
        ctx.emit(event)
    elif isinstance(event, Artifact):
        ctx.forward(event)
    elif isinstance(event, Log):
        log.log(logging.getLevelName(event.level.upper()), "%s", event.message)


def run_prepare(ctx: StageContext) -> None:
    from ..data import prepare_data

    job = ctx.spec.job
    _progress(ctx, "prepare", 0, 1)
    manifest = prepare_data(list(job.inputs), ctx.job_dir / DATA_DIR, **job.prepare.kwargs())
    ctx.report(ctx.job_dir / DATA_DIR / "manifest.json", kind="manifest")
    if ctx.spec.graph is not None:  # the later jobs of the graph run on other machines: they need the splits
        for f in sorted(p for p in (ctx.job_dir / DATA_DIR).rglob("*") if p.is_file() and p.name != "manifest.json"):
            ctx.report(f, kind="data")
    counts = manifest.get("counts", {}).get("split", {}) if isinstance(manifest.get("counts"), dict) else {}
    _progress(ctx, "prepare", 1, 1, **{f"rows_{k}": float(v) for k, v in counts.items() if isinstance(v, int)})


def run_check(ctx: StageContext) -> None:
    from ..data import check_data

    recipe = ctx.spec.job.require_recipe()
    cap = recipe.capture
    report = check_data(
        recipe.data.dir,
        recipe.model.target,
        thinking=recipe.data.thinking,
        train_turns=recipe.data.train_turns,
        max_length=recipe.data.max_length,
        regenerate=bool(cap and cap.regenerate),
    )
    report.raise_if_failed(overlong=cap.on_overlong if cap else "fail")
    _progress(ctx, "check", 1, 1, examples=float(report.examples))


def _capture_events(ctx: StageContext, on_shard: Callable[[int], None] | None = None) -> Callable[[Event], None]:
    def on_event(e: Event) -> None:
        _relay(ctx, e)
        if on_shard is not None and isinstance(e, Progress) and "shard" in e.metrics:
            on_shard(int(e.metrics["shard"]))  # (a shard and its sidecar are on disk once this is emitted)
        if ctx.stop_requested:
            # capture commits whole shards; an interrupted shard is redone on resume
            raise Stopped(0)

    return on_event


def run_capture_stage(ctx: StageContext) -> None:
    from .. import dist
    from ..capture import CapturePart, run_capture
    from ..capture.layout import shard_path, sidecar_path

    recipe = ctx.spec.job.require_recipe()
    recipe.require("capture")
    graph = ctx.spec.graph
    part = CapturePart(graph.shard_index, graph.shard_count) if graph is not None else None
    out = ctx.job_dir / CAPTURE_DIR
    reported: set[int] = set()

    def report_shard(k: int) -> None:
        # A part reports each shard as it commits, so a provider lost mid-job leaves its shards with
        # the coordinator, which hands them to the job's next attempt (`store.inputs`).
        if k not in reported:
            reported.add(k)
            ctx.report(shard_path(out, k), kind="capture")
            ctx.report(sidecar_path(out, k), kind="capture")

    on_event = _capture_events(ctx, report_shard if part is not None else None)
    done = run_capture(recipe, on_event=on_event, device=ctx.devices["capture"], part=part)
    if part is None:
        ctx.report(out / "manifest.json", kind="capture")
    elif dist.ranks_from_env().main:  # a part has no manifest: its shards are what the train job assembles
        for entry in done["shards"]:  # the reused ones, and other ranks' (only rank 0 sees its own commits)
            report_shard(entry["shard"])
        _progress(ctx, "capture", len(done["shards"]), len(done["shards"]), shards=float(len(done["shards"])))


def run_verify(ctx: StageContext) -> None:
    """A graph's verify job: capture its shard again into `VERIFY_DIR` from the prepared data alone (never
    reusing the producer's shards, its inputs), and report each file under its name there, ``verify/capture/...``.
    The coordinator compares those digests with the producer's records (`coordinator.store.verify`); what this
    stage logs about its inputs is for the provider's own log."""
    import dataclasses

    from .. import dist
    from ..capture import CapturePart, run_capture
    from ..capture.layout import shard_path, sidecar_path
    from ..manifest import sha256_file

    recipe = ctx.spec.job.require_recipe()
    recipe.require("capture")
    graph = ctx.spec.graph
    out = ctx.job_dir / VERIFY_DIR / CAPTURE_DIR
    recipe = dataclasses.replace(recipe, capture=dataclasses.replace(recipe.capture, output=out))
    done = run_capture(recipe, on_event=_capture_events(ctx), device=ctx.devices["capture"], part=CapturePart(graph.shard_index, graph.shard_count))
    if not dist.ranks_from_env().main:
        return
    theirs = {a.name: a.sha256 for a in graph.inputs if a.kind == "capture"}
    differ = 0
    for entry in done["shards"]:
        for f in (shard_path(out, entry["shard"]), sidecar_path(out, entry["shard"])):
            name = f.relative_to(ctx.job_dir / VERIFY_DIR).as_posix()
            if theirs.get(name) != sha256_file(f):
                differ += 1
                log.warning("verify: recomputed `%s` differs from the input the coordinator handed (sha256 %s)", name, theirs.get(name, "none"))
            ctx.report(f, kind="capture")
    _progress(ctx, "capture", len(done["shards"]), len(done["shards"]), shards=float(len(done["shards"])), differ=float(differ))


def handed_interpolation(handed: Any) -> dict[str, Any] | None:
    """The ``interpolation`` of a train job's handed ``selection.json`` that its export used: None (the
    checkpoint's own values) or ``{"alpha": A}`` with A a number in [0, 1]; anything else is refused
    (`DataError`), so a verify job exports exactly the point the producer says it exported. The alpha is
    the producer's word: the replay stops at the selected step and never sees the later validations that
    chose it, so what is verified is the export's bytes at that alpha, not the search."""
    from ..errors import DataError
    from .spec import SELECTION_INPUT

    interp = handed.get("interpolation") if isinstance(handed, dict) else None
    if interp is None:
        return None
    alpha = interp.get("alpha") if isinstance(interp, dict) else "?"
    if alpha is None:
        return None
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) <= 1.0:
        raise DataError(f"the train job's selection `{SELECTION_INPUT}` has an interpolation alpha that is not a number "
                        f"in [0, 1] (`{str(alpha)[:40]}`)")
    return {"alpha": float(alpha)}


def run_verify_train(ctx: StageContext) -> None:
    """A graph's verify job of the train job: replay its training in ``DIR/verify/run`` from the lease's resume
    checkpoint (the producer's, seeded like train's; step 0 without one) up to the step its handed selection
    names, on the full run's schedule (`train.train` with `stop_at`); export that checkpoint in every format
    the job exports; report the checkpoint's files and the exports as ``verify/run/...`` (kind ``manifest``),
    whose digests the coordinator compares with the train job's (`coordinator.store.verify`)."""
    import json

    from ..errors import CheckpointError, DataError
    from ..train import checkpoint as ckpt
    from ..train import train
    from ..train.export_run import export_dir_name, export_run
    from ..train.signals import StopFlags
    from .spec import SELECTION_INPUT

    recipe = ctx.spec.job.require_recipe()
    recipe.require("train")
    try:
        handed = json.loads((ctx.job_dir / SELECTION_INPUT).read_text())
        step = handed["step"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"the train job's selection `{SELECTION_INPUT}` cannot be read: {exc}") from None
    if isinstance(step, bool) or not isinstance(step, int):
        raise DataError(f"the train job's selection `{SELECTION_INPUT}` names no step (`{str(step)[:40]}`)")
    interpolation = handed_interpolation(handed)
    out = ctx.job_dir / VERIFY_DIR / RUN_DIR
    resume_from = ctx.spec.resume_checkpoint
    if resume_from is not None and resume_from.is_file():
        try:  # the producer's checkpoint: one that cannot be used makes the replay start at step 0
            seeded = ckpt.seed(out, resume_from)
        except CheckpointError as exc:
            log.warning("skipped resume checkpoint `%s`: %s; the replay starts from its own directory or step 0", resume_from, exc)
            seeded = None
        if seeded is not None:
            log.info("replay seeded from the producer's checkpoint `%s` (step %d)", resume_from, seeded)
    flags = StopFlags()

    def on_event(e: Event) -> None:
        if isinstance(e, Artifact):  # its checkpoints stay here: only the replayed step's files are compared
            return
        _relay(ctx, e)
        if ctx.stop_requested:
            flags.request_stop("SIGTERM")

    result = train(
        recipe, run_dir=out, resume=ckpt.latest(out) is not None, on_event=on_event, flags=flags, device=ctx.devices["train"],
        attention=ctx.placement.draft_attention, skip_unusable=True, stop_at=step,
    )  # fmt: skip
    if result.status == "stopped":
        raise Stopped(result.step)
    path = out / ckpt.CHECKPOINTS / ckpt.step_name(step)
    for f in sorted(p for p in path.iterdir() if p.is_file()):
        ctx.report(f, kind="manifest", step=step)
    formats = [recipe.export.format if recipe.export is not None else "bf16"]
    if "export" in ctx.spec.job.stages:  # the train job's export stage: further formats
        formats += [f for f in ctx.spec.job.export_formats if f not in formats]
    for fmt in formats:
        chosen = {"checkpoint": path.name, "interpolation": interpolation}
        exported = export_run(out, fmt=fmt, recipe=recipe, selection=chosen, out_dir=out / export_dir_name(fmt))
        ctx.report_all(exported.out_dir, kind="manifest", step=step)
    log.info("replayed training to step %d and exported it (%s)", step, ", ".join(formats))


def run_assemble(ctx: StageContext) -> None:
    """A graph's train job: the capture jobs' shards (downloaded inputs) become one capture."""
    from ..capture import assemble_capture

    recipe = ctx.spec.job.require_recipe()
    recipe.require("capture")
    manifest = assemble_capture(recipe, on_event=_capture_events(ctx), device=ctx.devices["capture"])
    log.info("capture assembled: %d shards, key `%s`", manifest["shards_total"], manifest["capture_key"])


def run_train(ctx: StageContext) -> None:
    from .. import dist
    from ..errors import CheckpointError
    from ..train import checkpoint as ckpt
    from ..train import train
    from ..train.export_run import SELECTION
    from ..train.signals import StopFlags

    recipe = ctx.spec.job.require_recipe()
    recipe.require("train")
    run_dir = ctx.job_dir / RUN_DIR
    ranks = dist.ranks_from_env()
    resume = False
    if ranks.main:  # one rank seeds the shared run directory; the others learn what it found
        resume_from = ctx.spec.resume_checkpoint
        if resume_from is not None and not resume_from.is_file():
            log.warning("resume checkpoint `%s` is gone; training starts from its own directory or fresh", resume_from)
        elif resume_from is not None:
            try:
                seeded = ckpt.seed(run_dir, resume_from)
            except CheckpointError as exc:  # another attempt's bytes: skipped, never the job's failure
                log.warning("skipped resume checkpoint `%s`: %s; training starts from its own directory or fresh", resume_from, exc)
                seeded = None
            if seeded is not None:
                log.info("seeded run from resume checkpoint `%s` (step %d)", resume_from, seeded)
        resume = ckpt.latest(run_dir) is not None or (run_dir / SELECTION).is_file()
    resume = dist.broadcast(ranks, resume)  # (the job holds the process group: `dflash_worker.job`)
    flags = StopFlags()

    def on_event(e: Event) -> None:
        _relay(ctx, e)
        if ctx.stop_requested:
            flags.request_stop("SIGTERM")
        if ctx.checkpoint_requested:
            ctx.checkpoint_requested = False
            flags.request_checkpoint()

    result = train(
        recipe,
        run_dir=run_dir,
        resume=resume,
        on_event=on_event,
        flags=flags,
        device=ctx.devices["train"],
        attention=ctx.placement.draft_attention,
        skip_unusable=True,  # a checkpoint that cannot be resumed is a warning: an older one, or a fresh start
    )
    if result.status == "stopped":
        raise Stopped(result.step)
    # The selected step (the export's checkpoint) is the step of the export and selection records: a
    # verify job replays training up to it (`coordinator.store.verify.selected_step`).
    selected = int(result.selection["step"]) if result.selection is not None else result.step
    if result.status == "verified" and result.export_dir is not None:
        ctx.report_all(result.export_dir, kind="export", step=selected)
    if ctx.spec.graph is not None and ranks.main:  # the evaluate jobs read which step was selected
        ctx.report(run_dir / SELECTION, kind="manifest", step=selected)


def run_export(ctx: StageContext) -> None:
    from ..train.export_run import export_run, read_selection

    recipe = ctx.spec.job.require_recipe()
    formats = ctx.spec.job.export_formats
    run_dir = ctx.job_dir / RUN_DIR
    for i, fmt in enumerate(formats, 1):
        result = export_run(run_dir, fmt=fmt, recipe=recipe)
        step = int(read_selection(run_dir)["step"])
        ctx.report_all(result.out_dir, kind="export", step=step)
        _progress(ctx, "export", i, len(formats))


def run_evaluate(ctx: StageContext) -> None:
    from .. import dist
    from ..errors import ConfigError
    from ..evaluate.report import EvalPart, evaluate_run

    opts = ctx.spec.job.evaluate
    out = ctx.job_dir / EVAL_DIR
    graph = ctx.spec.graph
    part = EvalPart(graph.shard_index, graph.shard_count) if graph is not None else None
    if graph is not None and not (ctx.job_dir / RUN_DIR / "export" / "manifest.json").is_file():
        raise ConfigError(
            "a graph run's evaluate job scores the train job's BF16 export `run/export`, and its inputs hold none"
            "\nhint: keep `bf16` in the recipe's `[export].format` (AF4G64 can be added with `spec.export_formats`)"
        )
    report = evaluate_run(
        ctx.job_dir / RUN_DIR,
        split=opts.split,
        out_dir=out,
        max_prompts=opts.max_prompts,
        on_event=lambda e: _relay(ctx, e),
        device=ctx.devices["evaluate"],
        recipe=ctx.spec.job.recipe if graph is not None else None,
        part=part,
    )
    if not dist.ranks_from_env().main:  # rank 0 wrote the report (its prompts and everyone's rows) and reports it
        return
    if part is not None and part.count > 1 and part.index > 0:
        ctx.report(part.file(out), kind="report")
        _progress(ctx, "evaluate", len(report["rows"]), len(report["rows"]))
        return
    # The other shards' parts (inputs merged into the report) are theirs to report, not this job's.
    parts = {part.file(out, j) for j in range(part.count)} if part is not None else set()
    for f in sorted(p for p in out.rglob("*") if p.is_file() and p not in parts):
        ctx.report(f, kind="report")
    n = int(report["prompts"])
    b, t = report["baseline"], report["trained"]
    # pooled tau (committed tokens / verify steps) is the headline, as in the report; the per-prompt mean beside it
    _progress(ctx, "evaluate", n, n, tau_baseline=b["tau_pooled"], tau_trained=t["tau_pooled"],
              tau_baseline_mean=b["tau_mean"], tau_trained_mean=t["tau_mean"])  # fmt: skip


# Stage name -> runner (the names are `spec.STAGE_NAMES`).
STAGES: dict[str, Callable[[StageContext], None]] = {
    ASSEMBLE_STAGE: run_assemble,
    VERIFY_STAGE: run_verify,
    VERIFY_TRAIN_STAGE: run_verify_train,
    "prepare": run_prepare,
    "check": run_check,
    "capture": run_capture_stage,
    "train": run_train,
    "export": run_export,
    "evaluate": run_evaluate,
    "noop": run_noop,
}
