"""Which implementation runs each Gated DeltaNet function of a hybrid target: logged once, recorded in manifests.

Why: a hybrid target (Qwen3.5, Qwen3.5-MoE) runs four functions per linear-attention layer, module
globals of transformers' modeling module (`modeling_qwen3_5`, `modeling_qwen3_5_moe`):
`torch_chunk_gated_delta_rule` and `torch_recurrent_gated_delta_rule` (the recurrence, chunked for
blocks and token by token), `causal_conv1d_fn` and `causal_conv1d_update` (the short convolution
before it). transformers 5.24 decorates each with `use_kernel_func_from_hub_with_fallback`, which
picks, when the modeling module is imported, in this order:

1. a hub kernel: only with the `kernels` package installed (transformers 5.24 accepts 0.18.2 to
   0.19; PyPI's newest was 0.17.2 when this was written), whose decorator makes each function an
   `nn.Module` singleton, and only once the model is `kernelize`d (`from_pretrained(use_kernels=True)`;
   dflash-worker never asks for it), which binds the hub layer's `forward` on that singleton;
2. the original package: `flash-linear-attention` (imported as `fla`: `chunk_gated_delta_rule`,
   `fused_recurrent_gated_delta_rule`) and `causal-conv1d` (`causal_conv1d_fn`, `causal_conv1d_update`),
   when importable;
3. the torch reference in the modeling module itself: correct on every device, much slower.

Speed, numerics and the recurrent-state rollback (`evaluate.rollback`) all depend on which one
runs, and transformers only says so in a warning printed at the first call. So every command that
builds a hybrid target logs one line per modeling module (`log_target_kernels`, called by
`weights.loader.build_meta_model`), and `device.provenance()` records the same under
`linear_attention_kernels` in every manifest that carries device provenance (capture, evaluate,
preflight). The line reads, with nothing fast installed:

    linear-attention kernels (qwen3_5): chunk_gated_delta_rule=torch reference, ...

and with `flash-linear-attention` installed, ``chunk_gated_delta_rule=flash-linear-attention 0.6.0
(fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule)``: the distribution, its version and the
function that runs. The description is read off the objects transformers dispatches through (the
decorator's closure, the `kernels` singleton's bound `forward`), not re-derived from what is
installed, so it names what actually runs.

transformers hands every device's tensors to an importable package, and `fla`'s Triton kernels
take GPU tensors only (on the CPU a forward dies in Triton: "0 active drivers"): `check_device`,
called by `weights.load_model` before a byte is read, refuses such a target off CUDA by name.
"""

from __future__ import annotations

import logging
import sys
from importlib import metadata
from types import ModuleType
from typing import Any

log = logging.getLogger("dflash_worker.kernels")

# module global of the modeling module -> the kernel name transformers registers it under
FUNCTIONS = {
    "torch_chunk_gated_delta_rule": "chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule",
    "causal_conv1d_fn": "causal_conv1d_fn",
    "causal_conv1d_update": "causal_conv1d_update",
}
REFERENCE = "torch reference"
# import name -> PyPI distribution, where they differ
_DISTRIBUTIONS = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d"}

_loaded: list[str] = []  # names of the modeling modules whose hybrid targets this process built
_logged: set[str] = set()  # lines already logged


def modeling_modules(model: Any) -> list[ModuleType]:
    """The python modules defining `model`'s Gated DeltaNet layers (empty for a target without any)."""
    homes: list[ModuleType] = []
    for m in model.modules():
        if type(m).__name__.endswith("GatedDeltaNet"):
            home = sys.modules.get(type(m).__module__)
            if home is not None and home not in homes:
                homes.append(home)
    return homes


def selection(home: ModuleType) -> dict[str, str]:
    """What each of the four functions of modeling module `home` runs now: kernel name -> description."""
    return {kernel: describe(getattr(home, name, None)) for name, kernel in FUNCTIONS.items()}


