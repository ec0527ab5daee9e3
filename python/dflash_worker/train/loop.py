"""The training run: check data, load, train, checkpoint, validate, select, export.

`train(recipe, run_dir=..., resume=...)` is the library entry point behind
`dflash-worker train`; `Trainer` holds one run's state so tests and the job
runner can drive it step by step. `Trainer.setup` loads what a run trains
(`TrainSetup`: draft, target head, optimizer, captured data); training and
validation share one forward path (`Trainer.score`: forward -> token loss ->
selector terms -> proposals -> match counts).

Run directory::

    RUN/metrics.jsonl     one JSON line per optimizer step (validation merged in)
    RUN/checkpoints/      committed checkpoints (see `checkpoint`)
    RUN/selection.json    the selected checkpoint and why (written when training completes)
    RUN/export/           the export of the selected checkpoint (`[export].format`)

Order of work inside step s: micro-batches (forward, backward) -> the L2-SP
gradient (`[train].l2sp > 0`, `Trainer._l2sp`) -> clip ->
AdamW step -> scheduler step -> validation (every `val_every` steps and at the
last step) -> metrics line -> checkpoint (every `checkpoint_every` steps, at
validation steps, at the last step, at a replay's `stop_at`, and on SIGUSR1/SIGINT/SIGTERM). The
metrics line is written before the checkpoint commits, so a crash in between
leaves a line past the newest checkpoint, which `--resume` truncates: every
step appears in ``metrics.jsonl`` exactly once.

Selection rule: the validated checkpoint with the highest mean matching
proposals on the validation split (ties: the earliest step). A checkpoint is
committed at every validation step and the best one is never pruned. Without
a validation split (or with ``val_every = 0`` and no val examples) the last
step is selected.

General-domain guard: when the capture's val split holds general rows
(`prepare-data --replay-val-fraction`, listed in the capture manifest's
``data.replay.val_ids``), validation measures the own rows and the general
rows apart (the first `val_examples` of each), and the run measures the
released draft on the general rows once, before the first update, through the
same export-values path (``released_general``, kept in every checkpoint). The
rule then becomes: among validated checkpoints whose general matching
proposals are at least ``(1 - [train].general_tolerance) x`` the released
draft's, the highest own matching proposals (ties: the earliest step). A
fresh guarded run commits a checkpoint at step 0 (the released draft as
loaded, never pruned) after measuring it, own rows too
(``released_general.own``); when no trained checkpoint passes, that one is
selected: the export is the released draft, ``selection.json``'s
``guard.passed`` is false and a warning says so. (A run resumed from
checkpoints written before step 0 was committed falls back to the checkpoint
with the highest general matching proposals.)
``guard`` lists every validated step and whether the guard rejected it. With
``[train].guard_patience = P > 0`` the run stops once the guard rejected P
validations in a row (training further only forgets more), selects and
exports as above, and ``selection.json``'s ``guard.stopped_at`` names the step
(None when the run trained every step). Without general rows nothing of this
exists: validation, metrics and ``selection.json`` are what they were.

Replay distillation (`[train].replay_kd = K > 0`): on the train split's replay
rows (`prepare-data --replay`, listed in the capture manifest's
``data.replay.train_ids``), the step also runs the starting draft (the trained
tensors swapped back to their values as loaded, `TrainSetup.start`, no grad,
outside any QAT context) on the same blocks and adds
``K * objectives.kd_loss_sum``, the KL from its block distributions to the
trained draft's, to that row's loss (same normaliser); the metrics line gets
``replay_kd`` (the step's KL over the normaliser). Own rows are untouched. A
capture without ``train_ids`` (or whose train split holds none of them) is a
`ConfigError` at setup.

Features (`[train].features`): `cache` reads each sequence's target features from the capture;
`online` (the capture holds token ids only) loads the frozen target in `TrainSetup.load` and
computes them as each sequence is read (`data.CapturedSplit`, through `capture.teacher.Teacher`,
the component capture calls), so the rest of the step is the same code either way.

Resume compatibility: the resolved recipe minus operational fields
(`RESUME_IGNORED`: output and checkpoint cadence, devices, paths whose content
the data and draft fingerprints already cover, the export/evaluate sections),
the capture fingerprint (sha256 of the capture manifest, which names the
teacher's and data's hashes) and the draft fingerprint (sha256 of every file
of the released draft) must all equal the checkpoint's; otherwise
`ResumeError` names the differing fields.

Events (`worker.events`, to the `on_event` sink of `train`):

- ``Log`` ``resumed from `CHECKPOINT` at step S`` after a resume;
- ``Log`` ``released draft: general-domain matching proposals X on N examples ...``
  once the guard's baseline is measured (a fresh run with general val rows);
- ``Log`` (warning) ``no checkpoint kept ...`` when no checkpoint passes the guard;
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

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from .. import dist
from ..errors import CheckpointError, ConfigError, ResumeError
from ..manifest import fingerprint, sha256_file
from ..recipe import Recipe, TrainConfig
from ..worker.events import Artifact, Event, EventSink, Log, Progress
from . import checkpoint as ckpt
from .data import CapturedSplit, Order, Sequence, mix, sample_anchors
from .objectives import (
    block_labels,
    kd_loss_sum,
    match_counts,
    position_weights,
    proposals,
    proposals_from_scores,
    selector_terms,
    summarize,
    token_loss_sum,
    weight_total,
)
from .params import TargetHead, export_values, load_target_head, swapped
from .schedule import lr_factor
from .scopes import includes_selector, scope_names
from .signals import SignalGuard, StopFlags

if TYPE_CHECKING:
    from ..capture.teacher import Teacher
    from ..device import DeviceChoice
    from ..model import DraftModel

RESUME_IGNORED = frozenset(
    {
        "train.output",
        "train.checkpoint_every",
        "train.keep_checkpoints",
        "train.device",
        "capture.device",
        "capture.on_overlong",  # its effect is in the capture key, hence the data fingerprint
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


def check_capture_fits_draft(capture_dir: Path, draft_dir: Path, features: str = "cache") -> None:
    """The capture holds the features of the target layers the draft taps (manifests and config.json only),
    and it was made for `features` (`[train].features`): a cache capture holds them, an online one the tokens only.

    A capture made for another draft (another `target_layer_ids`) would otherwise train on the wrong layers
    whenever the number of taps agrees."""
    from ..model.io import read_target_layer_ids
    from ..errors import DataError

    manifest = json.loads((Path(capture_dir) / "manifest.json").read_text(encoding="utf-8"))
    stored = manifest.get("features", "cache")
    if stored != features:
        raise DataError(
            f"capture `{capture_dir}` was made with `[train].features = \"{stored}\"`, but this recipe trains with "
            f"`\"{features}\"`\nhint: capture again with this recipe (a new `[capture].output`), or set "
            f"`[train].features = \"{stored}\"`"
        )
    captured = manifest.get("target_layer_ids")
    tapped = read_target_layer_ids(draft_dir)
    if captured != tapped:
        raise DataError(
            f"capture `{capture_dir}` holds the features of target layers `{captured}`, but draft `{draft_dir}` "
            f"taps target layers `{tapped}`\nhint: capture again for this draft (a new `[capture].output`), "
            "or train the draft the capture was made for"
        )


def compare_for_resume(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Raise `ResumeError` naming every field in which `current` differs from `saved`."""
    diffs = []
    s_rec, c_rec = saved.get("recipe_view") or {}, current["recipe_view"]
    if s_rec:  # a key added after a checkpoint was written (or absent from a view) counts as its default
        added = {"train.features": "cache", "train.general_tolerance": 0.03, "train.guard_patience": 0, "train.replay_kd": 0.0}
        s_rec, c_rec = {**added, **s_rec}, {**added, **c_rec}
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


