"""Load a target model (Qwen3, Qwen3-MoE, Qwen3.5, Qwen3.5-MoE) from a local checkpoint by streaming.

The model is built from ``config.json`` on the meta device (no memory, no
random init), then `stream_into` fills it shard by shard. The result equals
``AutoModelForCausalLM.from_pretrained`` tensor for tensor, without ever holding
a state dict.

Qwen3.5 checkpoints are released as the multimodal wrapper
(``Qwen3_5ForConditionalGeneration``): the target is its text tower alone,
built as transformers' text-only ``Qwen3_5ForCausalLM`` /
``Qwen3_5MoeForCausalLM`` from ``text_config`` (the class transformers' own
``from_pretrained`` gives for such a file). ``model.language_model.*`` maps to
``model.*``; the vision tower (``model.visual.*``) and the multi-token
prediction heads (``mtp.*``) are skipped by name, so their bytes are never
read; the load report counts them.

On the CPU, tensors stored in the model's dtype are copy-on-write views of the
mapped shards (``mmap=True``, the default there): a frozen teacher costs no
copy, and every process loading it shares one set of page-cache pages. Pass
``mmap=False`` for private copies (needed if the checkpoint may be rewritten in
place while the model lives). Other devices and dtype conversions always copy.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..family_registry import MODEL_TYPES
from .checkpoint import (
    TEXT_TOWER_PREFIX,
    _config_dir,
    is_skipped_tensor,
    is_wrapper_config,
    read_config_json,
    resolve_checkpoint,
    skips_outside_text_tower,
)
from .dtypes import TORCH_DTYPES
from .linear_kernels import check_device, log_target_kernels
from .stream import LoadReport, ProgressFn, Source, stream_into

# model_type values this loader knows how to fill: every registered family's
SUPPORTED_MODEL_TYPES = MODEL_TYPES

_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """`None`, a torch dtype, or a name (`bfloat16`, `bf16`, `float32`, ...) -> torch dtype or None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).removeprefix("torch.")
    if key in _DTYPE_NAMES:
        return _DTYPE_NAMES[key]
    raise CheckpointError(f"unsupported dtype `{dtype}`\nhint: use one of {', '.join(sorted(_DTYPE_NAMES))}")


def build_meta_model(path: str | os.PathLike[str], dtype: torch.dtype | None):
    """The transformers model for `path`'s config.json, on the meta device, in `dtype` (or the config's).

    A hybrid target logs which implementation each Gated DeltaNet function runs (`linear_kernels`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = read_config_json(path)
    cfg_path = _config_dir(Path(path)) / "config.json"
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"`{cfg_path}`: model_type `{model_type}` is not a supported target"
            f"\nhint: supported target families: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if "quantization_config" in raw:
        raise CheckpointError(
            f"`{cfg_path}`: quantized checkpoint (`quantization_config` present) cannot be a training target"
            "\nhint: use the BF16 release of the target model"
        )
    try:
        config = AutoConfig.from_pretrained(str(_config_dir(Path(path))), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise CheckpointError(f"`{cfg_path}`: invalid config: {exc}") from None
    if is_wrapper_config(raw):
        config = config.text_config  # the text tower alone, as `Qwen3_5ForCausalLM.from_pretrained` builds it
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    log_target_kernels(model)  # hybrid targets: which Gated DeltaNet kernels run, once per process
    return model


def checkpoint_key_mapping(raw_config: dict):
    """(key_mapping, skip) for `stream_into` on a target with config.json contents `raw_config`.

    Qwen3.5 families: the wrapper's ``model.language_model.*`` is the text model's ``model.*``
    (a text-only file already uses ``model.*``), and the vision tower and MTP heads are
    skipped unread. Other families: (None, None).
    """
    if not skips_outside_text_tower(raw_config):
        return None, None

    def key_mapping(key: str) -> str:
        return "model." + key[len(TEXT_TOWER_PREFIX) :] if key.startswith(TEXT_TOWER_PREFIX) else key

    def skip(key: str) -> bool:
        return is_skipped_tensor(raw_config, key)

    return key_mapping, skip


def _auto_dtype(raw_config: dict, checkpoint: Path | None) -> torch.dtype:
    """What `from_pretrained(dtype="auto")` picks: config dtype, else the checkpoint's first floating dtype."""
    name = raw_config.get("dtype") or raw_config.get("torch_dtype")
    sub = raw_config.get("text_config")
    if not name and is_wrapper_config(raw_config) and isinstance(sub, dict):
        name = sub.get("dtype") or sub.get("torch_dtype")
    if isinstance(name, str):
        try:
            found = parse_dtype(name)
        except CheckpointError:
            found = None
        if found is not None:
            return found
    if checkpoint is not None:
        for h in resolve_checkpoint(checkpoint).shards:
            for info in h.tensors.values():
                dt = TORCH_DTYPES[info.dtype]
                if dt.is_floating_point:
                    return dt
    return torch.get_default_dtype()


def load_model(
    path: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    source: Source | None = None,
    progress: ProgressFn | None = None,
    mmap: bool | None = None,
):
    """Load the target model at `path` by streaming; returns it in eval mode (a wrapper: its text tower).

    `path`: checkpoint directory (with config.json), or a ``.safetensors`` file
    next to its config.json. `dtype`: floating-point dtype of the result;
    ``None`` follows ``config.json`` like ``from_pretrained(dtype="auto")``.
    `source`: read tensors from here instead of `path` (e.g. an in-memory
    mapping, which is not modified); the config still comes from `path`.
    `mmap`: map instead of copying what can be (see the module docstring);
    ``None`` means yes on the CPU.
    """
    path = Path(path)
    raw = read_config_json(path)
    want = parse_dtype(dtype)
    if want is None:
        ckpt = path if source is None else (None if isinstance(source, Mapping) else Path(source))
        want = _auto_dtype(raw, ckpt)
    model = build_meta_model(path, want)
    check_device(model, device)  # before reading a byte: fast kernels installed for another device
    if mmap is None:
        mmap = str(device).split(":")[0] == "cpu"
    key_mapping, skip = checkpoint_key_mapping(raw)
    report: LoadReport = stream_into(
        model, path if source is None else source, dtype=None, device=device, progress=progress, mmap=mmap,
        key_mapping=key_mapping, skip=skip,
    )
    model.eval()
    model.load_report = report  # type: ignore[attr-defined]
    return model


def check_model_checkpoint(path: str | os.PathLike[str]) -> LoadReport:
    """Check a target checkpoint against the model its config.json describes, reading headers only.

    Raises `CheckpointError` on missing or unexpected keys and on shape or dtype
    mismatches, exactly as `load_model` would, without reading tensor data.
    """
    path = Path(path)
    model = build_meta_model(path, None)
    key_mapping, skip = checkpoint_key_mapping(read_config_json(path))
    return stream_into(model, path, dtype=None, dry_run=True, key_mapping=key_mapping, skip=skip)