def describe(fn: Any) -> str:
    """`REFERENCE`, ``<distribution> <version> (<module>.<function>)``, ``hub kernel <module>.<class>``, or
    what `fn` is when transformers' dispatch is not recognised (``missing``, ``unrecognised ...``)."""
    import torch

    if fn is None:
        return "missing"
    if isinstance(fn, torch.nn.Module) and hasattr(type(fn), "kernel_layer_name"):
        # `kernels`' function-as-layer: `kernelize` binds the chosen layer's forward on the singleton
        bound = getattr(vars(fn).get("forward"), "__func__", None)
        if bound is not None and bound is not type(fn).forward:
            return f"hub kernel {_qualname(bound)}"
        inner = _closure(type(fn).forward).get("func")  # not kernelized: the decorated function runs
        return describe(inner) if inner is not None else f"unrecognised {_qualname(type(fn))}"
    cells = _closure(fn)
    implementation, reference = cells.get("implementation"), cells.get("torch_function")
    if implementation is None or reference is None:
        return f"unrecognised {_qualname(fn)}"
    if implementation is reference:
        return REFERENCE
    root = str(getattr(implementation, "__module__", "") or "").split(".")[0]
    dist = _DISTRIBUTIONS.get(root, root)
    return f"{dist} {_version(dist, root)} ({_qualname(implementation)})"


def target_kernels(model: Any) -> dict[str, dict[str, str]] | None:
    """`selection` of each of `model`'s modeling modules, keyed by family (``qwen3_5``), or None
    for a target without Gated DeltaNet layers."""
    homes = modeling_modules(model)
    return {_family(h): selection(h) for h in homes} or None


def log_target_kernels(model: Any) -> dict[str, dict[str, str]] | None:
    """Log `model`'s kernel selection (once per distinct line in this process) and remember its
    modeling modules for `loaded_kernels`; returns `target_kernels(model)`."""
    found = target_kernels(model)
    for home in modeling_modules(model):
        if home.__name__ not in _loaded:
            _loaded.append(home.__name__)
    for family, chosen in (found or {}).items():
        line = format_line(family, chosen)
        if line not in _logged:
            _logged.add(line)
            log.info(line)
    return found


def check_device(model: Any, device: Any) -> None:
    """Refuse a hybrid target on a device its dispatched packages cannot run on.

    transformers hands every device's tensors to an importable `fla` / `causal_conv1d`, whose
    Triton and CUDA kernels take GPU tensors only: on the CPU the first forward dies inside Triton
    ("0 active drivers"), on MPS likewise. Raised here instead, naming the package and the way out."""
    from ..errors import DeviceError

    kind = str(device).split(":")[0]
    if kind == "cuda":
        return
    for family, chosen in (target_kernels(model) or {}).items():
        packaged = sorted({v.split(" (")[0] for v in chosen.values() if v.split(" ")[0] in _DISTRIBUTIONS.values()})
        if packaged:
            raise DeviceError(
                f"the `{family}` target is on `{device}`, but transformers dispatches its Gated DeltaNet layers to "
                f"{', '.join(f'`{p}`' for p in packaged)}, whose kernels run on CUDA only\n"
                "hint: run on a CUDA device, or use an environment without those packages (requirements/cuda.txt "
                "is for the CUDA image alone)"
            )


def loaded_kernels() -> dict[str, dict[str, str]]:
    """The current `selection` of every modeling module a hybrid target was built from in this process
    (empty when none was): what `device.provenance()` records as `linear_attention_kernels`."""
    homes = [sys.modules[name] for name in _loaded if name in sys.modules]
    return {_family(h): selection(h) for h in homes}


def format_line(family: str, chosen: dict[str, str]) -> str:
    """The log line: ``linear-attention kernels (<family>): <kernel>=<description>, ...``."""
    return f"linear-attention kernels ({family}): " + ", ".join(f"{k}={v}" for k, v in chosen.items())


def _family(home: ModuleType) -> str:
    # transformers.models.<family>.modeling_<family>
    parts = home.__name__.split(".")
    return parts[-2] if len(parts) >= 2 else home.__name__


def _closure(fn: Any) -> dict[str, Any]:
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    out = {}
    for name, cell in zip(code.co_freevars, cells):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # an empty cell
            pass
    return out


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _version(dist: str, root: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return str(getattr(sys.modules.get(root), "__version__", "unknown version"))
