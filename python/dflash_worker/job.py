"""Stage runner for one coordinator job: ``dflash_worker.job.main(["--job-dir", DIR])``.

SKELETON. This is the minimal stage runner the run-manager's tests need; the
pipeline engineer extends it with the real stages (prepare, check, capture,
train, export, evaluate) in ``STAGES``. Only the ``noop`` stage exists now.

The native client (``dflash-native-client --job-dir DIR``) calls ``main``;
``python -m dflash_worker.job --job-dir DIR`` does the same without Rust.
The run-manager writes ``DIR/spec.json`` (job spec, lease facts, device,
downgrades, resume checkpoint). This module talks back with the event
protocol of ``docs/worker-events.md``: one JSON object per line on stdout
(``progress``, ``artifact``, ``done``, ``error``, ``stopped``); logs are JSON
lines on stderr.

Signals: SIGTERM -> commit a checkpoint at the next step boundary, emit
``stopped`` and return 0. SIGUSR1 -> commit a checkpoint at the next step
boundary and continue.

``noop`` stage (``spec["noop"]``): ``steps`` (default 6), ``step_seconds``
(default 0.05), ``checkpoint_every`` (default 2). Each step folds the step
number into a sha256 chain, so the final ``state`` is the same whether or not
the job was interrupted and resumed: a resumed run that lost or repeated a
step gives a different digest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError, ConfigError, DflashError

log = logging.getLogger("dflash_worker.job")

SPEC_SCHEMA_VERSION = 1
NOOP_SEED = "dflash-noop-v1"


def _emit(event: dict) -> None:
    """Write one event line to stdout and flush (the run-manager reads it live)."""
    sys.stdout.write(json.dumps(event, sort_keys=True, allow_nan=False) + "\n")
    sys.stdout.flush()


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


def sha256_file(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def write_atomic(path: Path, data: bytes) -> None:
    """Write, fsync, rename, fsync the directory: a reader sees all bytes or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class JobContext:
    """What a stage gets: the job directory, the parsed spec.json and the event sink."""

    job_dir: Path
    doc: dict
    emit: Callable[[dict], None]
    stop_requested: bool = False
    checkpoint_requested: bool = False

    @property
    def spec(self) -> dict:
        return self.doc["spec"]

    def artifact(self, path: Path, *, name: str, kind: str, step: int = 0) -> None:
        sha, size = sha256_file(path)
        self.emit(
            {"event": "artifact", "name": name, "kind": kind, "path": str(path), "sha256": sha, "size_bytes": size, "step": step}
        )


class Stopped(Exception):
    """Raised by a stage after it committed a checkpoint on SIGTERM."""

    def __init__(self, committed_step: int):
        super().__init__(f"stopped after committing step {committed_step}")
        self.committed_step = committed_step


def _int_field(cfg: dict, key: str, default: int, lo: int, hi: int) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ConfigError(f"`spec.noop.{key}` must be an integer in [{lo}, {hi}], got `{v!r}`")
    return v


