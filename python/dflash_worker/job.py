"""Stage runner for one coordinator job: ``dflash_worker.job.main(["--job-dir", DIR])``.

The native client (``dflash-native-client --job-dir DIR``) calls ``main``;
``python -m dflash_worker.job --job-dir DIR`` does the same without Rust.
The run-manager writes ``DIR/spec.json`` (`dflash_worker.worker.spec.JobSpec`: job
spec, lease facts, device, downgrades, resume checkpoint); `Placement` applies its
device policy; the stages of `dflash_worker.worker.stages` run in the listed order.
This module talks back with the event protocol of ``docs/worker-events.md``: one
JSON object per line on stdout (``progress``, ``artifact``, ``done``, ``error``,
``stopped``), written by one `JsonLinesSink`; logs are JSON lines on stderr.

A job of a run's job graph (``spec.json`` ``graph``: kind, shard, inputs already downloaded
into DIR) runs only its kind's stages (`dflash_worker.worker.spec.GraphInfo.stages`; what
each kind reads and reports: `dflash_worker.worker.stages`).

Signals: SIGTERM -> commit a checkpoint at the next step boundary, emit
``stopped`` and return 0. SIGUSR1 -> commit a checkpoint at the next step
boundary and continue.

Several local ranks (``spec.json`` ``local_ranks`` N > 1; the run-manager starts N
processes with the `torch.distributed` environment, `dflash_worker.dist`): every rank
joins one process group for the job and runs the stages that divide work
(``capture``, ``train``, ``evaluate``: `RANKED_STAGES`); rank 0 alone runs the others and reports
every event, while the other ranks wait for it (`dist.await_published`) and exit 0
after the last ranked stage. Every stage before the last ranked one ends with rank 0's
`publish`, so no rank starts a stage before rank 0 has finished the one before it (the
end of a ranked stage is rank 0's: capture's manifest, train's selection and export). Another rank's only event is an ``error``, which says
why it is about to exit.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path

from .errors import DflashError
from .worker.events import Done, Error, JsonLinesSink, Progress
from .worker.events import Stopped as StoppedEvent

log = logging.getLogger("dflash_worker.job")

# Stages every rank runs (each divides its work over the ranks); rank 0 alone runs the rest.
RANKED_STAGES = frozenset({"capture", "train", "evaluate"})  # (a graph's `assemble` is rank 0's)


class _JsonLogFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def _setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonLogFormatter())
    root = logging.getLogger("dflash_worker")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    root.propagate = False


def _errors_only(sink):
    """The event sink of a rank other than 0: only its `error` reaches the run-manager."""

    def emit(event) -> None:
        if isinstance(event, Error):
            sink(event)

    return emit


def _run_stages(ctx, stages, names: list[str]) -> None:
    """The stage loop of the module docstring, for one rank or several."""
    if ctx.placement.local_ranks == 1:  # (torch is imported by the stages that need it, not here)
        for name in names:
            log.info("stage `%s` starting", name)
            stages[name](ctx)
        return
    from . import dist
    from .worker.context import Stopped

    ranks = dist.ranks_from_env()
    ranked = [i for i, name in enumerate(names) if name in RANKED_STAGES]
    if ranked:
        # every rank joins once, on the device of the first stage that needs the ranks
        device = dist.place(ranks, ctx.devices[names[ranked[0]]].torch_device)
        dist.hold(ranks, device)
    try:
        for i, name in enumerate(names):
            if not ranks.main and (not ranked or i > ranked[-1]):
                log.info("rank %d/%d: no stage left that needs this rank; rank 0 goes on", ranks.rank, ranks.world)
                return
            if name in RANKED_STAGES:
                log.info("stage `%s` starting (rank %d/%d)", name, ranks.rank, ranks.world)
                stages[name](ctx)
            elif ranks.main:
                log.info("stage `%s` starting", name)
                stages[name](ctx)
            if not ranked or i >= ranked[-1]:
                continue
            # a later stage needs every rank: it starts once rank 0 has finished this one (a ranked
            # stage ends with rank 0's own work: train's selection and export, capture's manifest)
            if ranks.main:
                dist.publish(ranks, f"{i}-{name}")
            elif not dist.await_published(ranks, f"{i}-{name}", stop=lambda: ctx.stop_requested):
                raise Stopped(0)
    finally:
        dist.release(ranks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash_worker.job", description="Run one coordinator job (stages from DIR/spec.json).")
    parser.add_argument("--job-dir", type=Path, required=True, help="job directory holding spec.json (written by run-manager)")
    args = parser.parse_args(argv)
    _setup_logging()
    emit = JsonLinesSink(sys.stdout)
    if os.environ.get("RANK", "0") not in ("", "0"):
        emit = _errors_only(emit)

    from .worker.context import StageContext, Stopped
    from .worker.placement import Placement
    from .worker.spec import JobSpec
    from .worker.stages import STAGES

    try:
        spec = JobSpec.load(args.job_dir)  # a malformed spec or recipe fails here, before any stage writes
        placement = Placement.from_spec(spec)
        # every section's device is decided here, so a device this provider lacks fails before any stage
        devices = placement.devices(spec.job.recipe) if spec.job.recipe is not None else {}
        ctx = StageContext(spec=spec, placement=placement, emit=emit, devices=devices)

        def on_term(signum, frame):
            ctx.stop_requested = True

        def on_usr1(signum, frame):
            ctx.checkpoint_requested = True

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGUSR1, on_usr1)
        emit(Progress(phase="starting"))
        for note in placement.notes():
            log.info("%s", note)
        names = spec.graph.stages(spec.job.stages) if spec.graph is not None else list(spec.job.stages)
        if spec.graph is not None:
            g = spec.graph
            log.info("graph job: %s shard %d of %d, %d inputs, stages %s", g.kind, g.shard_index + 1, g.shard_count, len(g.inputs), names)
        _run_stages(ctx, STAGES, names)
        emit(Done())
        return 0
    except Stopped as stop:
        log.info("stopped on request; checkpoint committed at step %d", stop.committed_step)
        emit(StoppedEvent(committed_step=stop.committed_step))
        return 0
    except DflashError as exc:
        emit(Error(message=str(exc), retryable=False))
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
