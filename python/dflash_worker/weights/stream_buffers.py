"""Step 5 of `stream_into` (`weights.stream`): non-persistent buffers.

Non-persistent buffers (rotary ``inv_freq``) are not in checkpoints; built on the meta device
they hold no values. `_nonpersistent_plan` checks, before anything is read, that each one can
be recomputed (a `reset_buffers()` method, or a transformers rotary embedding);
`_recompute_nonpersistent` gives them their values on the final device after the load.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import CheckpointError


def _qual(mod_name: str, attr: str) -> str:
    return f"{mod_name}.{attr}" if mod_name else attr


def _is_rotary(mod: nn.Module) -> bool:
    return "RotaryEmbedding" in type(mod).__name__ and hasattr(mod, "rope_type") and hasattr(mod, "config")


def _nonpersistent_plan(module: nn.Module) -> list[tuple[str, nn.Module, list[str]]]:
    """Modules whose non-persistent buffers are on meta, checked to be recomputable before anything is read."""
    plan = []
    for mod_name, mod in module.named_modules():
        meta = [
            a for a, b in mod._buffers.items() if b is not None and a in mod._non_persistent_buffers_set and b.is_meta
        ]
        if not meta:
            continue
        if callable(getattr(mod, "reset_buffers", None)):
            pass
        elif _is_rotary(mod) and set(meta) <= {"inv_freq", "original_inv_freq"}:
            pass
        else:
            full = ", ".join(f"`{_qual(mod_name, a)}`" for a in meta)
            raise CheckpointError(
                f"non-persistent buffer(s) {full} were built on the meta device and are not in checkpoints"
                "\nhint: build that submodule outside the meta context, or give it a `reset_buffers()` method"
            )
        plan.append((mod_name, mod, meta))
    return plan


def _recompute_nonpersistent(module: nn.Module, plan: list[tuple[str, nn.Module, list[str]]], device: torch.device) -> None:
    """Give non-persistent buffers their real values (they are not in checkpoints); move real ones to `device`."""
    for _, mod in module.named_modules():
        for a, b in list(mod._buffers.items()):
            if b is not None and a in mod._non_persistent_buffers_set and not b.is_meta:
                mod._buffers[a] = b.to(device)
    for _, mod, meta in plan:
        for a in meta:
            b = mod._buffers[a]
            mod._buffers[a] = torch.empty(b.shape, dtype=b.dtype, device=device)
        if callable(getattr(mod, "reset_buffers", None)):
            mod.reset_buffers()
            continue
        # Rotary embeddings: the rope function the module's own __init__ uses
        # (as transformers' loader does), computed on the CPU like there.
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        fn = getattr(mod, "compute_default_rope_parameters", None) if mod.rope_type == "default" else None
        fn = fn or ROPE_INIT_FUNCTIONS[mod.rope_type]
        inv_freq, _ = fn(mod.config)
        with torch.no_grad():
            for a in meta:
                mod._buffers[a].copy_(inv_freq)