def _float_field(cfg: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise ConfigError(f"`spec.noop.{key}` must be a number in [{lo}, {hi}], got `{v!r}`")
    return float(v)


def _noop_step(state: str, step: int) -> str:
    return hashlib.sha256(f"{state}:{step}".encode()).hexdigest()


def noop_final_state(steps: int) -> str:
    """The `state` an uninterrupted noop run of `steps` steps ends with."""
    state = hashlib.sha256(NOOP_SEED.encode()).hexdigest()
    for k in range(1, steps + 1):
        state = _noop_step(state, k)
    return state


def run_noop(ctx: JobContext) -> None:
    """Count `steps` steps, checkpointing every `checkpoint_every`; write a report artifact."""
    cfg = ctx.spec.get("noop", {})
    if not isinstance(cfg, dict):
        raise ConfigError("`spec.noop` must be an object")
    steps = _int_field(cfg, "steps", 6, 0, 1_000_000)
    step_seconds = _float_field(cfg, "step_seconds", 0.05, 0.0, 60.0)
    every = _int_field(cfg, "checkpoint_every", 2, 1, 1_000_000)

    state = hashlib.sha256(NOOP_SEED.encode()).hexdigest()
    start = 0
    resume = ctx.doc.get("resume_checkpoint")
    if resume:
        try:
            ck = json.loads(Path(resume).read_text())
            start, state = int(ck["step"]), str(ck["state"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"cannot resume from `{resume}`: {exc}") from None
        if not 0 <= start <= steps:
            raise CheckpointError(f"checkpoint `{resume}` is at step {start}, outside 0..{steps}")
        log.info("resuming noop from step %d", start)
    committed = start

    def commit(step: int) -> None:
        nonlocal committed
        path = ctx.job_dir / "checkpoints" / f"step-{step:06d}.json"
        write_atomic(path, json.dumps({"step": step, "state": state}, sort_keys=True).encode())
        ctx.artifact(path, name=f"checkpoints/step-{step:06d}.json", kind="checkpoint", step=step)
        committed = step

    for k in range(start + 1, steps + 1):
        time.sleep(step_seconds)
        state = _noop_step(state, k)
        if k % every == 0 or ctx.checkpoint_requested or ctx.stop_requested:
            ctx.checkpoint_requested = False
            commit(k)
        ctx.emit(
            {
                "event": "progress",
                "phase": "train",
                "step": k,
                "total_steps": steps,
                "metrics": {"loss": 1.0 / (k + 1)},
                "committed_step": committed,
            }
        )
        if ctx.stop_requested:
            raise Stopped(committed)

    report = ctx.job_dir / "export" / "noop-report.json"
    body = {"steps": steps, "state": state, "resumed_from": start, "restart": ctx.doc.get("restart", 0)}
    write_atomic(report, json.dumps(body, sort_keys=True).encode())
    ctx.artifact(report, name="export/noop-report.json", kind="report", step=steps)


# Stage name -> runner. The pipeline engineer adds the real stages here.
STAGES: dict[str, Callable[[JobContext], None]] = {"noop": run_noop}


def load_spec(job_dir: Path) -> dict:
    path = job_dir / "spec.json"
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read `{path}`: {exc.strerror}") from None
    except ValueError as exc:
        raise ConfigError(f"`{path}` is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("spec"), dict):
        raise ConfigError(f"`{path}` must be an object with an object `spec`")
    if doc.get("schema_version") != SPEC_SCHEMA_VERSION:
        raise ConfigError(
            f"`{path}` has schema_version `{doc.get('schema_version')}`; this worker reads {SPEC_SCHEMA_VERSION}\n"
            "hint: run-manager and dflash_worker come from one install; reinstall both"
        )
    stages = doc["spec"].get("stages")
    if not isinstance(stages, list) or not stages or not all(isinstance(s, str) for s in stages):
        raise ConfigError(f"`{path}`: `spec.stages` must be a non-empty list of stage names")
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ConfigError(f"`{path}`: unknown stage(s) {', '.join(f'`{s}`' for s in unknown)}; known: {', '.join(STAGES)}")
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash_worker.job", description="Run one coordinator job (stages from DIR/spec.json).")
    parser.add_argument("--job-dir", type=Path, required=True, help="job directory holding spec.json (written by run-manager)")
    args = parser.parse_args(argv)
    _setup_logging()
    ctx: JobContext | None = None
    try:
        doc = load_spec(args.job_dir)
        ctx = JobContext(job_dir=args.job_dir.resolve(), doc=doc, emit=_emit)

        def on_term(signum, frame):
            ctx.stop_requested = True

        def on_usr1(signum, frame):
            ctx.checkpoint_requested = True

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGUSR1, on_usr1)
        _emit({"event": "progress", "phase": "starting", "step": 0, "total_steps": 0})
        for name in doc["spec"]["stages"]:
            log.info("stage `%s` starting", name)
            STAGES[name](ctx)
        _emit({"event": "done"})
        return 0
    except Stopped as stop:
        log.info("stopped on request; checkpoint committed at step %d", stop.committed_step)
        _emit({"event": "stopped", "committed_step": stop.committed_step})
        return 0
    except DflashError as exc:
        _emit({"event": "error", "message": str(exc), "retryable": False})
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