# --------------------------------------------------------------------- setup
@dataclass(frozen=True)
class TrainedTensors:
    """Which draft tensors train, which the forward fake-quantizes, which validation swaps in."""

    names: list[str]  # trained, in model order
    name_set: frozenset[str]
    quant_names: list[str]  # what AF4G64 quantizes (QAT or an AF4G64 export); else empty
    qat_names: list[str]  # fake-quantized in the training forward: every quantized projection, frozen ones too
    val_quant: list[str]  # read as their AF4G64 values in validation (an AF4G64 export)
    export_names: list[str]  # validation measures the export: trained tensors (BF16) plus `val_quant`


def select_tensors(model: DraftModel, cfg: TrainConfig, export_format: str) -> TrainedTensors:
    """The tensors of `[train].scope` and of the QAT / export quantization scope; refuses a QAT scope that misses them."""
    every = [n for n, _ in model.named_parameters()]
    names = scope_names(cfg.scope, every)
    name_set = frozenset(names)
    quant_names: list[str] = []
    if cfg.qat or export_format == "af4g64":
        from ..model import quant

        sel = quant.selector_context if cfg.qat_scope == "selector_context" else quant.full_projection
        chosen = sel(model)
        quant_names = list(chosen.names)
        if cfg.qat and not set(quant_names) & name_set:
            raise ConfigError(
                f"`[train].qat_scope` `{cfg.qat_scope}` selects no tensor of scope `{cfg.scope}`"
                + (f" (skipped: {', '.join(f'`{n}` ({why})' for n, why in chosen.skipped)})" if chosen.skipped else "")
                + "\nhint: choose a qat_scope that overlaps the trained scope"
            )
    val_quant = set(quant_names) if export_format == "af4g64" else set()
    return TrainedTensors(
        names=names,
        name_set=name_set,
        quant_names=quant_names,
        qat_names=quant_names if cfg.qat else [],
        val_quant=[n for n in every if n in val_quant],
        export_names=[n for n in every if n in name_set or n in val_quant],
    )


@dataclass(frozen=True, eq=False)
class LossWeights:
    """Block size, position weights [T-1] and the weights of the two objectives (see `objectives`)."""

    block_size: int
    positions: torch.Tensor
    main: float  # 0 for scope `selector`, whose tensors do not change the logits
    selector: float  # 0 when the draft has no candidate selector


def loss_weights(model: DraftModel, cfg: TrainConfig, device: torch.device) -> LossWeights:
    T = model.block_size
    main = 0.0 if cfg.scope == "selector" else 1.0
    sel_w = cfg.selector_weight
    selector = (1.0 if includes_selector(cfg.scope) else 0.0) if sel_w is None else float(sel_w)
    if model.candidate_selector is None:
        if sel_w is not None and sel_w > 0:
            raise ConfigError(
                f"`[train].selector_weight` is `{sel_w}` but the draft is a DFlash (v1) draft, which has no candidate selector"
                "\nhint: remove `selector_weight`"
            )
        selector = 0.0
    if main == 0 and selector == 0:
        raise ConfigError("scope `selector` with `selector_weight = 0` trains nothing\nhint: remove `selector_weight`")
    return LossWeights(T, position_weights(T, cfg.gamma, cfg.position_weights, device=device), main, selector)


