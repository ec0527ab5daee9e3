"""Typed configuration of a DFlash / DFlash2 draft.

A released draft ships a Qwen3-style ``config.json`` whose draft-specific
fields (``target_layer_ids``, ``block_size``, ``mask_token_id``,
``selector_rank``, ...) live in a ``dflash_config`` sub-dictionary or, in older
files, at the top level. :class:`DraftConfig` reads ``dflash_config`` first and
the top level second, resolves geometry defaults exactly the way a
transformers ``Qwen3Config`` would (so ours and the upstream reference agree
on what a file means), validates everything, and keeps the original dict so a
saved draft round-trips.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError

DFLASH = "dflash"
DFLASH2 = "dflash2"
KINDS = (DFLASH, DFLASH2)

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# Architecture names written by upstream `save_pretrained`; used to tell v1 from v2.
ARCHITECTURES = {DFLASH: "DFlashDraftModel", DFLASH2: "DFlash2DraftModel"}

# Fields that belong in `dflash_config` when we build or save a config.
DRAFT_FIELDS = (
    "target_layer_ids",
    "block_size",
    "mask_token_id",
    "selector_rank",
    "selector_top_k",
    "conv_kernel_size",
    "conv_group_size",
    "input_embedding_scale",
    "output_multiplier",
)

_DFLASH2_REQUIRED = ("selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Spread `num_draft_layers` feature taps evenly over target layers 1 .. L-3.

    This is the rule released drafts were trained with when their config names
    no explicit `target_layer_ids`.
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    step = (last - first) / (num_draft_layers - 1)
    return [round(first + i * step) for i in range(num_draft_layers)]


def _lookup(raw: dict[str, Any], name: str, default: Any = None) -> Any:
    sub = raw.get("dflash_config") or {}
    if name in sub:
        return sub[name]
    return raw.get(name, default)


@dataclass(frozen=True, kw_only=True)
class DraftConfig:
    """Everything needed to build a draft; validated on construction.

    Geometry follows the Qwen3 decoder layer. `layer_types[i]` is
    ``full_attention`` (bidirectional inside a block) or ``sliding_attention``
    (causal, limited to `sliding_window` positions when that is set).
    """

    kind: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    hidden_act: str = "silu"
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    is_causal: bool | None = None
    target_layer_ids: tuple[int, ...] = ()
    num_target_layers: int | None = None
    block_size: int = 16
    mask_token_id: int = 0
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    # The config.json dict this was parsed from (rope parameters, token ids,
    # anything we do not interpret); written back by `to_dict`.
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    source: str = field(default="<dict>", compare=False, repr=False)

    def __post_init__(self) -> None:
        src = self.source

        def bad(msg: str, hint: str | None = None) -> ConfigError:
            text = f"{src}: {msg}"
            if hint:
                text += f"\nhint: {hint}"
            return ConfigError(text)

        if self.kind not in KINDS:
            raise bad(f"unknown draft kind `{self.kind}`", f"use one of {', '.join(KINDS)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise bad(f"`{name}` must be a positive integer, found `{value!r}`")
        if self.num_heads % self.num_kv_heads:
            raise bad(f"`num_attention_heads` `{self.num_heads}` is not a multiple of `num_key_value_heads` `{self.num_kv_heads}`")
        if len(self.layer_types) != self.num_layers:
            raise bad(f"`layer_types` has `{len(self.layer_types)}` entries for `{self.num_layers}` layers")
        for i, lt in enumerate(self.layer_types):
            if lt not in (FULL_ATTENTION, SLIDING_ATTENTION):
                raise bad(f"`layer_types[{i}]` is `{lt}`", f"use `{FULL_ATTENTION}` or `{SLIDING_ATTENTION}`")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise bad(f"`sliding_window` must be a positive integer, found `{self.sliding_window!r}`")
        if not self.target_layer_ids:
            raise bad("`target_layer_ids` is empty", "set `dflash_config.target_layer_ids` or `num_target_layers`")
        for lid in self.target_layer_ids:
            if not isinstance(lid, int) or isinstance(lid, bool) or lid < 0:
                raise bad(f"`target_layer_ids` entry `{lid!r}` is not a non-negative integer")
            if self.num_target_layers is not None and lid >= self.num_target_layers:
                raise bad(f"`target_layer_ids` entry `{lid}` is out of range for `num_target_layers` `{self.num_target_layers}`")
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise bad(f"`block_size` must be an integer >= 2, found `{self.block_size!r}`")
        if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < self.vocab_size:
            raise bad(f"`mask_token_id` `{self.mask_token_id!r}` is outside the vocabulary `[0, {self.vocab_size})`")
        if self.final_logit_softcapping is not None and self.final_logit_softcapping < 0:
            raise bad(f"`final_logit_softcapping` must be >= 0, found `{self.final_logit_softcapping}`")
        if self.kind == DFLASH2:
            for name in _DFLASH2_REQUIRED:
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                    raise bad(f"dflash2 draft needs a positive integer `{name}`, found `{value!r}`", f"set `dflash_config.{name}`")
            if self.hidden_size % self.conv_group_size:
                raise bad(f"`hidden_size` `{self.hidden_size}` is not a multiple of `conv_group_size` `{self.conv_group_size}`")
            if self.selector_top_k > self.vocab_size:
                raise bad(f"`selector_top_k` `{self.selector_top_k}` exceeds `vocab_size` `{self.vocab_size}`")

    # ------------------------------------------------------------------ derived
    @property
    def num_context_layers(self) -> int:
        return len(self.target_layer_ids)

    @property
    def context_width(self) -> int:
        """Width of the concatenated target features fed to `fc`: n * H."""
        return self.num_context_layers * self.hidden_size

    def layer_is_causal(self, index: int) -> bool:
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self.layer_types[index] == SLIDING_ATTENTION

    def layer_window(self, index: int) -> int | None:
        return self.sliding_window if self.layer_types[index] == SLIDING_ATTENTION else None

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "<dict>", kind: str | None = None) -> DraftConfig:
        """Parse a draft `config.json` dict (never mutated)."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: draft config must be a JSON object, found `{type(raw).__name__}`")
        raw = copy.deepcopy(raw)
        sub = raw.get("dflash_config")
        if sub is not None and not isinstance(sub, dict):
            raise ConfigError(f"{source}: `dflash_config` must be an object, found `{type(sub).__name__}`")
        hf = _qwen3_view(raw, source)
        if kind is None:
            kind = _detect_kind(raw)
        num_layers = hf.num_hidden_layers
        layer_types = tuple(hf.layer_types or [FULL_ATTENTION] * num_layers)
        num_target_layers = raw.get("num_target_layers")
        tli = _lookup(raw, "target_layer_ids")
        if tli is None:
            if num_target_layers is None:
                raise ConfigError(
                    f"{source}: neither `target_layer_ids` nor `num_target_layers` is set\n"
                    "hint: set `dflash_config.target_layer_ids` to the target layers whose outputs feed the draft"
                )
            tli = default_target_layer_ids(int(num_target_layers), num_layers)
        if not isinstance(tli, (list, tuple)):
            raise ConfigError(f"{source}: `target_layer_ids` must be a list, found `{tli!r}`")
        mask = _lookup(raw, "mask_token_id")
        if mask is None:
            raise ConfigError(f"{source}: `mask_token_id` is not set\nhint: set `dflash_config.mask_token_id`")
        softcap = _lookup(raw, "final_logit_softcapping")

        def opt_int(name: str) -> int | None:
            v = _lookup(raw, name)
            return None if v is None else _as_int(v, name, source)

        try:
            return cls(
                kind=kind,
                vocab_size=hf.vocab_size,
                hidden_size=hf.hidden_size,
                intermediate_size=hf.intermediate_size,
                num_layers=num_layers,
                num_heads=hf.num_attention_heads,
                num_kv_heads=hf.num_key_value_heads,
                head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
                rms_norm_eps=float(hf.rms_norm_eps),
                attention_bias=bool(hf.attention_bias),
                hidden_act=str(hf.hidden_act),
                layer_types=layer_types,
                sliding_window=hf.sliding_window,
                is_causal=raw.get("is_causal"),
                target_layer_ids=tuple(_as_int(x, "target_layer_ids", source) for x in tli),
                num_target_layers=None if num_target_layers is None else _as_int(num_target_layers, "num_target_layers", source),
                block_size=_as_int(_lookup(raw, "block_size", 16), "block_size", source),
                mask_token_id=_as_int(mask, "mask_token_id", source),
                input_embedding_scale=float(_lookup(raw, "input_embedding_scale", 1.0)),
                output_multiplier=float(_lookup(raw, "output_multiplier", 1.0)),
                final_logit_softcapping=None if softcap is None or float(softcap) <= 0 else float(softcap),
                selector_rank=opt_int("selector_rank"),
                selector_top_k=opt_int("selector_top_k"),
                conv_kernel_size=opt_int("conv_kernel_size"),
                conv_group_size=opt_int("conv_group_size"),
                raw=raw,
                source=source,
            )
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"{source}: invalid draft config: {exc}") from exc

    @classmethod
    def from_file(cls, path: str | Path) -> DraftConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"draft config `{path}` does not exist") from None
        except OSError as exc:
            raise ConfigError(f"cannot read draft config `{path}`: {exc}") from exc
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from exc
        return cls.from_dict(raw, source=str(path))

    # ------------------------------------------------------------------ output
    def hf_config(self):
        """The transformers `Qwen3Config` view of this draft (rotary setup, reference models)."""
        return _qwen3_view(self.to_dict(), self.source)

    def to_dict(self) -> dict[str, Any]:
        """A `config.json` dict in the released upstream layout (draft fields under `dflash_config`)."""
        out = copy.deepcopy(self.raw)
        sub = dict(out.get("dflash_config") or {})
        for name in DRAFT_FIELDS:
            out.pop(name, None)
        sub["target_layer_ids"] = list(self.target_layer_ids)
        sub["block_size"] = self.block_size
        sub["mask_token_id"] = self.mask_token_id
        for name in ("input_embedding_scale", "output_multiplier"):
            value = getattr(self, name)
            if value != 1.0 or name in sub:
                sub[name] = value
            else:
                sub.pop(name, None)
        for name in _DFLASH2_REQUIRED:
            value = getattr(self, name)
            if value is not None:
                sub[name] = value
            else:
                sub.pop(name, None)
        out["dflash_config"] = sub
        out.update(
            architectures=[ARCHITECTURES[self.kind]],
            model_type="qwen3",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            attention_bias=self.attention_bias,
            hidden_act=self.hidden_act,
            layer_types=list(self.layer_types),
        )
        if self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
            out["use_sliding_window"] = True
        # Softcapping in both places: vLLM and SGLang read it only inside `dflash_config`, older readers at the top.
        if self.final_logit_softcapping is not None:
            out["final_logit_softcapping"] = sub["final_logit_softcapping"] = self.final_logit_softcapping
        else:
            out.pop("final_logit_softcapping", None)
            sub.pop("final_logit_softcapping", None)
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        return out


def _as_int(value: Any, name: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ConfigError(f"{source}: `{name}` must be an integer, found `{value!r}`")
    return int(value)


def _detect_kind(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if ARCHITECTURES[DFLASH2] in archs:
        return DFLASH2
    if ARCHITECTURES[DFLASH] in archs:
        return DFLASH
    # No architecture recorded: the DFlash2 modules are defined by these fields.
    if all(_lookup(raw, name) is not None for name in _DFLASH2_REQUIRED):
        return DFLASH2
    return DFLASH


def _qwen3_view(raw: dict[str, Any], source: str):
    """Interpret geometry with transformers' own Qwen3 defaults (head_dim, layer_types, rope)."""
    from transformers import Qwen3Config

    kwargs = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "transformers_version", "auto_map")}
    try:
        return Qwen3Config(**kwargs)
    except Exception as exc:  # strict dataclass validation raises several types
        raise ConfigError(f"{source}: invalid draft config: {exc}") from exc
