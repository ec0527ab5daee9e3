"""The training run: check data, load, train, checkpoint, validate, select, export.

`train(recipe, run_dir=..., resume=...)` is the library entry point behind
`dflash-worker train`; `Trainer` is the loop, holding one run's progress so tests and the
job runner can drive it step by step. Its components come from the typed recipe:
`setup.TrainSetup` (draft, target head, optimizer, captured data), `forward.Scorer` (the one
forward path of training and validation: forward -> token loss -> selector terms -> proposals
-> match counts), `validate.Validator` (the val split measured with the export's weights),
`selection` (the selection rule and the general-domain guard, pure functions of the validation
history), `interpolate` (weights between the released draft and a checkpoint, searched after
training) and `resume` (what a resume must agree on, which checkpoint to resume).

Run directory::

    RUN/metrics.jsonl     one JSON line per optimizer step (validation merged in)
    RUN/checkpoints/      committed checkpoints (see `checkpoint`)
    RUN/selection.json    the selected checkpoint (or interpolated point) and why (written when training completes)
    RUN/export/           the export of the selected checkpoint (`[export].format`)

Order of work inside step s: micro-batches (forward, backward) -> the L2-SP
gradient (`[train].l2sp > 0`, `Trainer._l2sp`) -> clip ->
AdamW step -> scheduler step -> validation (every `val_every` steps and at the
last step) -> metrics line -> checkpoint (every `checkpoint_every` steps, at
validation steps, at the last step, at a replay's `stop_at`, and on SIGUSR1/SIGINT/SIGTERM). The
metrics line is written before the checkpoint commits, so a crash in between
leaves a line past the newest checkpoint, which `--resume` truncates: every
step appears in ``metrics.jsonl`` exactly once.

Events (`worker.events`, to the `on_event` sink of `train`):

- ``Log`` ``resumed from `CHECKPOINT` at step S`` after a resume;
- ``Log`` ``released draft: general-domain matching proposals X on N examples ...``
  once the guard's baseline is measured (a fresh run with general val rows);
- ``Log`` (warning) ``the export is the released draft ...`` when nothing passes the guard, or
  ``Log`` ``interpolated export: alpha A ...`` when `[train].interpolate` exports a point between the
  released draft and a checkpoint (`selection.outcome`);
- ``Artifact(kind="checkpoint")`` after each commit: the checkpoint's
  ``manifest.json`` (absolute path), named ``checkpoints/step-NNNNNNNN/manifest.json``
  (relative to the run dir), ``step`` its step;
- ``Progress(phase="train", step, total_steps, metrics={loss, lr, grad_norm,
  train_matching_proposals}, committed_step)`` after every optimizer step (after
  its checkpoint, if any); ``committed_step`` is None before the first commit;
- ``Log`` ``stopped by SIGNAL at step S/N; ...`` when a signal stops the run;
- ``Artifact(kind="export")`` for every file of the export directory, named
  ``<export dir>/<file>`` (relative to the run dir), ``step`` the selected step,
  once ``selection.json`` is written. A verified (already complete) run emits nothing.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from .. import dist
from ..errors import ConfigError, ResumeError
from ..manifest import sha256_file
from ..recipe import Recipe
from ..worker.events import Artifact, Event, EventSink, Log, Progress
from . import checkpoint as ckpt
from . import interpolate, selection
from .export_run import SELECTION
from .forward import Scorer
from .objectives import add_l2sp_gradient, weight_total
from .resume import (
    check_capture_fits_draft,
    compare_for_resume,
    restore_newest_usable,
    run_identity,
    truncate_metrics,
    verify_completed_run,
)
from .setup import TrainSetup, check_prepared_data
from .signals import SignalGuard, StopFlags
from .validate import Validator, val_modes

if TYPE_CHECKING:
    from ..device import DeviceChoice

METRICS = "metrics.jsonl"
PROGRESS_KEYS = ("loss", "lr", "grad_norm", "train_matching_proposals", "tokens_per_s")


def train(
    recipe: Recipe,
    *,
    run_dir: str | Path | None = None,
    resume: bool = False,
    on_event: EventSink | None = None,
    flags: StopFlags | None = None,
    hooks: Hooks | None = None,
    device: DeviceChoice | None = None,
    attention: str = "auto",
    skip_unusable: bool = False,
    stop_at: int | None = None,
) -> TrainResult:
    """Run (or resume, or verify) the training run of `recipe` in `run_dir`.

    Events go to `on_event` as `worker.events` objects (module docstring); `device` and
    `attention` are the job runner's placement (see `Trainer`). `skip_unusable`: a checkpoint
    that cannot be resumed is skipped with a warning for an older one or a fresh start (the
    job runner's choice: its checkpoints may come from another attempt), instead of an error.
    `stop_at`: replay up to that step (its checkpoint committed) on the full run's schedule, then
    stop with status ``replayed`` (no selection, no export): a coordinator's verify job.
    """
    trainer = Trainer(
        recipe, resolve_run_dir(recipe, run_dir), resume=resume, on_event=on_event, flags=flags, hooks=hooks,
        device=device, attention=attention, skip_unusable=skip_unusable, stop_at=stop_at,
    )
    try:
        return trainer.run()
    finally:
        dist.shutdown(trainer.ranks)


class Trainer:
    """One training run, the loop. Construct, then `run()`; see the module docstring.

    `__init__` checks and fingerprints the inputs (no weights read) and holds the run's
    progress (`step`, `val_history`, `committed_step`); `setup()` loads the `TrainSetup` and
    builds the components on it (`scorer`, `validator`). `device` (a resolved placement)
    replaces resolving `[train].device`; `attention` is the draft forward's attention backend
    (`DraftModel.forward_blocks`).
    """

    scorer: Scorer  # set by `setup`
    validator: Validator  # set by `setup`

    def __init__(
        self,
        recipe: Recipe,
        run_dir: str | Path,
        *,
        resume: bool = False,
        on_event: EventSink | None = None,
        flags: StopFlags | None = None,
        hooks: Hooks | None = None,
        skip_data_check: bool = False,
        device: DeviceChoice | None = None,
        attention: str = "auto",
        ranks: dist.Ranks | None = None,
        skip_unusable: bool = False,
        stop_at: int | None = None,
    ) -> None:
        self.recipe = recipe
        # Replay (a coordinator's verify job): stop after step `stop_at` with its checkpoint committed, on the
        # full run's schedule, without selecting or exporting (`replay`); None trains the whole run.
        if stop_at is not None and not 1 <= stop_at <= recipe.require("train").steps:
            raise ConfigError(f"replay to step `{stop_at}` is outside this run's 1..{recipe.require('train').steps}")
        self.stop_at = stop_at
        # Resume: skip a checkpoint that fails to load or does not fit this run (warning) for the next
        # older one, else start fresh (`resume.restore_newest_usable`); without it such a checkpoint fails the run.
        self.skip_unusable = skip_unusable
        self.ranks = ranks if ranks is not None else dist.ranks_from_env()
        self.cfg = recipe.require("train")
        self.cap = recipe.require("capture")
        self.run_dir = Path(run_dir)
        # only rank 0 reports (`dist`): the others train in step and stay silent
        self.emit: EventSink = (on_event or _ignore) if self.ranks.main else _ignore
        self.flags = flags or StopFlags()
        self.hooks = hooks or Hooks()
        self.resume = resume
        self.device_choice = device
        self.attention = attention
        self.export_format = recipe.export.format if recipe.export is not None else "bf16"
        if not skip_data_check:
            check_prepared_data(recipe)
        from ..families import check_recipe_pair

        check_recipe_pair(recipe.model.target, recipe.model.draft, recipe.model.family)
        check_capture_fits_draft(self.cap.output, recipe.model.draft, self.cfg.features)
        self.identity = run_identity(recipe)
        self.step = 0
        self.val_history: list[dict[str, Any]] = []
        # the released draft on the general val rows (the guard's baseline), measured before the first update
        self.released_general: dict[str, Any] | None = None
        # the step at which `guard_patience` stopped the run (None: it has not)
        self.guard_stopped_at: int | None = None
        self.committed_step: int | None = None
        self._setup: TrainSetup | None = None

    # ----------------------------------------------------------------- the loop
    def run(self) -> TrainResult:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        existing = ckpt.latest(self.run_dir)
        if existing is not None and not self.resume:
            raise ResumeError(
                f"run directory `{self.run_dir}` already holds checkpoints\n"
                "hint: pass `--resume` to continue it, or choose another `--run-dir`"
            )
        if self.resume and (self.run_dir / SELECTION).is_file():
            return self.verify_completed()
        self.setup()
        resumed = False
        if self.resume and existing is not None and self.skip_unusable:
            resumed = restore_newest_usable(
                self.run_dir, existing, self.cfg.steps, restore=self.restore, reset=self._reset, emit=self.emit)
        elif self.resume and existing is not None:
            self.restore(ckpt.load(existing))
            self.emit(Log(message=f"resumed from `{existing}` at step {self.step}"))
            resumed = True
        if not resumed:  # the RNG state checkpoints hold depends on the recipe alone (`device.seed_rng_state`)
            from ..device import seed_rng_state

            seed_rng_state(self.cfg.seed)
        if not resumed and self.ranks.main:  # a fresh start (also `--resume` before the first commit): no metric line survives
            (self.run_dir / METRICS).unlink(missing_ok=True)
            if self.parts.val_general:
                self._measure_baseline()
                self.save_checkpoint()  # step 0: the released draft, selected when no trained checkpoint passes
        metrics_file = self.run_dir / METRICS if self.ranks.main else Path(os.devnull)
        end = self.cfg.steps if self.stop_at is None else self.stop_at
        if self.step > end:
            raise ResumeError(f"run directory `{self.run_dir}` resumed at step {self.step}, past the replay's last step {end}")
        # a run the guard stopped, resumed before it selected, stays stopped (every rank restored the history)
        if resumed and self.step < end and self.guard_exhausted():
            self._guard_stop()
        with SignalGuard(self.flags), open(metrics_file, "a", encoding="utf-8") as mf:
            while self.step < end and self.guard_stopped_at is None:
                stopped = self._advance(mf)
                if stopped is not None:
                    return stopped
        if self.stop_at is not None:
            return self.replayed()
        return self.finish()

    def _advance(self, mf: IO[str]) -> TrainResult | None:
        """One step in the order of the module docstring; the result when a signal stops the run."""
        cfg = self.cfg
        line = self.train_step()
        last = self.step == cfg.steps
        validated = self.ranks.main and bool(self.parts.val_split is not None and len(self.parts.val_split)) and (
            bool(cfg.val_every and self.step % cfg.val_every == 0) or last
        )
        if validated:
            v = self.validate()
            self.val_history.append(v)
            line["val"] = {k: v[k] for k in selection.VAL_KEYS}
            if "general" in v:
                line["val_general"] = v["general"]
        mf.write(json.dumps(line, sort_keys=True, allow_nan=False) + "\n")
        mf.flush()
        # a signal on any rank stops (or checkpoints) every rank at this step
        # and `guard_patience` looks at validations, which only rank 0 makes
        exhausted = validated and self.guard_exhausted()
        stop, usr, exhausted = dist.any_true(
            self.ranks, [self.flags.stop_signal is not None, self.flags.take_checkpoint_request(), exhausted], self.parts.device)
        if exhausted:
            self._guard_stop()
        if self.ranks.main and (validated or last or stop or usr or self.step % cfg.checkpoint_every == 0 or self.step == self.stop_at):
            self.save_checkpoint()
        metrics = {k: line[k] for k in PROGRESS_KEYS}
        self.emit(Progress(phase="train", step=self.step, total_steps=cfg.steps, metrics=metrics, committed_step=self.committed_step))
        if self.hooks.after_step is not None:
            self.hooks.after_step(self, self.step)
        if not stop:
            return None
        by = self.flags.stop_signal or "a signal to another rank"
        msg = f"stopped by {by} at step {self.step}/{cfg.steps}; checkpoint committed, continue with `--resume`"
        self.emit(Log(message=msg))
        return TrainResult(self.run_dir, "stopped", self.step, cfg.steps, msg, checkpoint=ckpt.latest(self.run_dir))

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over `grad_accum` micro-batches; returns its metrics line."""
        cfg, w, ranks, dev = self.cfg, self.parts.weights, self.ranks, self.parts.device
        t0 = time.perf_counter()
        self.parts.model.train()
        batch = self.scorer.micro_batches(self.step, ranks.mine(cfg.grad_accum))
        # the normaliser of the whole step, over every rank's micro-batches (`dist`)
        denom = dist.sum_floats(ranks, [sum(weight_total(b.valid, w.positions) for b in batch if b.anchors.numel())], dev)[0]
        tot = {"loss": 0.0, "ce": 0.0, "selector_ce": 0.0, "kd": 0.0, "positions": 0, "blocks": 0, "accepted": 0}
        kd = cfg.replay_kd
        # the step's sequences in slot order, whichever rank computes them (no collective needed)
        samples = [self.parts.train_split.id_of(self.parts.order(self.step * cfg.grad_accum + j)) for j in range(cfg.grad_accum)]
        for b in batch:
            if b.anchors.numel() == 0 or denom == 0:
                continue
            target = self.scorer.start_logits(b) if kd > 0 and b.replay else None
            with self.scorer.qat():
                s = self.scorer.score(b, objective=cfg.objective, with_selector=w.selector > 0, kd_target=target)
                loss_sum = w.main * s.ce_sum
                if w.selector > 0:
                    loss_sum = loss_sum + w.selector * s.selector_sum
                if s.kd_sum is not None:
                    loss_sum = loss_sum + kd * s.kd_sum
                    tot["kd"] += float(s.kd_sum.detach()) / denom
                (loss_sum / denom).backward()
            tot["accepted"] += sum(s.counts["accepted"])
            tot["loss"] += float(loss_sum.detach()) / denom
            tot["ce"] += float(s.ce_sum.detach()) / denom
            tot["selector_ce"] += float(s.selector_sum.detach()) / denom
            tot["positions"] += int(b.valid.sum())
            tot["blocks"] += int(b.anchors.numel())
        dist.sum_gradients(ranks, self.parts.params)
        penalty = self._l2sp()
        gnorm, lr = self._optimizer_step()
        keys = ("loss", "ce", "selector_ce", "kd", "positions", "blocks", "accepted")
        tokens = sum(int(b.anchors.numel()) * w.block_size for b in batch)
        *sums, tokens = dist.sum_floats(ranks, [*(tot[k] for k in keys), tokens], dev)  # one collective for the metrics
        if ranks.active:
            tot = {k: (v if k in ("loss", "ce", "selector_ce", "kd") else int(v)) for k, v in zip(keys, sums)}
        secs = time.perf_counter() - t0
        return {
            "samples": samples, "step": self.step, "loss": tot["loss"], "ce": tot["ce"], "selector_ce": tot["selector_ce"],
            "lr": lr, "grad_norm": gnorm, "blocks": tot["blocks"], "positions": tot["positions"],
            "train_matching_proposals": tot["accepted"] / tot["blocks"] if tot["blocks"] else 0.0,
            "seconds": secs, "tokens_per_s": tokens / secs if secs > 0 else None, "world_size": ranks.world,
            **({} if penalty is None else {"l2sp_penalty": penalty}),
            **({"replay_kd": tot["kd"]} if kd > 0 else {}),
        }

    def _l2sp(self) -> float | None:
        """`[train].l2sp` (L2-SP): add the gradient of ``l2sp / 2 * ||w - w_start||^2`` over the trained
        tensors, `w_start` being the draft the recipe starts from, so adapting pulls back toward the
        released weights instead of drifting from them. Added once, after the gradients are summed
        over ranks (every rank holds the same weights); returns the penalty before this step's update."""
        start = self.parts.start
        return None if start is None else add_l2sp_gradient(self.parts.params, start, self.cfg.l2sp)

    def _optimizer_step(self) -> tuple[float, float]:
        """Clip, AdamW step, scheduler step; returns (grad norm before clipping, lr used)."""
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        gnorm = torch.nn.utils.clip_grad_norm_(self.parts.params, clip)
        optimizer = self.parts.optimizer
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        self.parts.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return float(gnorm), lr

    def validate(self) -> dict[str, Any]:
        """This step's validation entry (`Validator.validate`); `hooks.inside_validation` runs while the
        export values are in place."""
        hook = self.hooks.inside_validation
        return self.validator.validate(self.step, None if hook is None else lambda: hook(self))

    # ----------------------------------------------------------------- components
    def setup(self) -> None:
        """Load the draft (FP32 masters), the target head and the captured data; build the components."""
        self._setup = parts = TrainSetup.load(self.recipe, self.export_format, self.device_choice, self.ranks)
        self.scorer = Scorer(parts, self.cfg, self.attention)
        self.validator = Validator(self.scorer, parts.val_split, parts.val_own, parts.val_general, self.cfg,
                                   modes=val_modes(parts.val_split, self.recipe.data))

    @property
    def parts(self) -> TrainSetup:
        """What `setup` loaded, for the methods here, hooks and tests."""
        assert self._setup is not None, "`Trainer.setup()` must run first"
        return self._setup

    # ----------------------------------------------------------------- checkpoints and resume
    def state(self) -> dict[str, Any]:
        return {
            "sequences_seen": self.step * self.cfg.grad_accum,
            "scheduler": self.parts.scheduler.state_dict(),
            "recipe": self.recipe.resolved(),
            **self.identity,
            "val_history": self.val_history,
            # only with general val rows: other runs' checkpoints stay what they were
            **({} if self.released_general is None else {"released_general": self.released_general}),
            "trainable": self.parts.tensors.names,
            "qat_names": self.parts.tensors.qat_names,
            "total_steps": self.cfg.steps,
        }

    def save_checkpoint(self) -> Path:
        """Commit a checkpoint of this step, prune old ones, report its manifest as an artifact."""
        from ..device import capture_rng_state

        trained = self.parts.tensors.name_set
        path = ckpt.save(
            self.run_dir,
            self.step,
            trainable={n: p.detach() for n, p in self.parts.model.named_parameters() if n in trained},
            optimizer=self.parts.optimizer.state_dict(),
            rng=capture_rng_state(),
            state=self.state(),
        )
        self.committed_step = self.step
        guard = self.guard()
        protect = selection.protected_steps(self.best(guard), self.released_general)
        if guard is not None and self.cfg.interpolate == "auto":  # the checkpoint a search interpolates toward
            protect |= interpolate.protected(self.val_history)
        ckpt.prune(self.run_dir, keep=self.cfg.keep_checkpoints, protect=protect)
        manifest = path / "manifest.json"
        name = f"{ckpt.CHECKPOINTS}/{path.name}/{manifest.name}"
        self.emit(Artifact.for_file(manifest.absolute(), artifact=name, kind="checkpoint", step=self.step))
        return path

    def restore(self, loaded: ckpt.Loaded) -> None:
        """Put the run in the state of checkpoint `loaded` (refused when it does not fit this run)."""
        from ..device import restore_rng_state

        compare_for_resume(loaded.state, self.identity)
        if loaded.state.get("trainable") != self.parts.tensors.names:
            raise ResumeError(f"checkpoint `{loaded.path}` trained other tensors than scope `{self.cfg.scope}`")
        with torch.no_grad():
            for n, p in self.parts.model.named_parameters():
                if n in self.parts.tensors.name_set:
                    p.copy_(loaded.trainable[n].to(p.device))
        self.parts.optimizer.load_state_dict(loaded.optimizer)
        self.parts.scheduler.load_state_dict(loaded.state["scheduler"])
        restore_rng_state(loaded.rng)
        self.step = loaded.step
        self.val_history = list(loaded.state.get("val_history") or [])
        self.released_general = loaded.state.get("released_general")
        self.committed_step = loaded.step
        if self.ranks.main:  # the metrics file is rank 0's: another rank rewriting it would race its appends
            truncate_metrics(self.run_dir / METRICS, loaded.step)

    def _reset(self) -> None:
        """A fresh start after a restore that failed midway (it may have changed the model or the optimizer)."""
        self.step, self.val_history, self.committed_step = 0, [], None
        self.setup()

    def verify_completed(self) -> TrainResult:
        """A completed run: check selection, its checkpoint and the export instead of retraining."""
        sel, out, path = verify_completed_run(self.run_dir, self.identity)
        msg = f"run already complete: selection (step {sel['step']}) and export `{out}` verified"
        return TrainResult(self.run_dir, "verified", sel["total_steps"], sel["total_steps"], msg, sel, out, path)

    # ----------------------------------------------------------------- selection
    def guard(self) -> dict[str, Any] | None:
        """The general-domain guard over the validation history (`selection.guard_report`)."""
        return selection.guard_report(self.val_history, self.released_general, tolerance=self.cfg.general_tolerance,
                                      patience=self.cfg.guard_patience, stopped_at=self.guard_stopped_at)

    def guard_exhausted(self) -> bool:
        """Whether `[train].guard_patience` stops the run here: its last P validations were all rejected."""
        p = self.cfg.guard_patience
        return selection.guard_exhausted(self.guard() if p > 0 else None, p)

    def _released_checkpoint(self) -> bool:
        """Whether the run committed the released draft as step 0 (a guarded run since `guard_patience`)."""
        return (self.run_dir / ckpt.CHECKPOINTS / ckpt.step_name(0)).is_dir()

    def best(self, guard: dict[str, Any] | None) -> dict[str, Any] | None:
        """The selected validation entry (`selection.best`), given this run's `guard()` report."""
        released_committed = guard is not None and self._released_checkpoint()
        return selection.best(self.val_history, guard, self.released_general, released_committed=released_committed)

    def _measure_baseline(self) -> None:
        """Measure and report the released draft's general acceptance (`Validator.measure_released`)."""
        assert self.step == 0, "the released draft is measured before the first update"
        self.released_general = self.validator.measure_released()
        self.emit(Log(message=selection.released_note(self.released_general, self.cfg.general_tolerance)))

    def _guard_stop(self) -> None:
        """`guard_patience` stops the run at this step (every rank learns it through `dist.any_true`)."""
        self.guard_stopped_at = self.step
        p = self.cfg.guard_patience
        self.emit(Log(message=f"the general-domain guard stopped the run at step {self.step}/{self.cfg.steps}: "
                              f"it rejected the last {p} validation{'s' if p > 1 else ''}"))

    # ----------------------------------------------------------------- the end
    def replayed(self) -> TrainResult:
        """A replay reached `stop_at`: its checkpoint is committed (`_advance`, or the one it resumed from)."""
        path = self.run_dir / ckpt.CHECKPOINTS / ckpt.step_name(self.step)
        if self.ranks.main and self.committed_step != self.step:
            path = self.save_checkpoint()
        msg = f"replayed training to step {self.step}/{self.cfg.steps}; checkpoint `{path}`"
        return TrainResult(self.run_dir, "replayed", self.step, self.cfg.steps, msg, checkpoint=path)

    def finish(self) -> TrainResult:
        """Select the best checkpoint, export it and write `selection.json` (last: marks completion).

        Rank 0's work; another rank only says it is done."""
        from .export_run import export_run

        if not self.ranks.main:
            msg = f"rank {self.ranks.rank}/{self.ranks.world}: trained {self.step} steps; rank 0 selects and exports"
            return TrainResult(self.run_dir, "completed", self.step, self.cfg.steps, msg)

        guard = self.guard()
        best, interp = self.best(guard), None
        if guard is not None and best is not None and self.cfg.interpolate == "auto":
            interp, best = interpolate.select(self.validator, self.run_dir, self.recipe.model.draft, self.val_history, guard,
                                              self.released_general or {}, best, tolerance=self.cfg.general_tolerance)
        chosen = selection.selected_step(best, self.step)
        path = self.run_dir / ckpt.CHECKPOINTS / ckpt.step_name(chosen)
        record = selection.record(best, guard, self.val_history, step=chosen, checkpoint=path.name, interpolation=interp,
                                  checkpoint_manifest_sha256=sha256_file(path / "manifest.json"), total_steps=self.cfg.steps)
        fmt = self.export_format
        result = export_run(self.run_dir, fmt=fmt, recipe=self.recipe, selection=record)
        record["export"] = {"format": fmt, "dir": result.out_dir.name, "manifest_sha256": sha256_file(result.out_dir / "manifest.json")}
        ckpt.write_json(self.run_dir / SELECTION, record)
        for f in sorted(p for p in result.out_dir.rglob("*") if p.is_file()):
            name = f"{result.out_dir.name}/{f.relative_to(result.out_dir).as_posix()}"
            self.emit(Artifact.for_file(f.absolute(), artifact=name, kind="export", step=chosen))
        done = (f"trained {self.step} steps" if self.guard_stopped_at is None
                else f"trained {self.step} of {self.cfg.steps} steps (stopped by the general-domain guard)")
        alpha = (interp or {}).get("alpha")
        msg = f"{done}; selected step {chosen}{'' if alpha is None else f' at alpha {alpha:g}'}; exported `{result.out_dir}`"
        if guard is not None:
            note, warning = selection.guard_note(record, self._released_checkpoint())
            if warning is not None:
                self.emit(Log(level="warning", message=warning))
            elif alpha is not None:
                self.emit(Log(message=selection.outcome(record) or ""))
            msg += note
        return TrainResult(self.run_dir, "completed", self.step, self.cfg.steps, msg, record, result.out_dir, path)


@dataclass
class TrainResult:
    run_dir: Path
    status: str  # "completed" | "stopped" | "verified" | "replayed" (`stop_at`)
    step: int
    total_steps: int
    message: str
    selection: dict[str, Any] | None = None
    export_dir: Path | None = None
    checkpoint: Path | None = None


@dataclass
class Hooks:
    """Test and job-runner hooks. `after_step(trainer, step)` runs after each step's checkpoint
    decision; `inside_validation(trainer)` runs while export values are swapped in."""

    after_step: Callable[[Trainer, int], None] | None = None
    inside_validation: Callable[[Trainer], None] | None = None


def resolve_run_dir(recipe: Recipe, run_dir: str | Path | None) -> Path:
    """`run_dir`, else `[train].output`; neither is a `ConfigError`."""
    if run_dir is not None:
        return Path(run_dir)
    cfg = recipe.require("train")
    if cfg.output is None:
        raise ConfigError("no run directory: pass `--run-dir DIR` or set `[train].output`")
    return Path(cfg.output)


def _ignore(event: Event) -> None:
    pass
