"""The registry of target families (Qwen3, Qwen3-MoE, Qwen3.5, Qwen3.5-MoE): the one list of their names.

A family says how to recognise a target checkpoint (``model_type``), which released DFlash2 drafts
seed it, and what its checkpoints look like (mixture of experts, hybrid linear attention, released
as a multimodal wrapper). Every other list of families or model types is read from `FAMILIES`:
the recipe's choices, the loader's model types, the wrapper model types, the tiny builders, the benches.

This module imports nothing of the package but its errors, so any layer may read it (`weights/`
included, which `families` builds on). Validating checkpoints against a family is `families`'s.

Released-draft facts: there is no model hub here, so revisions and geometry we could not check are
recorded as ``None`` with a note; validation always uses the configs actually found on disk, never
these records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import FamilyError

UNVERIFIED = "unverified: recorded without hub access; validation uses the config.json found on disk"


@dataclass(frozen=True)
class ReleasedDraft:
    """A released target + DFlash2 draft pair used as a training seed.

    Fields set to ``None`` are facts we could not verify offline.
    """

    target: str
    draft: str
    target_revision: str | None = None
    draft_revision: str | None = None
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    vocab_size: int | None = None
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    target_layer_ids: tuple[int, ...] | None = None
    block_size: int | None = None
    note: str = UNVERIFIED


@dataclass(frozen=True)
class Family:
    """A target family: recognised by ``model_type``; `moe` targets carry routed experts, `hybrid`
    ones linear-attention layers (whose recurrent state speculative decoding must roll back)."""

    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    moe: bool
    description: str
    released: tuple[ReleasedDraft, ...] = ()
    hybrid: bool = False
    shared_expert: bool = False
    # Released as a multimodal wrapper: `model_types[0]` and `architectures[0]` are the wrapper's, its
    # config.json keeps the text tower's geometry under `text_config` and its checkpoint the text weights
    # under `model.language_model.*` (`weights.checkpoint.WRAPPER_MODEL_TYPES` is read from here).
    wrapper: bool = False


_ALL = (
    Family(
        name="qwen3",
        model_types=("qwen3",),
        architectures=("Qwen3ForCausalLM",),
        moe=False,
        description="dense Qwen3 decoder",
    ),
    Family(
        name="qwen3_moe",
        model_types=("qwen3_moe",),
        architectures=("Qwen3MoeForCausalLM",),
        moe=True,
        description="Qwen3 mixture-of-experts decoder (routers and experts stay frozen)",
    ),
    Family(
        name="qwen3_5",
        model_types=("qwen3_5", "qwen3_5_text"),
        architectures=("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
        moe=False,
        hybrid=True,
        wrapper=True,
        description="dense Qwen3.5 / Qwen3.6 (Gated DeltaNet + gated attention; vision tower and MTP heads skipped)",
        released=(
            ReleasedDraft(
                target="Qwen/Qwen3.8-27B", draft="incoai/Qwen3.8-27B-DFlash2", hidden_size=5120, num_hidden_layers=64,
                vocab_size=248320, target_layer_ids=(1, 16, 31, 46, 61),
                note=UNVERIFIED + "; geometry as published for the dense 27B line (5 draft layers, taps 1,16,31,46,61)",
            ),
        ),
    ),
    Family(
        name="qwen3_5_moe",
        model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
        architectures=("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
        moe=True,
        hybrid=True,
        wrapper=True,
        shared_expert=True,
        description="Qwen3.5 / Qwen3.6 mixture of experts (routed + shared expert, frozen; vision tower and MTP heads skipped)",
        released=(
            ReleasedDraft(
                target="Qwen/Qwen3.6-35B-A3B", draft="incoai/Qwen3.6-35B-A3B-DFlash2", hidden_size=2048,
                num_hidden_layers=40, vocab_size=248320, num_experts=256, num_experts_per_tok=8,
                note=UNVERIFIED + "; geometry as published (6 draft layers, 8 taps of 40)",
            ),
        ),
    ),
)
# name -> family, in the order above (the order every derived list keeps)
FAMILIES: dict[str, Family] = {fam.name: fam for fam in _ALL}
# every `model_type` a target's config.json may carry (what the loader builds)
MODEL_TYPES: tuple[str, ...] = tuple(t for fam in _ALL for t in fam.model_types)
# the multimodal wrappers' `model_type`s (`weights.checkpoint.text_config` reads their `text_config`)
WRAPPER_MODEL_TYPES: tuple[str, ...] = tuple(fam.model_types[0] for fam in _ALL if fam.wrapper)


def get_family(name: str) -> Family:
    """The family called `name`; `FamilyError` naming the known ones otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise FamilyError(f"unknown target family `{name}`\nhint: known families: {', '.join(FAMILIES)}") from None


def detect_family(config: dict[str, Any], *, where: str = "config.json") -> Family:
    """The family of a target from its config.json contents."""
    mt = config.get("model_type")
    for fam in FAMILIES.values():
        if mt in fam.model_types:
            return fam
    raise FamilyError(
        f"`{where}`: field `model_type`: `{mt}` is not a supported target family"
        f"\nhint: supported: {', '.join(MODEL_TYPES)}"
    )


__all__ = ["FAMILIES", "MODEL_TYPES", "UNVERIFIED", "WRAPPER_MODEL_TYPES", "Family", "ReleasedDraft", "detect_family", "get_family"]
