"""Stage runner for one coordinator job: ``dflash_worker.job.main(["--job-dir", DIR])``.

The native client (``dflash-native-client --job-dir DIR``) calls ``main``;
``python -m dflash_worker.job --job-dir DIR`` does the same without Rust.
The run-manager writes ``DIR/spec.json`` (job spec, lease facts, device,
downgrades, resume checkpoint). This module talks back with the event
protocol of ``docs/worker-events.md``: one JSON object per line on stdout
(``progress``, ``artifact``, ``done``, ``error``, ``stopped``); logs are JSON
lines on stderr.

Stages (``spec.stages``, run in order; each is idempotent, so a restarted
attempt re-runs the list and finished work is verified or skipped):

- ``prepare``: ``prepare-data`` of ``spec.inputs`` into ``DIR/data``;
- ``check``: ``check-data`` against the target's tokenizer (no weights);
- ``capture``: teacher features into ``DIR/capture`` (resumes by shard);
- ``train``: ``DIR/run``; resumes from its newest committed checkpoint, or
  from the lease's ``resume_checkpoint`` when this directory has none; exports
  the selected checkpoint in ``[export].format``;
- ``export``: further formats listed in ``spec.export_formats``;
- ``evaluate``: released vs trained draft on held-out prompts, ``DIR/eval``;
- ``noop``: a counting stage the run-manager's tests use (below).

``spec.recipe`` is a recipe as a JSON object (the TOML sections of
``docs/examples/recipe.toml``); the runner owns the output locations
(``data.dir``, ``capture.output``, ``train.output``) and refuses a spec that
sets them.

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


# ----------------------------------------------------------------- pipeline

# Output locations the runner owns, relative to the job directory.
DATA_DIR, CAPTURE_DIR, RUN_DIR, EVAL_DIR = "data", "capture", "run", "eval"
_OWNED = {("data", "dir"), ("capture", "output"), ("train", "output")}


def job_recipe(ctx: JobContext):
    """The job's recipe with the runner's output locations filled in."""
    from .recipe import recipe_from_dict

    raw = ctx.spec.get("recipe")
    if not isinstance(raw, dict):
        raise ConfigError("`spec.recipe` must be an object with the recipe's sections (see docs/examples/recipe.toml)")
    raw = json.loads(json.dumps(raw))  # a private deep copy: the spec stays as it was
    for section, key in sorted(_OWNED):
        table = raw.get(section)
        if table is None:
            continue
        if not isinstance(table, dict):
            raise ConfigError(f"`spec.recipe.{section}` must be an object")
        if key in table:
            raise ConfigError(f"`spec.recipe.{section}.{key}` is set by the job runner; remove it from the spec")
    raw.setdefault("data", {})["dir"] = str(ctx.job_dir / DATA_DIR)
    if "capture" in raw:
        raw["capture"]["output"] = str(ctx.job_dir / CAPTURE_DIR)
    if "train" in raw:
        raw["train"]["output"] = str(ctx.job_dir / RUN_DIR)
    return recipe_from_dict(raw, base=ctx.job_dir, source="spec.recipe")


def _progress(ctx: JobContext, phase: str, step: int, total: int, **metrics: float) -> None:
    ctx.emit({"event": "progress", "phase": phase, "step": step, "total_steps": total, "metrics": metrics})


def _report_path(ctx: JobContext, path: Path, kind: str, step: int = 0) -> None:
    """Report a file, or every file under a directory, as artifacts named relative to the job dir."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        ctx.artifact(f, name=str(f.resolve().relative_to(ctx.job_dir)), kind=kind, step=step)


def run_prepare(ctx: JobContext) -> None:
    from .data import prepare_data

    inputs = ctx.spec.get("inputs")
    if not isinstance(inputs, list) or not inputs or not all(isinstance(p, str) for p in inputs):
        raise ConfigError("`spec.inputs` must be a non-empty list of JSONL paths")
    cfg = ctx.spec.get("prepare", {})
    if not isinstance(cfg, dict) or set(cfg) - {"seed", "val_fraction", "test_fraction", "skip_invalid"}:
        raise ConfigError("`spec.prepare` may hold only `seed`, `val_fraction`, `test_fraction`, `skip_invalid`")
    _progress(ctx, "prepare", 0, 1)
    manifest = prepare_data([Path(p) for p in inputs], ctx.job_dir / DATA_DIR, **cfg)
    _report_path(ctx, ctx.job_dir / DATA_DIR / "manifest.json", "manifest")
    counts = manifest.get("counts", {}).get("split", {}) if isinstance(manifest.get("counts"), dict) else {}
    _progress(ctx, "prepare", 1, 1, **{f"rows_{k}": float(v) for k, v in counts.items() if isinstance(v, int)})


def run_check(ctx: JobContext) -> None:
    from .data import check_data

    recipe = job_recipe(ctx)
    cap = recipe.capture
    report = check_data(
        recipe.data.dir,
        recipe.model.target,
        thinking=recipe.data.thinking,
        max_length=recipe.data.max_length,
        regenerate=bool(cap and cap.regenerate),
    )
    report.raise_if_failed()
    _progress(ctx, "check", 1, 1, examples=float(report.examples))


