"""What a training run trains with, loaded once from the typed recipe: `TrainSetup.load`.

The draft as FP32 masters, the target's embedding and head, which tensors train (`select_tensors`:
`[train].scope`, plus what QAT or an AF4G64 export quantizes), the loss weights (`loss_weights`),
AdamW (fused where torch has it) with its schedule, and the captured data: the train split, the val
split with its own and general rows (`general_val_rows`), and, for `[train].replay_kd`, the train
split's replay rows (`replay_train_rows`).

Features (`[train].features`): `cache` reads each sequence's target features from the capture;
`online` (the capture holds token ids only) loads the frozen target in `TrainSetup.load` and
computes them as each sequence is read (`data.CapturedSplit`, through `capture.teacher.Teacher`,
the component capture calls), so the rest of the step is the same code either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .. import dist
from ..errors import ConfigError
from ..recipe import Recipe, TrainConfig
from .data import CapturedSplit, Order
from .objectives import position_weights
from .params import TargetHead, load_target_head
from .schedule import lr_factor
from .scopes import includes_selector, scope_names

if TYPE_CHECKING:
    from ..capture.teacher import Teacher
    from ..device import DeviceChoice
    from ..model import DraftModel


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
    """The `LossWeights` of `[train]` on `model`; refuses a selector weight the draft cannot use, or nothing to train."""
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


def autocast_dtype(mode: str, device: torch.device) -> torch.dtype | None:
    """The forward's autocast dtype for `[train].autocast` on `device`; None: full FP32."""
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


def fused_adamw(device: torch.device) -> bool | None:
    """Fused AdamW (one kernel per tensor) where torch has it: the per-tensor loop of ~12 small
    ops per parameter costs several times more, most of all on shared CPU cores."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return True if device.type in _get_fused_kernels_supported_devices() else None


def check_prepared_data(recipe: Recipe) -> None:
    """check-data before any weights load (a failure names file and line)."""
    from ..data import check_data, load_tokenizer

    cap = recipe.require("capture")
    report = check_data(
        recipe.data.dir,
        load_tokenizer(recipe.model.target),
        thinking=recipe.data.thinking,
        train_turns=recipe.data.train_turns,
        max_length=recipe.data.max_length,
        regenerate=cap.regenerate,
        splits=tuple(s for s in ("train", "val") if s in cap.splits),
    )
    # examples over max_length were skipped or truncated by the capture (its manifest's
    # `overlong`), or refused by it; training reads the capture, so they are no failure here
    report.raise_if_failed(overlong="skip")


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
            params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, eps=1e-8, fused=fused_adamw(device)
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda s: lr_factor(s, total=cfg.steps, warmup=cfg.warmup_steps, kind=cfg.schedule, min_ratio=cfg.min_lr_ratio),
        )
        teacher = _online_teacher(recipe, device)
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
        if cfg.interpolate == "auto" and not val_general:
            raise ConfigError(
                f"`[train].interpolate = \"auto\"` searches weights the general-domain guard keeps, but the capture "
                f"`{cap.output}` holds no general-domain val rows in `val` (`data.replay.val_ids`)"
                "\nhint: prepare the data with `prepare-data --replay GENERAL.jsonl --replay-val-fraction 0.1` and capture "
                "again, or set `interpolate = \"off\"`"
            )
        replay_rows = replay_train_rows(train_split) if cfg.replay_kd > 0 else frozenset()
        return cls(
            device=device, model=model, head=head, tensors=tensors, params=params, weights=weights,
            autocast=autocast_dtype(cfg.autocast, device), optimizer=optimizer, scheduler=scheduler,
            train_split=train_split, val_split=val_split, order=Order(len(train_split), cfg.seed),
            val_own=val_own, val_general=val_general,
            start=[p.detach().clone() for p in params] if cfg.l2sp > 0 or cfg.replay_kd > 0 else None, teacher=teacher,
            replay_rows=replay_rows,
        )


def _online_teacher(recipe: Recipe, device: torch.device) -> Teacher | None:
    """`[train].features = "online"`: the frozen target that computes each sequence's features; else None."""
    if recipe.require("train").features != "online":
        return None
    from ..capture.teacher import Teacher
    from ..model.io import read_target_layer_ids

    # the capture's dtype and the one component capture calls (`capture.teacher`), so the
    # features equal the cache's on the same kind of device
    cap = recipe.require("capture")
    return Teacher.load(recipe.model.target, read_target_layer_ids(recipe.model.draft), device=str(device), dtype=cap.dtype,
                        chunk_tokens=cap.chunk_tokens)


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
