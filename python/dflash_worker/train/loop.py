"""The training run: check data, load, train, checkpoint, validate, select, export.

`train(recipe, run_dir=..., resume=...)` is the library entry point behind
`dflash-worker train`; `Trainer` holds one run's state so tests and the job
runner can drive it step by step.

Run directory::

    RUN/metrics.jsonl     one JSON line per optimizer step (validation merged in)
    RUN/checkpoints/      committed checkpoints (see `checkpoint`)
    RUN/selection.json    the selected checkpoint and why (written when training completes)
    RUN/export/           the export of the selected checkpoint (`[export].format`)

Order of work inside step s: micro-batches (forward, backward) -> clip ->
AdamW step -> scheduler step -> validation (every `val_every` steps and at the
last step) -> metrics line -> checkpoint (every `checkpoint_every` steps, at
validation steps, at the last step, and on SIGUSR1/SIGINT/SIGTERM). The
metrics line is written before the checkpoint commits, so a crash in between
leaves a line past the newest checkpoint, which `--resume` truncates: every
step appears in ``metrics.jsonl`` exactly once.

Selection rule: the validated checkpoint with the highest mean matching
proposals on the validation split (ties: the earliest step). A checkpoint is
committed at every validation step and the best one is never pruned. Without
a validation split (or with ``val_every = 0`` and no val examples) the last
step is selected.

Resume compatibility: the resolved recipe minus operational fields
(`RESUME_IGNORED`: output and checkpoint cadence, devices, paths whose content
the data and draft fingerprints already cover, the export/evaluate sections),
the capture fingerprint (sha256 of the capture manifest, which names the
teacher's and data's hashes) and the draft fingerprint (sha256 of every file
of the released draft) must all equal the checkpoint's; otherwise
`ResumeError` names the differing fields.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, ResumeError
from ..manifest import fingerprint, sha256_file
from ..recipe import Recipe
from . import checkpoint as ckpt
from .data import CapturedSplit, Order, Sequence, mix, sample_anchors
from .events import EventFn, Events
from .objectives import (
    block_labels,
    match_counts,
    position_weights,
    proposals,
    proposals_from_scores,
    selector_terms,
    summarize,
    token_loss_sum,
    weight_total,
)
from .params import export_values, load_target_head, swapped
from .schedule import lr_factor
from .scopes import includes_selector, scope_names
from .signals import SignalGuard, StopFlags

RESUME_IGNORED = frozenset(
    {
        "train.output",
        "train.checkpoint_every",
        "train.keep_checkpoints",
        "train.device",
        "capture.device",
        "capture.output",
        "model.target",
        "model.draft",
        "data.dir",
    }
)
RESUME_IGNORED_SECTIONS = ("export", "evaluate")
METRICS = "metrics.jsonl"
SELECTION = "selection.json"


# --------------------------------------------------------------------- fingerprints
def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = obj
    return out


def resume_view(recipe: Recipe) -> dict[str, Any]:
    """The recipe fields a resume must agree on, flattened (`section.key`)."""
    flat = _flatten({k: v for k, v in recipe.resolved().items() if k not in RESUME_IGNORED_SECTIONS})
    return {k: v for k, v in flat.items() if k not in RESUME_IGNORED}


def draft_fingerprint(draft_dir: Path) -> dict[str, str]:
    """sha256 of every file of the released draft that shapes its weights or config."""
    files = sorted(p for p in Path(draft_dir).iterdir() if p.is_file() and (p.suffix in (".safetensors", ".json")))
    return {p.name: sha256_file(p) for p in files}


def capture_fingerprint(capture_dir: Path) -> str:
    """Identity of the captured payload: the capture key (every input that shapes the bytes,
    no paths) and each shard's sha256. Timings and absolute paths in the manifest do not count,
    so an identical re-capture (a new job directory, a restarted attempt) resumes."""
    manifest = json.loads((Path(capture_dir) / "manifest.json").read_text(encoding="utf-8"))
    return fingerprint({"capture_key": manifest["capture_key"], "shards": [[s["file"], s["sha256"]] for s in manifest["shards"]]})


def compare_for_resume(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Raise `ResumeError` naming every field in which `current` differs from `saved`."""
    diffs = []
    s_rec, c_rec = saved.get("recipe_view") or {}, current["recipe_view"]
    for key in sorted(set(s_rec) | set(c_rec)):
        if s_rec.get(key, "<absent>") != c_rec.get(key, "<absent>"):
            diffs.append(f"recipe `{key}`: checkpoint `{s_rec.get(key, '<absent>')}`, now `{c_rec.get(key, '<absent>')}`")
    if saved.get("data_fingerprint") != current["data_fingerprint"]:
        diffs.append(f"data fingerprint: checkpoint `{saved.get('data_fingerprint')}`, now `{current['data_fingerprint']}`")
    s_d, c_d = saved.get("draft_fingerprint") or {}, current["draft_fingerprint"]
    for name in sorted(set(s_d) | set(c_d)):
        if s_d.get(name) != c_d.get(name):
            diffs.append(f"draft file `{name}`: checkpoint `{s_d.get(name)}`, now `{c_d.get(name)}`")
    if diffs:
        raise ResumeError(
            "cannot resume: the run differs from its checkpoint in\n  "
            + "\n  ".join(diffs)
            + "\nhint: resume with the original recipe, data and draft, or start a new run directory"
        )