def run_capture_stage(ctx: JobContext) -> None:
    from .capture import run_capture

    recipe = job_recipe(ctx)

    def on_event(e: dict) -> None:
        if e.get("event") == "example":
            _progress(ctx, "capture", int(e["index"]) + 1, int(e["total"]))
        if ctx.stop_requested:
            # capture commits whole shards; an interrupted shard is redone on resume
            raise Stopped(0)

    run_capture(recipe, on_event=on_event)
    _report_path(ctx, ctx.job_dir / CAPTURE_DIR / "manifest.json", "capture")


def _seed_from_resume_checkpoint(ctx: JobContext, run_dir: Path) -> None:
    """Copy the lease's resume checkpoint into an empty run dir (attempt on a new work dir)."""
    from .train import checkpoint as ckpt

    resume = ctx.doc.get("resume_checkpoint")
    if not resume or ckpt.latest(run_dir) is not None:
        return
    src = Path(resume)
    src = src.parent if src.is_file() else src
    if not (src / "manifest.json").is_file():
        log.warning("resume checkpoint `%s` is not a training checkpoint directory; starting fresh", resume)
        return
    loaded = ckpt.load(src)  # verifies every file's hash before anything is copied
    dest = run_dir / ckpt.CHECKPOINTS / ckpt.step_name(loaded.step)
    import shutil

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.copy-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    os.replace(tmp, dest)
    write_atomic(run_dir / ckpt.CHECKPOINTS / ckpt.LATEST, dest.name.encode())
    log.info("seeded run from resume checkpoint `%s` (step %d)", src, loaded.step)


def run_train(ctx: JobContext) -> None:
    from .train import checkpoint as ckpt
    from .train import train
    from .train.export_run import SELECTION
    from .train.signals import StopFlags

    recipe = job_recipe(ctx)
    run_dir = ctx.job_dir / RUN_DIR
    _seed_from_resume_checkpoint(ctx, run_dir)
    resume = ckpt.latest(run_dir) is not None or (run_dir / SELECTION).is_file()
    flags = StopFlags()

    def on_event(e: dict) -> None:
        kind = e.get("event")
        if kind == "progress":
            ctx.emit(e)
        elif kind == "artifact":
            _report_path(ctx, Path(e["path"]), e["kind"], int(e.get("step") or 0))
        elif kind == "log":
            log.info("%s", e.get("message"))
        if ctx.stop_requested:
            flags.request_stop("SIGTERM")
        if ctx.checkpoint_requested:
            ctx.checkpoint_requested = False
            flags.request_checkpoint()

    result = train(recipe, run_dir=run_dir, resume=resume, on_event=on_event, flags=flags)
    if result.status == "stopped":
        raise Stopped(result.step)
    if result.status == "verified" and result.export_dir is not None:
        _report_path(ctx, result.export_dir, "export", result.step)


def run_export(ctx: JobContext) -> None:
    from .train.export_run import export_run, read_selection

    recipe = job_recipe(ctx)
    formats = ctx.spec.get("export_formats", [])
    if not isinstance(formats, list) or not all(f in ("bf16", "af4g64") for f in formats):
        raise ConfigError("`spec.export_formats` must be a list of `bf16` / `af4g64`")
    run_dir = ctx.job_dir / RUN_DIR
    for i, fmt in enumerate(formats, 1):
        result = export_run(run_dir, fmt=fmt, recipe=recipe)
        step = int(read_selection(run_dir)["step"])
        _report_path(ctx, result.out_dir, "export", step)
        _progress(ctx, "export", i, len(formats))


def run_evaluate(ctx: JobContext) -> None:
    from .evaluate.report import evaluate_run

    cfg = ctx.spec.get("evaluate", {})
    if not isinstance(cfg, dict) or set(cfg) - {"split", "max_prompts"}:
        raise ConfigError("`spec.evaluate` may hold only `split` and `max_prompts`")
    out = ctx.job_dir / EVAL_DIR

    def on_event(e: dict) -> None:
        if e.get("event") == "progress":
            ctx.emit(e)

    report = evaluate_run(
        ctx.job_dir / RUN_DIR, split=cfg.get("split"), out_dir=out, max_prompts=cfg.get("max_prompts"), on_event=on_event
    )
    _report_path(ctx, out, "report")
    n = int(report["prompts"])
    _progress(ctx, "evaluate", n, n, tau_baseline=report["baseline"]["tau_mean"], tau_trained=report["trained"]["tau_mean"])


PIPELINE_STAGES = {"prepare", "check", "capture", "train", "export", "evaluate"}

# Stage name -> runner.
STAGES: dict[str, Callable[[JobContext], None]] = {
    "prepare": run_prepare,
    "check": run_check,
    "capture": run_capture_stage,
    "train": run_train,
    "export": run_export,
    "evaluate": run_evaluate,
    "noop": run_noop,
}


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
        if set(doc["spec"]["stages"]) & PIPELINE_STAGES:
            job_recipe(ctx)  # a malformed recipe fails here, before any stage writes anything
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