@dataclass(frozen=True, eq=False)
class TrainSetup:
    """What `Trainer.setup` loads: the draft (FP32 masters), the target head, the optimizer, the data."""

    device: torch.device
    model: DraftModel
    head: TargetHead
    tensors: TrainedTensors
    params: list[torch.nn.Parameter]  # the trained tensors' parameters, in model order
    weights: LossWeights
    autocast: torch.dtype | None
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    train_split: CapturedSplit
    val_split: CapturedSplit | None
    order: Order
    # the val split's own rows and general rows (`prepare-data --replay-val-fraction`), as indices
    val_own: list[int]
    val_general: list[int]
    # `[train].features = "online"`: the frozen target, run in the step for each sequence's features
    teacher: Teacher | None = None
    # `[train].l2sp > 0` or `[train].replay_kd > 0`: the trained tensors' starting values (the draft
    # the recipe names), FP32
    start: list[torch.Tensor] | None = None
    # `[train].replay_kd > 0`: the train split's replay rows (`data.replay.train_ids`), as indices
    replay_rows: frozenset[int] = frozenset()

    @classmethod
    def load(
        cls, recipe: Recipe, export_format: str, choice: DeviceChoice | None = None, ranks: dist.Ranks | None = None
    ) -> TrainSetup:
        """Everything a run trains with; `choice` replaces resolving `[train].device` when given;
        with several `ranks`, this rank's device (`dist.place`) and the process group joined."""
        from ..device import resolve_device
        from ..model import load_draft

        cfg, cap = recipe.require("train"), recipe.require("capture")
        ranks = ranks or dist.Ranks()
        device = dist.place(ranks, (choice or resolve_device(cfg.device)).torch_device)
        dist.init(ranks, device)
        model = load_draft(recipe.model.draft, device=device, dtype=torch.float32)
        head = load_target_head(recipe.model.target, device=device, dtype=torch.float32)
        tensors = select_tensors(model, cfg, export_format)
        for n, p in model.named_parameters():
            p.requires_grad_(n in tensors.name_set)
        params = [p for n, p in model.named_parameters() if n in tensors.name_set]
        weights = loss_weights(model, cfg, device)
        optimizer = torch.optim.AdamW(
            params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, eps=1e-8, fused=_fused_adamw(device)
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda s: lr_factor(s, total=cfg.steps, warmup=cfg.warmup_steps, kind=cfg.schedule, min_ratio=cfg.min_lr_ratio),
        )
        teacher = None
        if cfg.features == "online":
            from ..model.io import read_target_layer_ids
            from ..capture.teacher import Teacher

            # the capture's dtype and the one component capture calls (`capture.teacher`), so the
            # features equal the cache's on the same kind of device
            teacher = Teacher.load(recipe.model.target, read_target_layer_ids(recipe.model.draft), device=str(device), dtype=cap.dtype)
        train_split = CapturedSplit(cap.output, "train", verify=True, teacher=teacher)
        val_split = CapturedSplit(cap.output, "val", verify=False, teacher=teacher) if "val" in cap.splits else None
        val_own, val_general = general_val_rows(val_split)
        if cfg.preset == "keep_general" and not val_general:
            raise ConfigError(
                f"`[train].preset = \"keep_general\"` guards the selection with general-domain val rows, but the "
                f"capture `{cap.output}` holds none in `val` (`data.replay.val_ids`)"
                "\nhint: prepare the data with `prepare-data --replay GENERAL.jsonl --replay-val-fraction 0.1` "
                "and capture again, or remove `preset`"
            )
        replay_rows = replay_train_rows(train_split) if cfg.replay_kd > 0 else frozenset()
        return cls(
            device=device, model=model, head=head, tensors=tensors, params=params, weights=weights,
            autocast=_autocast_dtype(cfg.autocast, device), optimizer=optimizer, scheduler=scheduler,
            train_split=train_split, val_split=val_split, order=Order(len(train_split), cfg.seed),
            val_own=val_own, val_general=val_general,
            start=[p.detach().clone() for p in params] if cfg.l2sp > 0 or cfg.replay_kd > 0 else None, teacher=teacher,
            replay_rows=replay_rows,
        )


def replay_train_rows(split: CapturedSplit) -> frozenset[int]:
    """Indices of the train split's replay rows: those the capture manifest lists in
    ``data.replay.train_ids`` (`prepare-data --replay`). `[train].replay_kd` needs some."""
    replay = (split.reader.manifest.get("data") or {}).get("replay") or {}
    ids = replay.get("train_ids")
    if ids is None:
        raise ConfigError(
            f"`[train].replay_kd` distils on the train split's replay rows, but the capture `{split.reader.path}` "
            "lists none (`data.replay.train_ids`)"
            "\nhint: prepare the data with `prepare-data --replay FILE` (data prepared before replay rows were "
            "listed: prepare and capture again), or set `replay_kd = 0`"
        )
    wanted = set(ids)
    rows = frozenset(i for i in range(len(split)) if split.id_of(i) in wanted)
    if not rows:
        raise ConfigError(
            f"`[train].replay_kd` distils on replay rows, but none of the {len(wanted)} the capture lists reached "
            f"its train split (`{split.reader.path}`)\nhint: prepare with a larger `--replay-fraction`, or set `replay_kd = 0`"
        )
    return rows


