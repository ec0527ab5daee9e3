"""The ``noop`` stage: a counting job the run-manager's tests drive (no torch, no data).

``spec.noop``: ``steps`` (default 6), ``step_seconds`` (default 0.05),
``checkpoint_every`` (default 2). Each step folds the step number into a sha256
chain, so the final ``state`` is the same whether or not the job was interrupted and
resumed: a resumed run that lost or repeated a step gives a different digest.

A checkpoint is a directory ``checkpoints/step-NNNNNN/`` holding one
``manifest.json`` (``format``, ``step``, ``state``), reported as the ``checkpoint``
artifact like a training checkpoint's manifest; it is committed with the same
protocol (written into a temporary sibling, fsynced, renamed).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

from ..errors import CheckpointError
from ..manifest import _fsync_dir, write_bytes_atomic
from .context import StageContext, Stopped
from .events import Progress

log = logging.getLogger("dflash_worker.job")

NOOP_SEED = "dflash-noop-v1"
FORMAT = "dflash-worker-noop-checkpoint/1"


def _step(state: str, step: int) -> str:
    return hashlib.sha256(f"{state}:{step}".encode()).hexdigest()


def noop_final_state(steps: int) -> str:
    """The `state` an uninterrupted noop run of `steps` steps ends with."""
    state = hashlib.sha256(NOOP_SEED.encode()).hexdigest()
    for k in range(1, steps + 1):
        state = _step(state, k)
    return state


def _commit(job_dir: Path, step: int, state: str) -> Path:
    """Commit checkpoint `step`; returns its manifest."""
    root = job_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_bytes_atomic(tmp / "manifest.json", json.dumps({"format": FORMAT, "step": step, "state": state}, sort_keys=True).encode())
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    return final / "manifest.json"


def _resume(path: Path, steps: int) -> tuple[int, str]:
    try:
        ck = json.loads(path.read_bytes())
        if ck.get("format") != FORMAT:
            raise ValueError(f"format is not `{FORMAT}`")
        start, state = int(ck["step"]), str(ck["state"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"cannot resume from `{path}`: {exc}") from None
    if not 0 <= start <= steps:
        raise CheckpointError(f"checkpoint `{path}` is at step {start}, outside 0..{steps}")
    return start, state


def _resume_newest_usable(ctx: StageContext, steps: int) -> tuple[int, str] | None:
    """The lease's resume checkpoint, else this job directory's newest one that loads; None for a fresh
    start. One that does not load is skipped with a warning, never the job's failure (it may be another
    attempt's bytes)."""
    own = sorted((ctx.job_dir / "checkpoints").glob("step-*/manifest.json"), reverse=True)
    candidates = [ctx.spec.resume_checkpoint] if ctx.spec.resume_checkpoint is not None else []
    candidates += [p for p in own if p not in candidates]
    for path in candidates:
        try:
            return _resume(path, steps)
        except CheckpointError as exc:
            log.warning("skipped resume checkpoint `%s`: %s", path, exc)
    return None


def run_noop(ctx: StageContext) -> None:
    """Count `steps` steps, checkpointing every `checkpoint_every`; write a report artifact."""
    cfg = ctx.spec.job.noop
    state, start = hashlib.sha256(NOOP_SEED.encode()).hexdigest(), 0
    if ctx.spec.resume_checkpoint is not None:
        found = _resume_newest_usable(ctx, cfg.steps)
        if found is not None:
            start, state = found
            log.info("resuming noop from step %d", start)
        else:
            log.warning("no checkpoint could be resumed; noop starts from step 0")
    committed = start
    for k in range(start + 1, cfg.steps + 1):
        time.sleep(cfg.step_seconds)
        state = _step(state, k)
        # read the flag once: a SIGTERM that lands after the commit decision (say, while the progress
        # event is written) is served at the next step boundary, never with the step uncommitted
        stop = ctx.stop_requested
        if k % cfg.checkpoint_every == 0 or ctx.checkpoint_requested or stop:
            ctx.checkpoint_requested = False
            ctx.report(_commit(ctx.job_dir, k, state), kind="checkpoint", step=k)
            committed = k
        ctx.emit(Progress(phase="train", step=k, total_steps=cfg.steps, metrics={"loss": 1.0 / (k + 1)}, committed_step=committed))
        if stop:
            raise Stopped(committed)

    report = ctx.job_dir / "export" / "noop-report.json"
    report.parent.mkdir(parents=True, exist_ok=True)
    body = {"steps": cfg.steps, "state": state, "resumed_from": start, "restart": ctx.spec.restart}
    write_bytes_atomic(report, json.dumps(body, sort_keys=True).encode())
    _fsync_dir(report.parent)
    ctx.report(report, kind="report", step=cfg.steps)
