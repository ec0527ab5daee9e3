"""The stages of a coordinator job (``spec.stages``, run in order by `dflash_worker.job`).

Each stage is idempotent, so a restarted attempt re-runs the list and finished work is
verified or skipped:

- ``prepare``: ``prepare-data`` of ``spec.inputs`` into ``DIR/data``;
- ``check``: ``check-data`` against the target's tokenizer (no weights); examples over
  ``max_length`` fail it only under ``[capture].on_overlong = "fail"``;
- ``capture``: teacher features into ``DIR/capture`` (resumes by shard);
- ``train``: ``DIR/run``; resumes from its newest committed checkpoint, or from the
  lease's ``resume_checkpoint`` (a checkpoint's ``manifest.json``) when this directory
  has none; exports the selected checkpoint in ``[export].format``;
- ``export``: further formats listed in ``spec.export_formats``;
- ``evaluate``: released vs trained draft on held-out prompts, ``DIR/eval``;
- ``noop``: a counting stage the run-manager's tests use (`dflash_worker.worker.noop`).

Library calls report through typed events (`dflash_worker.worker.events`); a stage
forwards ``Progress`` and ``Artifact`` (renamed relative to the job directory) to the
run-manager and writes ``Log`` events to the log. Torch and the training stack are
imported inside the stages, so reading a spec never needs them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .context import StageContext, Stopped
from .events import Artifact, Event, Log, Progress
from .noop import run_noop
from .spec import CAPTURE_DIR, DATA_DIR, EVAL_DIR, RUN_DIR

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
        max_length=recipe.data.max_length,
        regenerate=bool(cap and cap.regenerate),
    )
    report.raise_if_failed(overlong=cap.on_overlong if cap else "fail")
    _progress(ctx, "check", 1, 1, examples=float(report.examples))


def run_capture_stage(ctx: StageContext) -> None:
    from ..capture import run_capture

    recipe = ctx.spec.job.require_recipe()
    recipe.require("capture")

    def on_event(e: Event) -> None:
        _relay(ctx, e)
        if ctx.stop_requested:
            # capture commits whole shards; an interrupted shard is redone on resume
            raise Stopped(0)

    run_capture(recipe, on_event=on_event, device=ctx.devices["capture"])
    ctx.report(ctx.job_dir / CAPTURE_DIR / "manifest.json", kind="capture")


def run_train(ctx: StageContext) -> None:
    from .. import dist
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
            seeded = ckpt.seed(run_dir, resume_from)
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
    )
    if result.status == "stopped":
        raise Stopped(result.step)
    if result.status == "verified" and result.export_dir is not None:
        ctx.report_all(result.export_dir, kind="export", step=result.step)


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
    from ..evaluate.report import evaluate_run

    opts = ctx.spec.job.evaluate
    out = ctx.job_dir / EVAL_DIR
    report = evaluate_run(
        ctx.job_dir / RUN_DIR,
        split=opts.split,
        out_dir=out,
        max_prompts=opts.max_prompts,
        on_event=lambda e: _relay(ctx, e),
        device=ctx.devices["evaluate"],
    )
    if not dist.ranks_from_env().main:  # rank 0 wrote the report (its prompts and everyone's rows) and reports it
        return
    ctx.report_all(out, kind="report")
    n = int(report["prompts"])
    b, t = report["baseline"], report["trained"]
    # pooled tau (committed tokens / verify steps) is the headline, as in the report; the per-prompt mean beside it
    _progress(ctx, "evaluate", n, n, tau_baseline=b["tau_pooled"], tau_trained=t["tau_pooled"],
              tau_baseline_mean=b["tau_mean"], tau_trained_mean=t["tau_mean"])  # fmt: skip


# Stage name -> runner (the names are `spec.STAGE_NAMES`).
STAGES: dict[str, Callable[[StageContext], None]] = {
    "prepare": run_prepare,
    "check": run_check,
    "capture": run_capture_stage,
    "train": run_train,
    "export": run_export,
    "evaluate": run_evaluate,
    "noop": run_noop,
}