def general_val_rows(split: CapturedSplit | None) -> tuple[list[int], list[int]]:
    """(own, general) indices of the val split: general rows are those the capture manifest lists
    in ``data.replay.val_ids`` (`prepare-data --replay-val-fraction`), in capture order."""
    if split is None:
        return [], []
    general_ids = set(((split.reader.manifest.get("data") or {}).get("replay") or {}).get("val_ids") or ())
    own, general = [], []
    for i in range(len(split)):
        (general if split.id_of(i) in general_ids else own).append(i)
    return own, general


# --------------------------------------------------------------------- the shared forward path
@dataclass(frozen=True, eq=False)
class Blocks:
    """The anchored blocks of one sequence with their labels (`objectives.block_labels`)."""

    seq: Sequence
    anchors: torch.Tensor  # [M]
    labels: torch.Tensor  # [M, T-1], on the device
    valid: torch.Tensor  # [M, T-1] bool, on the device
    replay: bool = False  # a replay row of the train split (`[train].replay_kd` distils on it)


@dataclass(frozen=True, eq=False)
class BlockScores:
    """What one forward over `Blocks` gives training and validation alike."""

    ce_sum: torch.Tensor  # token loss sum of the objective asked for (graph attached when grad is on)
    selector_sum: torch.Tensor  # selector CE sum; 0 when the selector was not scored
    counts: dict[str, list[int]]  # `objectives.match_counts` of the draft's proposals
    kd_sum: torch.Tensor | None = None  # `[train].replay_kd`'s KL sum; None when not asked for


VAL_KEYS = ("matching_proposals", "ce", "selector_ce", "blocks", "reached", "covered", "selected")
PROGRESS_KEYS = ("loss", "lr", "grad_norm", "train_matching_proposals", "tokens_per_s")


def _ignore(event: Event) -> None:
    pass


