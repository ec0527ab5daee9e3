"""Parameters around training: the frozen target head, the export conversion, and swaps.

- `load_target_head` streams only the target's input embedding and ``lm_head``
  (an alias of the embedding when the target ties them) out of its
  checkpoint; training on captured features needs nothing else of the target.
- `export_values` is THE conversion from FP32 master parameters to the values
  an export holds, done on the CPU: BF16 (round to nearest even), or, for QAT
  names, the AF4G64 fake-quantized values the loader reconstructs (in BF16).
  Validation and export both call it, so validation measures exactly the
  weights export writes.
- `swapped` puts such values in place of a module's parameters for the length
  of a ``with`` block and always puts the very same ``nn.Parameter`` objects
  back (success or failure), so the optimizer never loses its FP32 masters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError
from ..weights.checkpoint import TEXT_TOWER_PREFIX

EMBED_KEY = "model.embed_tokens.weight"
HEAD_KEY = "lm_head.weight"
# A Qwen3.5 multimodal wrapper keeps the text tower's embedding here (its `lm_head` stays at the top)
WRAPPER_EMBED_KEY = TEXT_TOWER_PREFIX + "embed_tokens.weight"


class TargetHead(nn.Module):
    """The target's frozen input embedding and output head, [V, H] each."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.empty(vocab, hidden), requires_grad=False)
        self.head = nn.Parameter(torch.empty(vocab, hidden), requires_grad=False)


def load_target_head(target_dir, *, device="cpu", dtype: torch.dtype = torch.float32) -> TargetHead:
    """Stream the target's embedding and lm_head (only those bytes are read)."""
    from ..weights import list_tensors, stream_into

    entries = list_tensors(target_dir)
    embed_key = next((k for k in (EMBED_KEY, WRAPPER_EMBED_KEY) if k in entries), None)
    if embed_key is None:
        raise CheckpointError(
            f"target `{target_dir}` has no `{EMBED_KEY}` (nor `{WRAPPER_EMBED_KEY}`)"
            "\nhint: is this a Qwen3 / Qwen3.5 causal LM checkpoint?"
        )
    vocab, hidden = entries[embed_key].shape
    tied = HEAD_KEY not in entries
    with torch.device("meta"):
        module = TargetHead(vocab, hidden)
    if tied:
        del module._parameters["head"]
        module.register_parameter("head", None)
    only = {embed_key: entries[embed_key]} if tied else {embed_key: entries[embed_key], HEAD_KEY: entries[HEAD_KEY]}

    def mapping(key: str) -> str:
        return {embed_key: "embed", HEAD_KEY: "head"}.get(key, f"__unused__.{key}")

    stream_into(module, target_dir, dtype=dtype, device=device, key_mapping=mapping, strict=False)
    if tied:
        module.head = module.embed
    for name, p in module.named_parameters():
        if p.is_meta:
            raise CheckpointError(f"target `{target_dir}`: `{name}` was not loaded ({sorted(only)})")
        p.requires_grad_(False)
    return module


def export_values(
    params: Mapping[str, torch.Tensor], names: Iterable[str], *, qat_names: Iterable[str] = ()
) -> dict[str, torch.Tensor]:
    """BF16 CPU tensors an export holds for `names` (see module docstring)."""
    qat = set(qat_names)
    out: dict[str, torch.Tensor] = {}
    for name in names:
        master = params[name].detach().to("cpu", torch.float32)
        if name in qat:
            from ..model.quant import fake_quantize_af4g64

            out[name] = fake_quantize_af4g64(master, torch.bfloat16)
        else:
            out[name] = master.to(torch.bfloat16)
    return out


def _slot(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    owner_path, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    if attr not in owner._parameters:
        raise ConfigError(f"`{name}` is not a parameter of the draft")
    return owner, attr


@contextlib.contextmanager
def swapped(module: nn.Module, values: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Within the block, `module`'s parameters in `values` read those values (device/dtype of the
    parameter); the original `nn.Parameter` objects are back in their slots on exit, always."""
    slots = []
    for name in values:
        owner, attr = _slot(module, name)
        slots.append((name, owner, attr, owner._parameters[attr]))
    replacements = {
        name: values[name].to(device=p.device, dtype=p.dtype) for name, _, _, p in slots
    }
    done = []
    try:
        for name, owner, attr, p in slots:
            owner._parameters[attr] = replacements[name]  # type: ignore[assignment]
            done.append((owner, attr, p))
        yield
    finally:
        for owner, attr, p in reversed(done):
            owner._parameters[attr] = p
