"""Step 1 of `stream_into` (`weights.stream`): the plan, made before any tensor byte is read.

`_collect_slots` finds every destination of a module (a parameter or persistent buffer, once per
storage however many names tie it); `_plan` maps each checkpoint tensor (after `key_mapping`)
to a slot, whole or as one expert's rows of a packed MoE parameter, checks shapes and dtype
kinds and that each destination is filled exactly once, and reports what is missing, unexpected
or tied in the `LoadReport`. Any mismatch raises `CheckpointError` naming the file and tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError

KeyMapping = Mapping[str, str] | Callable[[str], str] | None

_EXPERT_KEY = re.compile(r"^(?P<prefix>.+)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


@dataclass
class LoadReport:
    """What `stream_into` did. Names are module names (after `key_mapping`)."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    tied: list[str] = field(default_factory=list)  # checkpoint copies of tied names, skipped
    mapped: list[str] = field(default_factory=list)  # loaded as copy-on-write views of the file, not copied
    bytes_read: int = 0  # tensor bytes taken from files (read or mapped)
    bytes_mapped: int = 0  # of which mapped
    files: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # checkpoint names `skip` left out, never read
    bytes_skipped: int = 0  # their tensor bytes


# --------------------------------------------------------------------------- targets


@dataclass
class _Slot:
    """One destination storage (a parameter or persistent buffer, possibly under several names)."""

    name: str  # canonical (first) name
    aliases: list[str]
    owners: list[tuple[nn.Module, str, bool]]  # (module, attribute, is_parameter)
    shape: tuple[int, ...]
    dtype: torch.dtype  # final dtype
    requires_grad: bool
    old: torch.Tensor
    new: torch.Tensor | None = None


def _collect_slots(module: nn.Module, dtype: torch.dtype | None) -> tuple[dict[str, _Slot], dict[str, _Slot]]:
    """Return (slots by canonical name, slots by any name)."""
    by_id: dict[int, _Slot] = {}
    by_name: dict[str, _Slot] = {}
    order: list[_Slot] = []

    def add(name: str, mod: nn.Module, attr: str, tensor: torch.Tensor, is_param: bool) -> None:
        slot = by_id.get(id(tensor))
        if slot is None:
            final = tensor.dtype
            if dtype is not None and tensor.is_floating_point():
                final = dtype
            slot = _Slot(
                name=name,
                aliases=[],
                owners=[],
                shape=tuple(tensor.shape),
                dtype=final,
                requires_grad=bool(getattr(tensor, "requires_grad", False)),
                old=tensor,
            )
            by_id[id(tensor)] = slot
            order.append(slot)
        else:
            slot.aliases.append(name)
        slot.owners.append((mod, attr, is_param))
        by_name[name] = slot

    for mod_name, mod in module.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for attr, p in mod._parameters.items():
            if p is not None:
                add(prefix + attr, mod, attr, p, True)
        for attr, b in mod._buffers.items():
            if b is not None and attr not in mod._non_persistent_buffers_set:
                add(prefix + attr, mod, attr, b, False)
    return {s.name: s for s in order}, by_name


def _packed_expert_slots(by_name: dict[str, _Slot]) -> dict[tuple[str, str], tuple[_Slot, int, int]]:
    """(experts prefix, proj) -> (packed slot, row start, row end) for per-expert checkpoint keys."""
    out: dict[tuple[str, str], tuple[_Slot, int, int]] = {}
    for name, slot in by_name.items():
        if name.endswith(".gate_up_proj") and len(slot.shape) == 3 and slot.shape[1] % 2 == 0:
            prefix = name[: -len(".gate_up_proj")]
            down = by_name.get(prefix + ".down_proj")
            if down is None or len(down.shape) != 3 or down.shape[0] != slot.shape[0]:
                continue
            inter = slot.shape[1] // 2
            out[(prefix, "gate_proj")] = (slot, 0, inter)
            out[(prefix, "up_proj")] = (slot, inter, 2 * inter)
            out[(prefix, "down_proj")] = (down, 0, down.shape[1])
    return out


@dataclass
class _Item:
    """Read one source tensor into `slot` (whole, or expert `expert` rows [r0, r1))."""

    key: str  # checkpoint name (before mapping)
    slot: _Slot
    expert: int | None
    r0: int
    r1: int
    part: str
    src_dtype: torch.dtype
    nbytes: int = 0
    # file sources
    file: Path | None = None
    begin: int = 0


def _map_key(key_mapping: KeyMapping, key: str) -> str:
    if key_mapping is None:
        return key
    if callable(key_mapping):
        mapped = key_mapping(key)
        return key if mapped is None else mapped
    return key_mapping.get(key, key)


