"""Stage runner for one coordinator job: ``dflash_worker.job.main(["--job-dir", DIR])``.

The native client (``dflash-native-client --job-dir DIR``) calls ``main``;
``python -m dflash_worker.job --job-dir DIR`` does the same without Rust.
The run-manager writes ``DIR/spec.json`` (`dflash_worker.worker.spec.JobSpec`: job
spec, lease facts, device, downgrades, resume checkpoint); `Placement` applies its
device policy; the stages of `dflash_worker.worker.stages` run in the listed order.
This module talks back with the event protocol of ``docs/worker-events.md``: one
JSON object per line on stdout (``progress``, ``artifact``, ``done``, ``error``,
``stopped``), written by one `JsonLinesSink`; logs are JSON lines on stderr.

Signals: SIGTERM -> commit a checkpoint at the next step boundary, emit
``stopped`` and return 0. SIGUSR1 -> commit a checkpoint at the next step
boundary and continue.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path

from .errors import DflashError
from .worker.events import Done, Error, JsonLinesSink, Progress
from .worker.events import Stopped as StoppedEvent

log = logging.getLogger("dflash_worker.job")


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash_worker.job", description="Run one coordinator job (stages from DIR/spec.json).")
    parser.add_argument("--job-dir", type=Path, required=True, help="job directory holding spec.json (written by run-manager)")
    args = parser.parse_args(argv)
    _setup_logging()
    emit = JsonLinesSink(sys.stdout)

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
        for name in spec.job.stages:
            log.info("stage `%s` starting", name)
            STAGES[name](ctx)
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
