"""The project's torch draft of an export directory (BF16 or AF4G64), for the MLX interop tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def torch_draft(export: Path, *, float32_dequant: bool = False):
    """The export as the project's torch draft (float32): BF16 as `evaluate` loads it; AF4G64 with every
    quantized weight dequantized from the file's bytes by `model.quant.dequantize_af4g64`: by default as
    `mx.dequantize` and evaluate's fake quantization do (each weight rounded to BF16), with
    `float32_dequant` as MLX's quantized matmul does on CPU (`q * scale + bias` in float32 from the BF16
    scales, measured: equal to `x @ dequantize(float32 scales).T` bit for bit)."""
    from safetensors.torch import load_file

    from dflash_worker.model import DraftConfig, DraftModel
    from dflash_worker.model import load_draft as load_torch_draft
    from dflash_worker.model.quant import dequantize_af4g64

    if not json.loads((export / "config.json").read_text()).get("quantization"):
        return load_torch_draft(export, dtype=torch.float32)
    stored = load_file(str(export / "model.safetensors"))
    state = {}
    for name, t in stored.items():
        base = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")):
            continue
        if f"{base}.scales" in stored:
            scales, biases = stored[f"{base}.scales"], stored[f"{base}.biases"]
            if float32_dequant:
                scales, biases = scales.float(), biases.float()
            t = dequantize_af4g64(t, scales, biases, dtype=torch.float32)
        state[name] = t.float()
    model = DraftModel(DraftConfig.from_file(export / "config.json"))
    model.load_state_dict(state, strict=True)
    return model.float().eval()