# --------------------------------------------------------------------- results
@dataclass
class TrainResult:
    run_dir: Path
    status: str  # "completed" | "stopped" | "verified"
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


def _autocast_dtype(mode: str, device: torch.device) -> torch.dtype | None:
    if mode == "off":
        return None
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    if device.type == "mps":
        from ..device import mps_bf16_supported

        return torch.bfloat16 if mps_bf16_supported()[0] else None
    if mode == "bf16":
        return torch.bfloat16  # explicit request on CPU: honoured (slow but supported by torch)
    return None


def _fused_adamw(device: torch.device) -> bool | None:
    """Fused AdamW (one kernel per tensor) where torch has it: the per-tensor loop of ~12 small
    ops per parameter costs several times more, most of all on shared CPU cores."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return True if device.type in _get_fused_kernels_supported_devices() else None


class Trainer:
    """One training run. Construct, then `run()`; see the module docstring."""

    def __init__(
        self,
        recipe: Recipe,
        run_dir: str | Path,
        *,
        resume: bool = False,
        on_event: EventFn | None = None,
        flags: StopFlags | None = None,
        hooks: Hooks | None = None,
        skip_data_check: bool = False,
    ) -> None:
        self.recipe = recipe
        self.cfg = recipe.require("train")
        self.cap = recipe.require("capture")
        self.run_dir = Path(run_dir)
        self.events = Events(on_event)
        self.flags = flags or StopFlags()
        self.hooks = hooks or Hooks()
        self.resume = resume
        if not skip_data_check:
            self._check_data()
        from ..families import check_recipe_pair

        check_recipe_pair(recipe.model.target, recipe.model.draft, recipe.model.family)
        self.identity = {
            "recipe_view": resume_view(recipe),
            "recipe_fingerprint": fingerprint(resume_view(recipe)),
            "data_fingerprint": capture_fingerprint(self.cap.output),
            "draft_fingerprint": draft_fingerprint(recipe.model.draft),
        }

    # ----------------------------------------------------------------- setup
    def _check_data(self) -> None:
        """check-data before any weights load (a failure names file and line)."""
        from ..data import check_data, load_tokenizer

        report = check_data(
            self.recipe.data.dir,
            load_tokenizer(self.recipe.model.target),
            thinking=self.recipe.data.thinking,
            max_length=self.recipe.data.max_length,
            regenerate=self.cap.regenerate,
            splits=tuple(s for s in ("train", "val") if s in self.cap.splits),
        )
        report.raise_if_failed()

    def setup(self) -> None:
        """Load the draft (FP32 masters), the target head and the captured data."""
        from ..device import resolve_device
        from ..model import load_draft

        cfg = self.cfg
        self.choice = resolve_device(cfg.device)
        self.device = self.choice.torch_device
        self.model = load_draft(self.recipe.model.draft, device=self.device, dtype=torch.float32)
        self.head = load_target_head(self.recipe.model.target, device=self.device, dtype=torch.float32)
        names = [n for n, _ in self.model.named_parameters()]
        self.names = scope_names(cfg.scope, names)
        self.name_set = set(self.names)
        for n, p in self.model.named_parameters():
            p.requires_grad_(n in self.name_set)
        self.params = [p for n, p in self.model.named_parameters() if n in self.name_set]
        self.export_format = self.recipe.export.format if self.recipe.export is not None else "bf16"
        self.quant_names: list[str] = []
        if cfg.qat or self.export_format == "af4g64":
            from ..model import quant

            sel = quant.selector_context if cfg.qat_scope == "selector_context" else quant.full_projection
            chosen = sel(self.model)
            self.quant_names = list(chosen.names)
            if cfg.qat and not set(self.quant_names) & self.name_set:
                raise ConfigError(
                    f"`[train].qat_scope` `{cfg.qat_scope}` selects no tensor of scope `{cfg.scope}`"
                    + (f" (skipped: {', '.join(f'`{n}` ({why})' for n, why in chosen.skipped)})" if chosen.skipped else "")
                    + "\nhint: choose a qat_scope that overlaps the trained scope"
                )
        # QAT forward: every quantized projection reads its fake-quantized value (frozen ones too).
        self.qat_names = self.quant_names if cfg.qat else []
        # Validation measures the export: trained tensors (BF16) plus, for AF4G64, every quantized one.
        val_quant = set(self.quant_names) if self.export_format == "af4g64" else set()
        self.val_quant = [n for n in names if n in val_quant]
        self.export_names = [n for n in names if n in self.name_set or n in val_quant]
        self.T = self.model.block_size
        self.pw = position_weights(self.T, cfg.gamma, cfg.position_weights, device=self.device)
        self.main_weight = 0.0 if cfg.scope == "selector" else 1.0
        sel_w = cfg.selector_weight
        self.selector_weight = (1.0 if includes_selector(cfg.scope) else 0.0) if sel_w is None else float(sel_w)
        if self.model.candidate_selector is None:
            self.selector_weight = 0.0
        if self.main_weight == 0 and self.selector_weight == 0:
            raise ConfigError("scope `selector` with `selector_weight = 0` trains nothing\nhint: remove `selector_weight`")
        self.autocast = _autocast_dtype(cfg.autocast, self.device)
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, eps=1e-8,
            fused=_fused_adamw(self.device),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_factor(s, total=cfg.steps, warmup=cfg.warmup_steps, kind=cfg.schedule, min_ratio=cfg.min_lr_ratio),
        )
        self.train_split = CapturedSplit(self.cap.output, "train", verify=True)
        self.val_split = CapturedSplit(self.cap.output, "val", verify=False) if "val" in self.cap.splits else None
        self.order = Order(len(self.train_split), cfg.seed)
        self.step = 0
        self.val_history: list[dict[str, Any]] = []
        self.committed_step: int | None = None

    # ----------------------------------------------------------------- state
    def state(self) -> dict[str, Any]:
        return {
            "sequences_seen": self.step * self.cfg.grad_accum,
            "scheduler": self.scheduler.state_dict(),
            "recipe": self.recipe.resolved(),
            **self.identity,
            "val_history": self.val_history,
            "trainable": self.names,
            "qat_names": self.qat_names,
            "total_steps": self.cfg.steps,
        }

    def save_checkpoint(self) -> Path:
        from ..device import capture_rng_state

        path = ckpt.save(
            self.run_dir,
            self.step,
            trainable={n: p.detach() for n, p in self.model.named_parameters() if n in self.name_set},
            optimizer=self.optimizer.state_dict(),
            rng=capture_rng_state(),
            state=self.state(),
        )
        self.committed_step = self.step
        best = self.best()
        ckpt.prune(self.run_dir, keep=self.cfg.keep_checkpoints, protect={best["step"]} if best else set())
        self.events.emit(
            {
                "event": "artifact",
                "name": path.name,
                "kind": "checkpoint",
                "path": str(path),
                "sha256": sha256_file(path / "manifest.json"),
                "size_bytes": sum(f.stat().st_size for f in path.iterdir()),
                "step": self.step,
            }
        )
        return path

    def restore(self, loaded: ckpt.Loaded) -> None:
        from ..device import restore_rng_state

        compare_for_resume(loaded.state, self.identity)
        if loaded.state.get("trainable") != self.names:
            raise ResumeError(f"checkpoint `{loaded.path}` trained other tensors than scope `{self.cfg.scope}`")
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if n in self.name_set:
                    p.copy_(loaded.trainable[n].to(p.device))
        self.optimizer.load_state_dict(loaded.optimizer)
        self.scheduler.load_state_dict(loaded.state["scheduler"])
        restore_rng_state(loaded.rng)
        self.step = loaded.step
        self.val_history = list(loaded.state.get("val_history") or [])
        self.committed_step = loaded.step
        truncate_metrics(self.run_dir / METRICS, loaded.step)

    # ----------------------------------------------------------------- compute
    def _autocast(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def forward(self, seq: Sequence, anchors: torch.Tensor):
        """(hidden [M, T-1, H], logits [M, T-1, V]) of the blocks at `anchors` of one sequence."""
        dev = self.device
        ids = seq.input_ids.to(dev)
        feats = seq.features.to(dev, torch.float32)[None]
        a = anchors.to(dev)[None]
        blocks = self.model.make_blocks(ids[None], a)
        embeds = self.model.embed(blocks, self.head.embed)
        with self._autocast():
            if self.cfg.gradient_checkpointing and torch.is_grad_enabled():
                from torch.utils.checkpoint import checkpoint

                hidden = checkpoint(self.model.forward_blocks, feats, a, embeds, use_reentrant=False)
            else:
                hidden = self.model.forward_blocks(feats, a, embeds)
            h = hidden[0, :, 1:]
            logits = self.model.logits(h, self.head.head)
        return h.float(), logits.float()

    def _qat(self):
        if not self.qat_names:
            return contextlib.nullcontext()
        from ..model.quant import quantized_weights

        return quantized_weights(self.model, self.qat_names)

    def train_step(self) -> dict[str, Any]:
        cfg = self.cfg
        t0 = time.perf_counter()
        self.model.train()
        batch = []
        for j in range(cfg.grad_accum):
            g = self.step * cfg.grad_accum + j
            seq = self.train_split.get(self.order(g))
            anchors = sample_anchors(seq.loss_mask, cfg.blocks_per_sequence, mix(cfg.seed, 1, g))
            labels, valid = block_labels(seq.input_ids, seq.loss_mask, anchors, self.T)
            batch.append((seq, anchors, labels.to(self.device), valid.to(self.device)))
        denom = sum(weight_total(v, self.pw) for _, a, _, v in batch if a.numel())
        tot = {"loss": 0.0, "ce": 0.0, "selector_ce": 0.0, "positions": 0, "blocks": 0}
        counts = []
        for seq, anchors, labels, valid in batch:
            if anchors.numel() == 0 or denom == 0:
                continue
            with self._qat():
                h, logits = self.forward(seq, anchors)
                ce_sum = token_loss_sum(logits, labels, valid, self.pw, cfg.objective)
                loss_sum = self.main_weight * ce_sum
                sel_sum = torch.zeros((), device=self.device)
                anchor_ids = seq.input_ids.to(self.device)[anchors.to(self.device)]
                scored = None
                if self.selector_weight > 0:
                    sel_sum, scores, cand = selector_terms(
                        self.model.candidate_selector, h, logits, anchor_ids, labels, valid, self.pw
                    )
                    scored = (scores.detach(), cand)
                    loss_sum = loss_sum + self.selector_weight * sel_sum
                (loss_sum / denom).backward()
                # the loss already ranked the vocabulary and scored the candidates: reuse that
                # (same values as `proposals` recomputing them) instead of a second top-k
                if scored is not None:
                    prop, cov = proposals_from_scores(*scored, labels)
                else:
                    prop, cov = proposals(self.model, h.detach(), logits.detach(), anchor_ids, labels)
            counts.append(match_counts(prop, cov, labels, valid))
            tot["loss"] += float(loss_sum.detach()) / denom
            tot["ce"] += float(ce_sum.detach()) / denom
            tot["selector_ce"] += float(sel_sum.detach()) / denom
            tot["positions"] += int(valid.sum())
            tot["blocks"] += int(anchors.numel())
        if cfg.grad_clip > 0:
            gnorm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
        else:
            gnorm = torch.nn.utils.clip_grad_norm_(self.params, float("inf"))
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        secs = time.perf_counter() - t0
        tokens = sum(int(a.numel()) * self.T for _, a, _, _ in batch)
        summary = summarize(counts, self.T - 1)
        return {
            "step": self.step,
            "loss": tot["loss"],
            "ce": tot["ce"],
            "selector_ce": tot["selector_ce"],
            "lr": lr,
            "grad_norm": float(gnorm),
            "blocks": tot["blocks"],
            "positions": tot["positions"],
            "train_matching_proposals": summary["matching_proposals"],
            "seconds": secs,
            "tokens_per_s": tokens / secs if secs > 0 else None,
        }

    def validate(self) -> dict[str, Any]:
        """Matching proposals on the validation split, computed with exactly the export's weights.

        The FP32 masters are swapped out for `export_values` (BF16, or AF4G64 for QAT names) and
        the very same parameter objects are put back afterwards, success or failure.
        """
        cfg = self.cfg
        values = export_values(dict(self.model.named_parameters()), self.export_names, qat_names=self.val_quant)
        counts = []
        ce = sel = denom = 0.0
        was_training = self.model.training
        self.model.eval()
        try:
            with swapped(self.model, values), torch.no_grad():
                if self.hooks.inside_validation is not None:
                    self.hooks.inside_validation(self)
                n = min(len(self.val_split), cfg.val_examples) if self.val_split is not None else 0
                for i in range(n):
                    seq = self.val_split.get(i)
                    anchors = sample_anchors(seq.loss_mask, cfg.blocks_per_sequence, mix(cfg.seed, 2, i))
                    if anchors.numel() == 0:
                        continue
                    labels, valid = block_labels(seq.input_ids, seq.loss_mask, anchors, self.T)
                    labels, valid = labels.to(self.device), valid.to(self.device)
                    h, logits = self.forward(seq, anchors)
                    anchor_ids = seq.input_ids.to(self.device)[anchors.to(self.device)]
                    if self.model.candidate_selector is not None:
                        sel_sum, scores, cand = selector_terms(
                            self.model.candidate_selector, h, logits, anchor_ids, labels, valid, self.pw
                        )
                        sel += float(sel_sum)
                        prop, cov = proposals_from_scores(scores, cand, labels)
                    else:
                        prop, cov = proposals(self.model, h, logits, anchor_ids, labels)
                    counts.append(match_counts(prop, cov, labels, valid))
                    ce += float(token_loss_sum(logits, labels, valid, self.pw, "weighted_ce"))
                    denom += weight_total(valid, self.pw)
        finally:
            self.model.train(was_training)
        out = summarize(counts, self.T - 1)
        out["ce"] = ce / denom if denom else None
        out["selector_ce"] = sel / denom if denom else None
        out["step"] = self.step
        return out

    def best(self) -> dict[str, Any] | None:
        """The selected validation entry: highest matching proposals, earliest step on ties."""
        scored = [v for v in self.val_history if v.get("blocks", 0) > 0]
        if not scored:
            return None
        return max(scored, key=lambda v: (v["matching_proposals"], -v["step"]))

    # ----------------------------------------------------------------- run
    def run(self) -> TrainResult:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        sel_path = self.run_dir / SELECTION
        existing = ckpt.latest(self.run_dir)
        if existing is not None and not self.resume:
            raise ResumeError(
                f"run directory `{self.run_dir}` already holds checkpoints\n"
                "hint: pass `--resume` to continue it, or choose another `--run-dir`"
            )
        if self.resume and sel_path.is_file():
            return self.verify_completed()
        self.setup()
        if self.resume and existing is not None:
            loaded = ckpt.load(existing)
            self.restore(loaded)
            self.events.log(f"resumed from `{existing}` at step {self.step}")
        else:  # a fresh start (also `--resume` before the first commit): no metric line survives
            (self.run_dir / METRICS).unlink(missing_ok=True)
        metrics_path = self.run_dir / METRICS
        with SignalGuard(self.flags), open(metrics_path, "a", encoding="utf-8") as mf:
            while self.step < cfg.steps:
                line = self.train_step()
                last = self.step == cfg.steps
                validated = False
                if self.val_split is not None and len(self.val_split) and (
                    (cfg.val_every and self.step % cfg.val_every == 0) or last
                ):
                    v = self.validate()
                    self.val_history.append(v)
                    line["val"] = {k: v[k] for k in ("matching_proposals", "ce", "selector_ce", "blocks", "reached", "covered", "selected")}
                    validated = True
                mf.write(json.dumps(line, sort_keys=True, allow_nan=False) + "\n")
                mf.flush()
                stop = self.flags.stop_signal is not None
                usr = self.flags.take_checkpoint_request()
                if validated or last or stop or usr or self.step % cfg.checkpoint_every == 0:
                    self.save_checkpoint()
                self.events.emit(
                    {
                        "event": "progress",
                        "phase": "train",
                        "step": self.step,
                        "total_steps": cfg.steps,
                        "metrics": {k: line[k] for k in ("loss", "lr", "grad_norm", "train_matching_proposals")},
                        "committed_step": self.committed_step,
                    }
                )
                if self.hooks.after_step is not None:
                    self.hooks.after_step(self, self.step)
                if stop:
                    msg = (
                        f"stopped by {self.flags.stop_signal} at step {self.step}/{cfg.steps}; "
                        f"checkpoint committed, continue with `--resume`"
                    )
                    self.events.log(msg)
                    return TrainResult(self.run_dir, "stopped", self.step, cfg.steps, msg, checkpoint=ckpt.latest(self.run_dir))
        return self.finish()

    def finish(self) -> TrainResult:
        """Select the best checkpoint, export it and write `selection.json` (last: marks completion)."""
        from .export_run import export_run

        best = self.best()
        chosen = best["step"] if best else self.step
        path = self.run_dir / ckpt.CHECKPOINTS / ckpt.step_name(chosen)
        selection = {
            "rule": "highest validation matching proposals (mean accepted tokens per block against the "
            "teacher's continuation), earliest step on ties; the last step when nothing was validated",
            "step": chosen,
            "checkpoint": path.name,
            "checkpoint_manifest_sha256": sha256_file(path / "manifest.json"),
            "validation": best,
            "history": [{"step": v["step"], "matching_proposals": v["matching_proposals"]} for v in self.val_history],
            "total_steps": self.cfg.steps,
        }
        fmt = self.export_format
        result = export_run(self.run_dir, fmt=fmt, recipe=self.recipe, selection=selection)
        selection["export"] = {"format": fmt, "dir": result.out_dir.name, "manifest_sha256": sha256_file(result.out_dir / "manifest.json")}
        ckpt.write_json(self.run_dir / SELECTION, selection)
        self.events.emit(
            {
                "event": "artifact",
                "name": result.out_dir.name,
                "kind": "export",
                "path": str(result.out_dir),
                "sha256": selection["export"]["manifest_sha256"],
                "size_bytes": sum(f.stat().st_size for f in result.out_dir.iterdir()),
                "step": chosen,
            }
        )
        msg = f"trained {self.step} steps; selected step {chosen}; exported `{result.out_dir}`"
        return TrainResult(self.run_dir, "completed", self.step, self.cfg.steps, msg, selection, result.out_dir, path)

    def verify_completed(self) -> TrainResult:
        """A completed run: check selection, its checkpoint and the export instead of retraining."""
        from .export_run import verify_export

        sel = json.loads((self.run_dir / SELECTION).read_text())
        path = self.run_dir / ckpt.CHECKPOINTS / sel["checkpoint"]
        state = ckpt.load(path).state
        compare_for_resume(state, self.identity)
        if sha256_file(path / "manifest.json") != sel["checkpoint_manifest_sha256"]:
            raise ResumeError(f"selected checkpoint `{path}` changed after selection")
        out = self.run_dir / sel["export"]["dir"]
        verify_export(out)
        if sha256_file(out / "manifest.json") != sel["export"]["manifest_sha256"]:
            raise ResumeError(f"export `{out}` is not the one recorded in `{self.run_dir / SELECTION}`")
        msg = f"run already complete: selection (step {sel['step']}) and export `{out}` verified"
        return TrainResult(self.run_dir, "verified", sel["total_steps"], sel["total_steps"], msg, sel, out, path)


def truncate_metrics(path: Path, step: int) -> None:
    """Keep only well-formed metric lines with ``step <= step`` (atomic rewrite)."""
    if not path.is_file():
        return
    kept = []
    for raw in path.read_bytes().splitlines():
        try:
            obj = json.loads(raw)
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("step"), int) and obj["step"] <= step:
            kept.append(raw + b"\n")
    from ..manifest import write_bytes_atomic

    write_bytes_atomic(path, b"".join(kept))


def resolve_run_dir(recipe: Recipe, run_dir: str | Path | None) -> Path:
    if run_dir is not None:
        return Path(run_dir)
    cfg = recipe.require("train")
    if cfg.output is None:
        raise ConfigError("no run directory: pass `--run-dir DIR` or set `[train].output`")
    return Path(cfg.output)


def train(
    recipe: Recipe,
    *,
    run_dir: str | Path | None = None,
    resume: bool = False,
    on_event: EventFn | None = None,
    flags: StopFlags | None = None,
    hooks: Hooks | None = None,
) -> TrainResult:
    """Run (or resume, or verify) the training run of `recipe` in `run_dir`."""
    trainer = Trainer(recipe, resolve_run_dir(recipe, run_dir), resume=resume, on_event=on_event, flags=flags, hooks=hooks)
    try:
        return trainer.run()
    finally:
        trainer.events.close()