class Trainer:
    """One training run. Construct, then `run()`; see the module docstring.

    `__init__` checks and fingerprints the inputs (no weights read) and holds the run's
    progress (`step`, `val_history`, `committed_step`); `setup()` loads the `TrainSetup`.
    `device` (a resolved placement) replaces resolving `[train].device`; `attention` is the
    draft forward's attention backend (`DraftModel.forward_blocks`).
    """

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
        # older one, else start fresh (`_restore_newest_usable`); without it such a checkpoint fails the run.
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
            self._check_data()
        from ..families import check_recipe_pair

        check_recipe_pair(recipe.model.target, recipe.model.draft, recipe.model.family)
        check_capture_fits_draft(self.cap.output, recipe.model.draft, self.cfg.features)
        self.identity = {
            "recipe_view": resume_view(recipe),
            "recipe_fingerprint": fingerprint(resume_view(recipe)),
            "data_fingerprint": capture_fingerprint(self.cap.output),
            "draft_fingerprint": draft_fingerprint(recipe.model.draft),
        }
        self.step = 0
        self.val_history: list[dict[str, Any]] = []
        # the released draft on the general val rows (the guard's baseline), measured before the first update
        self.released_general: dict[str, Any] | None = None
        # the step at which `guard_patience` stopped the run (None: it has not)
        self.guard_stopped_at: int | None = None
        self.committed_step: int | None = None
        self._setup: TrainSetup | None = None

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
        # examples over max_length were skipped or truncated by the capture (its manifest's
        # `overlong`), or refused by it; training reads the capture, so they are no failure here
        report.raise_if_failed(overlong="skip")

    def setup(self) -> None:
        """Load the draft (FP32 masters), the target head and the captured data."""
        self._setup = TrainSetup.load(self.recipe, self.export_format, self.device_choice, self.ranks)

    # Read-only views of the setup, for the methods below, hooks and tests.
    @property
    def parts(self) -> TrainSetup:
        assert self._setup is not None, "`Trainer.setup()` must run first"
        return self._setup

    @property
    def model(self) -> DraftModel:
        return self.parts.model

    @property
    def optimizer(self) -> torch.optim.AdamW:
        return self.parts.optimizer

    @property
    def train_split(self) -> CapturedSplit:
        return self.parts.train_split

    @property
    def val_split(self) -> CapturedSplit | None:
        return self.parts.val_split

    @property
    def order(self) -> Order:
        return self.parts.order

    @property
    def names(self) -> list[str]:
        return self.parts.tensors.names

    @property
    def name_set(self) -> frozenset[str]:
        return self.parts.tensors.name_set

    @property
    def qat_names(self) -> list[str]:
        return self.parts.tensors.qat_names

    @property
    def T(self) -> int:
        return self.parts.weights.block_size

    @property
    def pw(self) -> torch.Tensor:
        return self.parts.weights.positions

    @property
    def main_weight(self) -> float:
        return self.parts.weights.main

    # ----------------------------------------------------------------- state
    def state(self) -> dict[str, Any]:
        return {
            "sequences_seen": self.step * self.cfg.grad_accum,
            "scheduler": self.parts.scheduler.state_dict(),
            "recipe": self.recipe.resolved(),
            **self.identity,
            "val_history": self.val_history,
            # only with general val rows: other runs' checkpoints stay what they were
            **({} if self.released_general is None else {"released_general": self.released_general}),
            "trainable": self.names,
            "qat_names": self.qat_names,
            "total_steps": self.cfg.steps,
        }

    def save_checkpoint(self) -> Path:
        """Commit a checkpoint of this step, prune old ones, report its manifest as an artifact."""
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
        protect = {best["step"]} if best else set()
        if self.released_general is not None:  # step 0, the released draft: what the guard falls back to
            protect.add(0)
        ckpt.prune(self.run_dir, keep=self.cfg.keep_checkpoints, protect=protect)
        manifest = path / "manifest.json"
        name = f"{ckpt.CHECKPOINTS}/{path.name}/{manifest.name}"
        self.emit(Artifact.for_file(manifest.absolute(), artifact=name, kind="checkpoint", step=self.step))
        return path

    def _restore_newest_usable(self, existing: Path) -> bool:
        """Restore `existing`, else the next older committed checkpoint that loads and fits this run;
        False (a fresh start) when none does. Each one skipped is a warning, never a failure: a
        coordinator job's checkpoints may come from another attempt (`skip_unusable`)."""
        older = [p for _, p in reversed(ckpt.committed(self.run_dir)) if p != existing]
        for path in [existing, *older]:
            try:
                loaded = ckpt.load(path)
                if not 0 <= loaded.step <= self.cfg.steps:
                    raise CheckpointError(f"checkpoint `{path}` is at step {loaded.step}, outside this run's 0..{self.cfg.steps}")
                self.restore(loaded)
            except (CheckpointError, ResumeError, KeyError, ValueError, TypeError, RuntimeError) as exc:
                why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                self.emit(Log(level="warning", message=f"skipped checkpoint `{path}`: {why[:300]}"))
                self.step, self.val_history, self.committed_step = 0, [], None
                self.setup()  # a restore that failed midway may have changed the model or the optimizer
                continue
            self.emit(Log(message=f"resumed from `{path}` at step {self.step}"))
            return True
        self.emit(Log(level="warning", message="no committed checkpoint could be resumed; training starts from step 0"))
        return False

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
        self.parts.scheduler.load_state_dict(loaded.state["scheduler"])
        restore_rng_state(loaded.rng)
        self.step = loaded.step
        self.val_history = list(loaded.state.get("val_history") or [])
        self.released_general = loaded.state.get("released_general")
        self.committed_step = loaded.step
        if self.ranks.main:  # the metrics file is rank 0's: another rank rewriting it would race its appends
            truncate_metrics(self.run_dir / METRICS, loaded.step)

    # ----------------------------------------------------------------- compute
    def _autocast(self):
        if self.parts.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.parts.device.type, dtype=self.parts.autocast)

    def forward(self, seq: Sequence, anchors: torch.Tensor):
        """(hidden [M, T-1, H], logits [M, T-1, V]) of the blocks at `anchors` of one sequence."""
        dev, head = self.parts.device, self.parts.head
        ids = seq.input_ids.to(dev)
        feats = seq.features.to(dev, torch.float32)[None]
        a = anchors.to(dev)[None]
        blocks = self.model.make_blocks(ids[None], a)
        embeds = self.model.embed(blocks, head.embed)
        with self._autocast():
            if self.cfg.gradient_checkpointing and torch.is_grad_enabled():
                from torch.utils.checkpoint import checkpoint

                hidden = checkpoint(self.model.forward_blocks, feats, a, embeds, attention=self.attention, use_reentrant=False)
            else:
                hidden = self.model.forward_blocks(feats, a, embeds, attention=self.attention)
            h = hidden[0, :, 1:]
            logits = self.model.logits(h, head.head)
        return h.float(), logits.float()

    def blocks(self, seq: Sequence, anchors: torch.Tensor, *, replay: bool = False) -> Blocks:
        labels, valid = block_labels(seq.input_ids, seq.loss_mask, anchors, self.T)
        return Blocks(seq, anchors, labels.to(self.parts.device), valid.to(self.parts.device), replay)

    def score(self, b: Blocks, *, objective: str, with_selector: bool, kd_target: torch.Tensor | None = None) -> BlockScores:
        """The one forward path of training and validation: forward, token loss of `objective`,
        selector terms (when `with_selector`), the draft's proposals and their match counts; with
        `kd_target` (the starting draft's logits on `b`), ``sum_k valid_k * w_k * KL(p_start || p)``."""
        h, logits = self.forward(b.seq, b.anchors)
        ce_sum = token_loss_sum(logits, b.labels, b.valid, self.pw, objective)
        kd_sum = None if kd_target is None else kd_loss_sum(logits, kd_target, b.valid, self.pw)
        anchor_ids = b.seq.input_ids.to(self.parts.device)[b.anchors.to(self.parts.device)]
        if with_selector:
            sel_sum, scores, cand = selector_terms(self.model.candidate_selector, h, logits, anchor_ids, b.labels, b.valid, self.pw)
            # the loss already ranked the vocabulary and scored the candidates: reuse that
            # (same values as `proposals` recomputing them) instead of a second top-k
            prop, cov = proposals_from_scores(scores.detach(), cand, b.labels)
        else:
            sel_sum = torch.zeros((), device=self.parts.device)
            prop, cov = proposals(self.model, h.detach(), logits.detach(), anchor_ids, b.labels)
        return BlockScores(ce_sum, sel_sum, match_counts(prop, cov, b.labels, b.valid), kd_sum)

    def _qat(self):
        if not self.qat_names:
            return contextlib.nullcontext()
        from ..model.quant import quantized_weights

        return quantized_weights(self.model, self.qat_names)

    def _micro_batches(self, slots: list[int]) -> list[Blocks]:
        """The sequences of this step's micro-batch `slots` and their seeded anchors (`data` module docstring)."""
        cfg = self.cfg
        out = []
        for j in slots:
            g = self.step * cfg.grad_accum + j
            row = self.order(g)
            seq = self.train_split.get(row)
            anchors = sample_anchors(seq.loss_mask, cfg.blocks_per_sequence, mix(cfg.seed, 1, g))
            out.append(self.blocks(seq, anchors, replay=row in self.parts.replay_rows))
        return out

    @contextlib.contextmanager
    def _starting_weights(self) -> Iterator[None]:
        """The trained tensors hold their starting values (`TrainSetup.start`: the released draft, as
        loaded) inside, without grad; the very same tensors are put back afterwards."""
        saved = [p.data for p in self.parts.params]
        try:
            with torch.no_grad():
                for p, p0 in zip(self.parts.params, self.parts.start):
                    p.data = p0
                yield
        finally:
            for p, d in zip(self.parts.params, saved):
                p.data = d

    def _start_logits(self, b: Blocks) -> torch.Tensor:
        """The starting (released) draft's block logits on `b` (same features, anchors and attention;
        outside any QAT context: the draft as released), what `[train].replay_kd` distils toward."""
        with self._starting_weights():
            return self.forward(b.seq, b.anchors)[1]

    def _optimizer_step(self) -> tuple[float, float]:
        """Clip, AdamW step, scheduler step; returns (grad norm before clipping, lr used)."""
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        gnorm = torch.nn.utils.clip_grad_norm_(self.parts.params, clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.parts.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return float(gnorm), lr

    def _l2sp(self) -> float | None:
        """`[train].l2sp` (L2-SP): add the gradient of ``l2sp / 2 * ||w - w_start||^2`` over the trained
        tensors, `w_start` being the draft the recipe starts from, so adapting pulls back toward the
        released weights instead of drifting from them. Added once, after the gradients are summed
        over ranks (every rank holds the same weights); returns the penalty before this step's update."""
        start = self.parts.start
        if start is None:
            return None
        lam = self.cfg.l2sp
        total = 0.0
        with torch.no_grad():
            for p, p0 in zip(self.parts.params, start):
                diff = p.detach() - p0
                total += float(diff.square().sum())
                if p.grad is None:
                    p.grad = lam * diff
                else:
                    p.grad.add_(diff, alpha=lam)
        return 0.5 * lam * total

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over `grad_accum` micro-batches; returns its metrics line."""
        w, ranks, dev = self.parts.weights, self.ranks, self.parts.device
        t0 = time.perf_counter()
        self.model.train()
        slots = ranks.mine(self.cfg.grad_accum)
        batch = self._micro_batches(slots)
        # the normaliser of the whole step, over every rank's micro-batches (`dist`)
        denom = dist.sum_floats(ranks, [sum(weight_total(b.valid, w.positions) for b in batch if b.anchors.numel())], dev)[0]
        tot = {"loss": 0.0, "ce": 0.0, "selector_ce": 0.0, "kd": 0.0, "positions": 0, "blocks": 0, "accepted": 0}
        kd = self.cfg.replay_kd
        # the step's sequences in slot order, whichever rank computes them (no collective needed)
        samples = [self.train_split.id_of(self.order(self.step * self.cfg.grad_accum + j)) for j in range(self.cfg.grad_accum)]
        for b in batch:
            if b.anchors.numel() == 0 or denom == 0:
                continue
            target = self._start_logits(b) if kd > 0 and b.replay else None
            with self._qat():
                s = self.score(b, objective=self.cfg.objective, with_selector=w.selector > 0, kd_target=target)
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
        tokens = sum(int(b.anchors.numel()) * self.T for b in batch)
        *sums, tokens = dist.sum_floats(ranks, [*(tot[k] for k in keys), tokens], dev)  # one collective for the metrics
        if ranks.active:
            tot = {k: (v if k in ("loss", "ce", "selector_ce", "kd") else int(v)) for k, v in zip(keys, sums)}
        secs = time.perf_counter() - t0
        return {
            "samples": samples,
            "step": self.step,
            "loss": tot["loss"],
            "ce": tot["ce"],
            "selector_ce": tot["selector_ce"],
            "lr": lr,
            "grad_norm": gnorm,
            "blocks": tot["blocks"],
            "positions": tot["positions"],
            "train_matching_proposals": tot["accepted"] / tot["blocks"] if tot["blocks"] else 0.0,
            "seconds": secs,
            "tokens_per_s": tokens / secs if secs > 0 else None,
            "world_size": ranks.world,
            **({} if penalty is None else {"l2sp_penalty": penalty}),
            **({"replay_kd": tot["kd"]} if kd > 0 else {}),
        }

    def _val_blocks(self, rows: list[int]) -> Iterator[Blocks]:
        """The first `val_examples` of the validation sequences `rows` with anchors (the same at every validation)."""
        cfg, split = self.cfg, self.val_split
        for i in rows[: cfg.val_examples] if split is not None else ():
            seq = split.get(i)
            anchors = sample_anchors(seq.loss_mask, cfg.blocks_per_sequence, mix(cfg.seed, 2, i))
            if anchors.numel():
                yield self.blocks(seq, anchors)

    @contextlib.contextmanager
    def _export_weights(self) -> Iterator[None]:
        """The draft in eval mode, without grad, with the FP32 masters swapped out for `export_values`
        (BF16, or AF4G64 for QAT names); the very same parameter objects are put back afterwards,
        success or failure."""
        tensors = self.parts.tensors
        values = export_values(dict(self.model.named_parameters()), tensors.export_names, qat_names=tensors.val_quant)
        was_training = self.model.training
        self.model.eval()
        try:
            with swapped(self.model, values), torch.no_grad():
                yield
        finally:
            self.model.train(was_training)

    def _measure(self, rows: list[int]) -> dict[str, Any]:
        """Matching proposals (`summarize`) and the CE terms over validation sequences `rows`."""
        counts = []
        ce = sel = denom = 0.0
        for b in self._val_blocks(rows):
            s = self.score(b, objective="weighted_ce", with_selector=self.model.candidate_selector is not None)
            counts.append(s.counts)
            ce += float(s.ce_sum)
            sel += float(s.selector_sum)
            denom += weight_total(b.valid, self.pw)
        out = summarize(counts, self.T - 1)
        out["ce"] = ce / denom if denom else None
        out["selector_ce"] = sel / denom if denom else None
        return out

    def validate(self) -> dict[str, Any]:
        """Matching proposals on the validation split, computed with exactly the export's weights
        (`_export_weights`): the own rows, and the general rows apart (``general``) when there are any."""
        with self._export_weights():
            if self.hooks.inside_validation is not None:
                self.hooks.inside_validation(self)
            out = self._measure(self.parts.val_own)
            general = self._measure(self.parts.val_general) if self.parts.val_general else None
        out["step"] = self.step
        if general is not None:
            out["general"] = {k: general[k] for k in VAL_KEYS}
        return out

    def measure_released(self) -> dict[str, Any]:
        """The guard's baseline: the general val rows scored with the export values of the draft as
        loaded (call before the first update), through the path `validate` takes; ``own``: the own
        rows, what selecting the released draft (step 0) records."""
        assert self.step == 0, "the released draft is measured before the first update"
        with self._export_weights():
            general = self._measure(self.parts.val_general)
            own = self._measure(self.parts.val_own)
        return {"step": 0, "examples": len(self.parts.val_general[: self.cfg.val_examples]), **{k: general[k] for k in VAL_KEYS},
                "own": {k: own[k] for k in VAL_KEYS}}

    def guard(self) -> dict[str, Any] | None:
        """The general-domain guard over the validation history (module docstring), as ``selection.json``
        records it; None when the run has no released general baseline (no general val rows)."""
        rel = self.released_general
        if rel is None or not rel.get("blocks"):
            return None
        tol = self.cfg.general_tolerance
        floor = (1.0 - tol) * rel["matching_proposals"]
        steps = []
        for v in self.val_history:
            if v.get("blocks", 0) <= 0:
                continue
            g = v.get("general") or {}
            kept = bool(g.get("blocks")) and g["matching_proposals"] >= floor
            steps.append({"step": v["step"], "matching_proposals": v["matching_proposals"],
                          "general_matching_proposals": g.get("matching_proposals"), "rejected": not kept})
        return {
            "tolerance": tol,
            "released_general_matching_proposals": rel["matching_proposals"],
            "released_general_blocks": rel["blocks"],
            "floor": floor,
            "passed": any(not c["rejected"] for c in steps),
            "rejected_steps": [c["step"] for c in steps if c["rejected"]],
            "patience": self.cfg.guard_patience,
            "stopped_at": self.guard_stopped_at,
            "checkpoints": steps,
        }

    def guard_exhausted(self) -> bool:
        """Whether `[train].guard_patience` stops the run here: its last P validations were all rejected."""
        p = self.cfg.guard_patience
        guard = self.guard() if p > 0 else None
        if guard is None or len(guard["checkpoints"]) < p:
            return False
        return all(c["rejected"] for c in guard["checkpoints"][-p:])

    def _released_checkpoint(self) -> bool:
        """Whether the run committed the released draft as step 0 (a guarded run since `guard_patience`)."""
        return (self.run_dir / ckpt.CHECKPOINTS / ckpt.step_name(0)).is_dir()

    def best(self) -> dict[str, Any] | None:
        """The selected validation entry: highest matching proposals, earliest step on ties; with the
        general-domain guard, among the checkpoints it keeps (none kept: the released draft, step 0,
        else, for runs from before it was committed, the highest general ones)."""
        scored = [v for v in self.val_history if v.get("blocks", 0) > 0]
        if not scored:
            return None
        guard = self.guard()
        if guard is None:
            return max(scored, key=lambda v: (v["matching_proposals"], -v["step"]))
        kept = {c["step"] for c in guard["checkpoints"] if not c["rejected"]}
        if kept:
            return max((v for v in scored if v["step"] in kept), key=lambda v: (v["matching_proposals"], -v["step"]))
        rel = self.released_general or {}
        if self._released_checkpoint():
            return {"step": 0, **(rel.get("own") or {}), "general": {k: rel.get(k) for k in VAL_KEYS}}
        return max(scored, key=lambda v: ((v.get("general") or {}).get("matching_proposals", -1.0), -v["step"]))

    # ----------------------------------------------------------------- run
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
            resumed = self._restore_newest_usable(existing)
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

    def replayed(self) -> TrainResult:
        """A replay reached `stop_at`: its checkpoint is committed (`_advance`, or the one it resumed from)."""
        path = self.run_dir / ckpt.CHECKPOINTS / ckpt.step_name(self.step)
        if self.ranks.main and self.committed_step != self.step:
            path = self.save_checkpoint()
        msg = f"replayed training to step {self.step}/{self.cfg.steps}; checkpoint `{path}`"
        return TrainResult(self.run_dir, "replayed", self.step, self.cfg.steps, msg, checkpoint=path)

    def _measure_baseline(self) -> None:
        """Measure and report the released draft's general acceptance (`measure_released`)."""
        self.released_general = rel = self.measure_released()
        tol = self.cfg.general_tolerance
        self.emit(Log(message=(
            f"released draft: general-domain matching proposals {rel['matching_proposals']:.4f} on {rel['examples']} examples "
            f"({rel['blocks']} blocks); the general-domain guard keeps checkpoints at or above "
            f"{(1.0 - tol) * rel['matching_proposals']:.4f} (`general_tolerance` {tol})"
        )))

    def _guard_stop(self) -> None:
        """`guard_patience` stops the run at this step (every rank learns it through `dist.any_true`)."""
        self.guard_stopped_at = self.step
        p = self.cfg.guard_patience
        self.emit(Log(message=f"the general-domain guard stopped the run at step {self.step}/{self.cfg.steps}: "
                              f"it rejected the last {p} validation{'s' if p > 1 else ''}"))

    def _advance(self, mf: IO[str]) -> TrainResult | None:
        """One step in the order of the module docstring; the result when a signal stops the run."""
        cfg = self.cfg
        line = self.train_step()
        last = self.step == cfg.steps
        validated = self.ranks.main and bool(self.val_split is not None and len(self.val_split)) and (
            bool(cfg.val_every and self.step % cfg.val_every == 0) or last
        )
        if validated:
            v = self.validate()
            self.val_history.append(v)
            line["val"] = {k: v[k] for k in VAL_KEYS}
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

    def finish(self) -> TrainResult:
        """Select the best checkpoint, export it and write `selection.json` (last: marks completion).

        Rank 0's work; another rank only says it is done."""
        from .export_run import export_run

        if not self.ranks.main:
            msg = f"rank {self.ranks.rank}/{self.ranks.world}: trained {self.step} steps; rank 0 selects and exports"
            return TrainResult(self.run_dir, "completed", self.step, self.cfg.steps, msg)

        best, guard = self.best(), self.guard()
        chosen = best["step"] if best else self.step
        path = self.run_dir / ckpt.CHECKPOINTS / ckpt.step_name(chosen)
        rule = ("highest validation matching proposals (mean accepted tokens per block against the "
                "teacher's continuation), earliest step on ties; the last step when nothing was validated")
        history = [{"step": v["step"], "matching_proposals": v["matching_proposals"]} for v in self.val_history]
        if guard is not None:
            rule = ("highest own-domain validation matching proposals among the checkpoints whose general-domain "
                    "matching proposals are at least (1 - tolerance) x the released draft's, earliest step on ties; "
                    "when none is, the released draft itself (step 0; `guard.passed` false)")
            for h, v in zip(history, self.val_history, strict=True):
                h["general_matching_proposals"] = (v.get("general") or {}).get("matching_proposals")
        selection = {
            "rule": rule,
            "step": chosen,
            "checkpoint": path.name,
            "checkpoint_manifest_sha256": sha256_file(path / "manifest.json"),
            "validation": best,
            "history": history,
            "total_steps": self.cfg.steps,
            **({} if guard is None else {"guard": guard}),
        }
        fmt = self.export_format
        result = export_run(self.run_dir, fmt=fmt, recipe=self.recipe, selection=selection)
        selection["export"] = {"format": fmt, "dir": result.out_dir.name, "manifest_sha256": sha256_file(result.out_dir / "manifest.json")}
        ckpt.write_json(self.run_dir / SELECTION, selection)
        for f in sorted(p for p in result.out_dir.rglob("*") if p.is_file()):
            name = f"{result.out_dir.name}/{f.relative_to(result.out_dir).as_posix()}"
            self.emit(Artifact.for_file(f.absolute(), artifact=name, kind="export", step=chosen))
        done = (f"trained {self.step} steps" if self.guard_stopped_at is None
                else f"trained {self.step} of {self.cfg.steps} steps (stopped by the general-domain guard)")
        msg = f"{done}; selected step {chosen}; exported `{result.out_dir}`"
        if guard is not None:
            msg += self._guard_note(guard)
        return TrainResult(self.run_dir, "completed", self.step, self.cfg.steps, msg, selection, result.out_dir, path)

    def _guard_note(self, guard: dict[str, Any]) -> str:
        """The guard's part of the result message; a warning event when no checkpoint passed it."""
        rejected = ", ".join(str(s) for s in guard["rejected_steps"]) or "none"
        if guard["passed"]:
            return f"; the general-domain guard rejected steps: {rejected}"
        released = self._released_checkpoint()
        self.emit(Log(level="warning", message=(
            f"no checkpoint kept general-domain matching proposals within {guard['tolerance']:.0%} of the released "
            f"draft's ({guard['released_general_matching_proposals']:.4f}); "
            + ("selected the released draft itself (step 0): the export adapts nothing" if released
               else "selected the one with the highest general acceptance instead")
            + "\nhint: lower `[train].lr`, validate earlier (`[train].val_every`), add replay rows "
            "(`prepare-data --replay-fraction`) or `[train].l2sp`"
        )))
        return "; no checkpoint passed the general-domain guard (selection.json `guard.passed` false)"

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
