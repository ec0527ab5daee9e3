"""Target families (Qwen3, Qwen3-MoE, Qwen3.5, Qwen3.5-MoE) and target/draft pair validation.

The registry itself (`FAMILIES`, `Family`, the released drafts, `get_family`, `detect_family`) is
`family_registry`, re-exported here; this module checks checkpoints against it: that a target is of a
supported family and not quantized, with complete experts, that a draft is self-consistent, and that a
pair agrees. Loading a target is `dflash_worker.weights.load_model`, whatever its family.

Validation reads only ``config.json`` files and safetensors headers, never
tensor data, so it is cheap enough to run before any download finishes
loading. Problems are collected and raised together as one `FamilyError`
whose lines each name the field at fault.

Qwen3.5 targets (``qwen3_5`` dense, ``qwen3_5_moe``; Qwen3.6 checkpoints share
both types) are released as a multimodal wrapper: their geometry is read from
``text_config`` and their text weights from ``model.language_model.*``. The
text-only configs (``qwen3_5_text``, ``qwen3_5_moe_text``) are the same families.
Their text towers are hybrid: Gated DeltaNet linear-attention layers, with a
gated full-attention layer every 4th layer.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import FamilyError
from .family_registry import FAMILIES, UNVERIFIED, Family, ReleasedDraft, detect_family, get_family
from .weights.checkpoint import TEXT_TOWER_PREFIX, TensorEntry, is_skipped_tensor, list_tensors, read_config_json, text_config
from .weights.header import INTEGER_DTYPES

# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Problem:
    field: str
    message: str

    def __str__(self) -> str:
        return f"field `{self.field}`: {self.message}"


@dataclass
class CheckpointInfo:
    """config.json and tensor headers of a checkpoint directory."""

    path: Path
    config: dict[str, Any]
    tensors: dict[str, TensorEntry]

    @property
    def config_path(self) -> Path:
        return (self.path if self.path.is_dir() else self.path.parent) / "config.json"


def read_checkpoint_info(path: str | os.PathLike[str], *, need_config: bool = True) -> CheckpointInfo:
    """Read config.json (if present or needed) and every shard header of `path`."""
    p = Path(path)
    tensors = list_tensors(p)
    cfg_file = (p if p.is_dir() else p.parent) / "config.json"
    config: dict[str, Any] = {}
    if need_config or cfg_file.is_file():
        config = read_config_json(p)
    return CheckpointInfo(path=p, config=config, tensors=tensors)


def draft_value(config: dict[str, Any], name: str, default: Any = None) -> Any:
    """A draft config field: `dflash_config` first, then the top level."""
    dc = config.get("dflash_config")
    if isinstance(dc, dict) and name in dc:
        return dc[name]
    return config.get(name, default)


def is_draft(info: CheckpointInfo) -> bool:
    cfg = info.config
    return isinstance(cfg.get("dflash_config"), dict) or (
        "fc.weight" in info.tensors and any(n.startswith("candidate_selector.") for n in info.tensors)
    ) or any("DFlash" in str(a) for a in cfg.get("architectures") or [])


def _num_experts(cfg: dict[str, Any]) -> int | None:
    for key in ("num_experts", "num_local_experts"):
        if cfg.get(key) is not None:
            return cfg[key]
    return None


def _as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


_QUANT_SUFFIXES = (".scales", ".biases", ".qweight", ".qzeros", ".g_idx", ".weight_scale", ".weight_scale_inv", ".input_scale")


def quantization_problems(info: CheckpointInfo, role: str) -> list[Problem]:
    """Quantized inputs cannot be trained against: config, packed integer or fp8 weights, scale tensors."""
    out: list[Problem] = []
    if "quantization_config" in info.config:
        qc = info.config["quantization_config"]
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        out.append(
            Problem(
                "quantization_config",
                f"{role} `{info.config_path}` is quantized" + (f" (`{method}`)" if method else "")
                + "; training needs unquantized (BF16/FP32) weights",
            )
        )
    for name, t in info.tensors.items():
        if name.endswith(_QUANT_SUFFIXES):
            out.append(Problem(name, f"{role} tensor `{name}` in `{t.file}` is a quantization tensor"))
            break
    for name, t in info.tensors.items():
        if name.endswith(".weight") and (t.dtype in INTEGER_DTYPES or t.dtype.startswith("F8_")):
            out.append(
                Problem(name, f"{role} weight `{name}` in `{t.file}` is `{t.dtype}` (packed or quantized weights)")
            )
            break
    return out


# --------------------------------------------------------------------------- targets


@dataclass
class TargetReport:
    family: str
    hidden_size: int | None
    num_hidden_layers: int | None
    vocab_size: int | None
    num_experts: int | None
    num_experts_per_tok: int | None
    expert_storage: str | None  # "packed", "per-expert", "mixed" or None (dense)
    # What a target load reads: the text tower. A Qwen3.5 checkpoint's vision tower and MTP heads
    # are skipped unread (`weights.checkpoint.is_skipped_tensor`), so they are counted apart and
    # are no part of the teacher's memory.
    tensors: int
    bytes: int
    skipped_tensors: int = 0
    skipped_bytes: int = 0


def _moe_layers(cfg: dict[str, Any]) -> list[int]:
    n_layers = _as_int(cfg.get("num_hidden_layers")) or 0
    n_exp = _num_experts(cfg) or 0
    step = _as_int(cfg.get("decoder_sparse_step")) or 1
    only = set(cfg.get("mlp_only_layers") or [])
    return [l for l in range(n_layers) if l not in only and n_exp > 0 and (l + 1) % step == 0]


def _layers_prefix(info: CheckpointInfo) -> str:
    """Where the decoder layers' tensors live: under a wrapper's text tower, or at `model.layers`."""
    return f"{TEXT_TOWER_PREFIX}layers" if any(n.startswith(TEXT_TOWER_PREFIX) for n in info.tensors) else "model.layers"


def target_problems(info: CheckpointInfo) -> tuple[Family | None, list[Problem], str | None]:
    try:
        fam = detect_family(info.config, where=str(info.config_path))
    except FamilyError as exc:
        return None, [Problem("model_type", str(exc).split(": ", 1)[-1])], None
    cfg = text_config(info.config)
    probs: list[Problem] = quantization_problems(info, "target")
    for key in ("hidden_size", "num_hidden_layers", "vocab_size"):
        v = _as_int(cfg.get(key))
        if v is None or v <= 0:
            probs.append(Problem(key, f"target config `{info.config_path}` has no valid `{key}` (found `{cfg.get(key)}`)"))
    storage = None
    if fam.moe:
        n_exp = _num_experts(cfg)
        k = _as_int(cfg.get("num_experts_per_tok"))
        if not _as_int(n_exp) or n_exp <= 0:
            probs.append(Problem("num_experts", f"MoE target config `{info.config_path}` has no valid `num_experts`"))
            return fam, probs, None
        if k is None or not 0 < k <= n_exp:
            probs.append(Problem("num_experts_per_tok", f"`{cfg.get('num_experts_per_tok')}` is not in 1..`{n_exp}`"))
        missing: list[str] = []
        kinds: set[str] = set()
        names = info.tensors
        layers = _layers_prefix(info)
        for l in _moe_layers(cfg):
            base = f"{layers}.{l}.mlp"
            if f"{base}.gate.weight" not in names:
                missing.append(f"{base}.gate.weight")
            if fam.shared_expert:
                shared = [f"{base}.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
                missing += [k for k in (*shared, f"{base}.shared_expert_gate.weight") if k not in names]
            packed = [f"{base}.experts.gate_up_proj", f"{base}.experts.down_proj"]
            if all(p in names for p in packed):
                kinds.add("packed")
                for p in packed:
                    if names[p].shape[:1] != (n_exp,):
                        probs.append(Problem(p, f"packed experts tensor `{p}` has shape `{list(names[p].shape)}`, expected `{n_exp}` experts"))
                continue
            kinds.add("per-expert")
            for e in range(n_exp):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    key = f"{base}.experts.{e}.{proj}.weight"
                    if key not in names:
                        missing.append(key)
        if missing:
            probs.append(
                Problem(
                    "experts",
                    f"MoE target checkpoint `{info.path}` lacks expert weights: `{missing[0]}`"
                    + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""),
                )
            )
        storage = "mixed" if len(kinds) > 1 else (kinds.pop() if kinds else None)
    return fam, probs, storage


def validate_target(path: str | os.PathLike[str]) -> TargetReport:
    """Check a target checkpoint (config.json + headers): supported family, not quantized, experts complete."""
    info = read_checkpoint_info(path)
    fam, probs, storage = target_problems(info)
    _raise(probs, f"target `{info.path}`")
    assert fam is not None
    return _target_report(info, fam, storage)


def _target_report(info: CheckpointInfo, fam: Family, storage: str | None) -> TargetReport:
    cfg = text_config(info.config)
    skipped = [t for n, t in info.tensors.items() if is_skipped_tensor(info.config, n)]
    return TargetReport(
        family=fam.name,
        hidden_size=cfg.get("hidden_size"),
        num_hidden_layers=cfg.get("num_hidden_layers"),
        vocab_size=cfg.get("vocab_size"),
        num_experts=_num_experts(cfg) if fam.moe else None,
        num_experts_per_tok=cfg.get("num_experts_per_tok") if fam.moe else None,
        expert_storage=storage,
        tensors=len(info.tensors) - len(skipped),
        bytes=sum(t.nbytes for t in info.tensors.values()) - sum(t.nbytes for t in skipped),
        skipped_tensors=len(skipped),
        skipped_bytes=sum(t.nbytes for t in skipped),
    )


# --------------------------------------------------------------------------- drafts

_LAYER = re.compile(r"^layers\.(\d+)\.")


def _strip_model_prefix(tensors: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    # Some exporters prefix draft tensors with `model.`; the DFlash2 layout has none.
    if tensors and all(n.startswith("model.") for n in tensors):
        return {n[len("model.") :]: t for n, t in tensors.items()}
    return tensors


@dataclass
class DraftGeometry:
    hidden_size: int | None
    vocab_size: int | None
    num_hidden_layers: int | None
    target_layer_ids: list[int] | None
    block_size: int | None
    mask_token_id: int | None
    selector_rank: int | None
    selector_top_k: int | None
    conv_kernel_size: int | None
    conv_group_size: int | None
    num_experts: int | None
    num_experts_per_tok: int | None


def draft_geometry(info: CheckpointInfo) -> DraftGeometry:
    c = info.config
    ids = draft_value(c, "target_layer_ids")
    ne = draft_value(c, "num_experts")
    if ne is None:
        ne = draft_value(c, "num_local_experts")
    return DraftGeometry(
        hidden_size=c.get("hidden_size"),
        vocab_size=c.get("vocab_size"),
        num_hidden_layers=c.get("num_hidden_layers"),
        target_layer_ids=list(ids) if isinstance(ids, list) else ids,
        block_size=draft_value(c, "block_size"),
        mask_token_id=draft_value(c, "mask_token_id"),
        selector_rank=draft_value(c, "selector_rank"),
        selector_top_k=draft_value(c, "selector_top_k"),
        conv_kernel_size=draft_value(c, "conv_kernel_size"),
        conv_group_size=draft_value(c, "conv_group_size"),
        num_experts=ne,
        num_experts_per_tok=draft_value(c, "num_experts_per_tok"),
    )


# Architecture names upstream `save_pretrained` writes (as in `model.config.ARCHITECTURES`;
# repeated here so that header-only checks never import torch).
_DRAFT_ARCHITECTURES = {"DFlash2DraftModel": "dflash2", "DFlashDraftModel": "dflash"}
_SELECTOR_FIELDS = ("selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size")


def draft_kind(info: CheckpointInfo) -> str:
    """`dflash2` or `dflash` (v1), by the rule `DraftConfig` uses: `architectures` first, then
    whether the config sets every DFlash2 field."""
    archs = info.config.get("architectures") or []
    for arch in ("DFlash2DraftModel", "DFlashDraftModel"):
        if arch in archs:
            return _DRAFT_ARCHITECTURES[arch]
    if all(draft_value(info.config, name) is not None for name in _SELECTOR_FIELDS):
        return "dflash2"
    return "dflash"


def draft_problems(info: CheckpointInfo) -> list[Problem]:
    """Self-consistency of a DFlash2 or DFlash (v1) draft (config vs tensor shapes), without a target.

    A v1 draft has no candidate selector and no convolutions; one that carries them anyway is refused,
    since the model would silently ignore trained tensors."""
    probs = quantization_problems(info, "draft")
    g = draft_geometry(info)
    t = _strip_model_prefix(info.tensors)
    if draft_kind(info) == "dflash":
        extra = sorted(n for n in t if n.startswith("candidate_selector.") or "_conv." in n)
        if extra:
            probs.append(
                Problem(
                    extra[0],
                    f"draft config `{info.config_path}` is a DFlash (v1) draft but the checkpoint holds DFlash2 tensors "
                    f"(`{extra[0]}` and {len(extra) - 1} more)\nhint: set `architectures` to `[\"DFlash2DraftModel\"]` "
                    "and the `dflash_config` selector and convolution fields",
                )
            )
        return probs + _backbone_problems(info, g, t)
    return probs + _backbone_problems(info, g, t) + _dflash2_problems(info, g, t)


def _backbone_problems(info: CheckpointInfo, g: DraftGeometry, t: dict[str, TensorEntry]) -> list[Problem]:
    """What DFlash and DFlash2 drafts share: hidden size, taps, the context projection, the layer count."""
    probs: list[Problem] = []
    H = _as_int(g.hidden_size)
    if H is None or H <= 0:
        probs.append(Problem("hidden_size", f"draft config `{info.config_path}` has no valid `hidden_size` (found `{g.hidden_size}`)"))
    ids = g.target_layer_ids
    if not (isinstance(ids, list) and ids and all(_as_int(i) is not None for i in ids)):
        probs.append(Problem("target_layer_ids", f"draft config must list integer `target_layer_ids`, found `{ids}`"))
        ids = None
    fc = t.get("fc.weight")
    if fc is None:
        probs.append(Problem("fc.weight", f"draft checkpoint `{info.path}` has no `fc.weight`"))
    elif H is not None and ids is not None:
        if len(fc.shape) != 2 or fc.shape[1] != len(ids) * H:
            probs.append(
                Problem(
                    "fc.weight",
                    f"`fc.weight` has shape `{list(fc.shape)}`: input width must be len(target_layer_ids) x hidden_size "
                    f"= `{len(ids)}` x `{H}` = `{len(ids) * H}`",
                )
            )
        elif fc.shape[0] != H:
            probs.append(Problem("fc.weight", f"`fc.weight` has shape `{list(fc.shape)}`: output width must be hidden_size `{H}`"))
    n_layers = _as_int(g.num_hidden_layers)
    if n_layers is not None:
        seen = {int(m.group(1)) for n in t if (m := _LAYER.match(n))}
        if seen and seen != set(range(n_layers)):
            probs.append(Problem("num_hidden_layers", f"config says `{n_layers}` draft layers, checkpoint has layers `{sorted(seen)}`"))
    return probs


def _dflash2_problems(info: CheckpointInfo, g: DraftGeometry, t: dict[str, TensorEntry]) -> list[Problem]:
    """The candidate selector's and the convolutions' shapes."""
    probs: list[Problem] = []
    H = _as_int(g.hidden_size)
    r = _as_int(g.selector_rank)
    V = _as_int(g.vocab_size)
    for cb in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"):
        e = t.get(cb) or t.get(cb + ".weight")
        if e is None:
            probs.append(Problem(cb, f"draft checkpoint `{info.path}` has no `{cb}`"))
            continue
        if len(e.shape) != 2 or (r is not None and e.shape[1] != r) or (V is not None and e.shape[0] != V):
            probs.append(Problem(cb, f"`{cb}` has shape `{list(e.shape)}`, expected [vocab_size `{V}`, selector_rank `{r}`]"))
    hp = t.get("candidate_selector.hidden_projection.weight")
    if hp is None:
        probs.append(Problem("candidate_selector.hidden_projection.weight", f"draft checkpoint `{info.path}` has no selector hidden projection"))
    elif H is not None and (len(hp.shape) != 2 or hp.shape[1] != H or (r is not None and hp.shape[0] != r)):
        probs.append(
            Problem(
                "candidate_selector.hidden_projection.weight",
                f"shape `{list(hp.shape)}`, expected [selector_rank `{r}`, hidden_size `{H}`]",
            )
        )
    k = _as_int(g.conv_kernel_size)
    for name, e in t.items():
        if name.endswith("_conv.base_kernel") and H is not None:
            if len(e.shape) != 3 or e.shape[0] != 2 or e.shape[2] != H or (k is not None and e.shape[1] != k):
                probs.append(Problem(name, f"`{name}` has shape `{list(e.shape)}`, expected [2, conv_kernel_size `{k}`, hidden_size `{H}`]"))
                break
    return probs


# --------------------------------------------------------------------------- pairs


@dataclass
class PairReport:
    family: str
    target: TargetReport
    draft: DraftGeometry
    notes: list[str] = field(default_factory=list)


def pair_problems(target: CheckpointInfo, draft: CheckpointInfo) -> tuple[Family | None, list[Problem], str | None]:
    fam, probs, storage = target_problems(target)
    probs = probs + draft_problems(draft)
    tc = text_config(target.config)
    g = draft_geometry(draft)
    tH = _as_int(tc.get("hidden_size"))
    tL = _as_int(tc.get("num_hidden_layers"))
    tV = _as_int(tc.get("vocab_size"))
    if g.hidden_size is not None and tH is not None and g.hidden_size != tH:
        probs.append(Problem("hidden_size", f"draft hidden_size `{g.hidden_size}` != target hidden_size `{tH}`"))
    if g.vocab_size is not None and tV is not None and g.vocab_size != tV:
        probs.append(Problem("vocab_size", f"draft vocab_size `{g.vocab_size}` != target vocab_size `{tV}`"))
    ids = g.target_layer_ids
    if isinstance(ids, list) and tL is not None:
        bad = [i for i in ids if _as_int(i) is not None and not 0 <= i < tL]
        if bad:
            probs.append(
                Problem("target_layer_ids", f"`{bad}` out of range: the target has `{tL}` layers (valid ids 0..{tL - 1})")
            )
    mask = g.mask_token_id
    if mask is None:
        probs.append(Problem("mask_token_id", "draft config has no `mask_token_id`"))
    elif _as_int(mask) is None or (tV is not None and not 0 <= mask < tV):
        probs.append(Problem("mask_token_id", f"`{mask}` is outside the target vocabulary (0..{(tV or 0) - 1})"))
    # Routing geometry: a draft that records experts must match the target's.
    t_exp = _num_experts(tc) if fam is not None and fam.moe else None
    t_k = tc.get("num_experts_per_tok") if fam is not None and fam.moe else None
    if g.num_experts is not None and g.num_experts != t_exp:
        probs.append(Problem("num_experts", f"draft records `{g.num_experts}` experts, target has `{t_exp}`"))
    if g.num_experts_per_tok is not None and g.num_experts_per_tok != t_k:
        probs.append(Problem("num_experts_per_tok", f"draft records top-`{g.num_experts_per_tok}` routing, target has `{t_k}`"))
    return fam, probs, storage


def validate_pair(target: str | os.PathLike[str], draft: str | os.PathLike[str]) -> PairReport:
    """Check that `draft` can be trained against `target` (config.json + headers only); raises `FamilyError`."""
    ti = read_checkpoint_info(target)
    di = read_checkpoint_info(draft)
    fam, probs, storage = pair_problems(ti, di)
    _raise(probs, f"target `{ti.path}` and draft `{di.path}` do not fit")
    assert fam is not None
    return PairReport(family=fam.name, target=_target_report(ti, fam, storage), draft=draft_geometry(di))


def check_recipe_pair(target: str | os.PathLike[str], draft: str | os.PathLike[str], family: str) -> PairReport:
    """`validate_pair`, plus the recipe's declared `[model].family` must be the target's family.

    Capture, preflight and training call this before any weights load."""
    report = validate_pair(target, draft)
    if report.family != family:
        raise FamilyError(
            f"recipe says `[model].family = \"{family}\"` but target `{target}` is a `{report.family}` checkpoint\n"
            f"hint: set `family = \"{report.family}\"` in the recipe's `[model]` section"
        )
    return report


def _raise(probs: list[Problem], what: str) -> None:
    if not probs:
        return
    lines = "\n".join(f"  {p}" for p in probs)
    raise FamilyError(f"{what}: {probs[0]}" + (f"\nall problems ({len(probs)}):\n{lines}" if len(probs) > 1 else ""))


__all__ = [
    "FAMILIES",
    "UNVERIFIED",
    "check_recipe_pair",
    "DraftGeometry",
    "Family",
    "PairReport",
    "Problem",
    "ReleasedDraft",
    "TargetReport",
    "detect_family",
    "draft_geometry",
    "draft_kind",
    "draft_problems",
    "get_family",
    "is_draft",
    "pair_problems",
    "quantization_problems",
    "read_checkpoint_info",
    "target_problems",
    "validate_pair",
    "validate_target",
]