def _kind(dt: torch.dtype) -> str:
    if dt == torch.bool:
        return "bool"
    if dt.is_floating_point:
        return "float"
    if dt.is_complex:
        return "complex"
    return "int"


def _plan(
    slots: dict[str, _Slot],
    by_name: dict[str, _Slot],
    entries: list[tuple[str, str, torch.dtype, tuple[int, ...], int]],
    key_mapping: KeyMapping,
    report: LoadReport,
) -> list[_Item]:
    """entries: (checkpoint key, where (file or "<mapping>"), dtype, shape, nbytes), in read order."""
    packed = _packed_expert_slots(by_name)
    present_names = {_map_key(key_mapping, e[0]) for e in entries}
    items: list[_Item] = []
    claimed: dict[tuple[int, int | None, str], str] = {}
    claimed_by_slot: dict[int, tuple[str, bool]] = {}  # slot -> (first key, was whole)
    for key, where, src_dtype, shape, nbytes in entries:
        name = _map_key(key_mapping, key)
        slot = by_name.get(name)
        expert: int | None = None
        part = "whole"
        r0 = r1 = 0
        expected_shape: tuple[int, ...]
        if slot is not None:
            if name != slot.name and slot.name in present_names:
                # a checkpoint copy of a tied alias: the canonical tensor wins
                report.tied.append(name)
                continue
            expected_shape = slot.shape
        else:
            m = _EXPERT_KEY.match(name)
            hit = packed.get((m["prefix"], m["proj"])) if m else None
            if hit is None or int(m["expert"]) >= hit[0].shape[0]:
                report.unexpected.append(name)
                continue
            slot, r0, r1 = hit
            expert = int(m["expert"])
            part = m["proj"]
            expected_shape = (r1 - r0, *slot.shape[2:])
        if tuple(shape) != expected_shape:
            raise CheckpointError(
                f"`{where}`, tensor `{key}`: shape mismatch: the model expects `{list(expected_shape)}` "
                f"for `{slot.name if expert is None else name}`, the checkpoint has `{list(shape)}`"
            )
        if _kind(src_dtype) != _kind(slot.dtype):
            raise CheckpointError(
                f"`{where}`, tensor `{key}`: dtype mismatch: the model expects `{slot.dtype}` "
                f"for `{slot.name}`, the checkpoint has `{src_dtype}`"
                + ("\nhint: quantized checkpoints cannot be loaded as training inputs" if _kind(src_dtype) == "int" else "")
            )
        # Each destination is filled once: whole, or by distinct per-expert pieces.
        claim = (id(slot), expert, part)
        first = claimed_by_slot.get(id(slot))
        if claim in claimed or (first is not None and (expert is None or first[1])):
            other = claimed.get(claim) or first[0]  # type: ignore[index]
            raise CheckpointError(
                f"`{where}`, tensor `{key}`: fills `{slot.name}` which `{other}` already fills"
                "\nhint: check `key_mapping` and packed vs per-expert tensors"
            )
        claimed[claim] = key
        claimed_by_slot.setdefault(id(slot), (key, expert is None))
        items.append(_Item(key=key, slot=slot, expert=expert, r0=r0, r1=r1, part=part, src_dtype=src_dtype, nbytes=nbytes))
    _missing(slots, items, report)
    return items


def _missing(slots: dict[str, _Slot], items: list[_Item], report: LoadReport) -> None:
    """Report the slots no item fills: no whole tensor and no piece, or per-expert pieces left out."""
    covered_whole = {id(it.slot) for it in items if it.expert is None}
    pieces: dict[int, set[tuple[int, str]]] = {}
    for it in items:
        if it.expert is not None:
            pieces.setdefault(id(it.slot), set()).add((it.expert, it.part))
    for slot in slots.values():
        if id(slot) in covered_whole:
            continue
        have = pieces.get(id(slot))
        if have is None:
            report.missing.append(slot.name)
            continue
        prefix = slot.name.rsplit(".", 1)[0]
        parts = ("gate_proj", "up_proj") if slot.name.endswith(".gate_up_proj") else ("down_proj",)
        for e in range(slot.shape[0]):
            for p in parts:
                if (e, p) not in have:
                    report.missing.append(f"{prefix}.{e}.{p}.weight")


def _list(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _dest(item: _Item) -> torch.Tensor:
    t = item.slot.new
    assert t is not None
    if item.expert is None:
        return t
    return t[item.expert, item.r0 : item.r1]


def _item_offset(item: _Item) -> int:
    """Byte offset of `item`'s destination inside its slot (rows [r0, r1) of expert `expert`, or 0)."""
    if item.expert is None:
        return 0
    shape = item.slot.shape
    row = item.slot.dtype.itemsize
    for d in shape[2:]:
        row *= d
    return (item.expert * shape[1] + item.r0) * row
