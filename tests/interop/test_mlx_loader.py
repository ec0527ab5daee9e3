"""`dflash_worker.serving.mlx.load_draft` on exports written by the project's own writers (no training needed).

The loaded MLX weights are the file's (BF16 as stored; AF4G64 dequantized by MLX equal to the project's
`dequantize_af4g64`); what cannot be applied is refused with the file and tensor named; and nothing in
`dflash_worker` imports MLX unless `serving.mlx` is imported.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx import nn

from dflash_worker.errors import CheckpointError, ConfigError
from dflash_worker.export import write_af4g64
from dflash_worker.model import DraftConfig, build_draft, save_draft
from dflash_worker.model import load_draft as load_torch_draft
from dflash_worker.model.quant import dequantize_af4g64, full_projection
from dflash_worker.serving.mlx import load_draft
from dflash_worker.testing.tiny import tiny_qwen3_config
from dflash_worker.testing.tiny_draft import tiny_dflash2_config, tiny_dflash_config


def _np(a) -> np.ndarray:
    return np.array(a.astype(mx.float32))


@pytest.fixture(scope="module", params=["dflash2", "dflash"])
def exports(request, tmp_path_factory):
    """A tiny draft saved in BF16 (the released layout) and exported as AF4G64 (every projection) from its FP32 weights."""
    root = tmp_path_factory.mktemp(request.param)
    make = tiny_dflash2_config if request.param == "dflash2" else tiny_dflash_config
    cfg = make(tiny_qwen3_config())
    draft = build_draft(DraftConfig.from_dict(cfg), seed=3)
    save_draft(draft, root / "bf16", dtype=torch.bfloat16)
    tensors = dict(draft.named_parameters())
    names = list(full_projection(draft).names)
    write_af4g64({k: v.detach() for k, v in tensors.items()}, json.loads((root / "bf16" / "config.json").read_text()),
                 root / "af4g64", names)
    return root, names


def test_bf16_export_loads_with_the_stored_values(exports) -> None:
    from mlx.utils import tree_flatten

    root, _ = exports
    model = load_draft(root / "bf16")
    want = {k: v.float().numpy() for k, v in load_torch_draft(root / "bf16").state_dict().items()}
    got = dict(tree_flatten(model.parameters()))
    for name, value in want.items():
        key = name + ".weight" if name.endswith("_codebook") else name
        assert np.array_equal(_np(got[key]), value), name


def test_af4g64_export_quantizes_the_modules_that_have_scales(exports) -> None:
    from safetensors.torch import load_file

    root, names = exports
    model = load_draft(root / "af4g64")
    stored = load_file(str(root / "af4g64" / "model.safetensors"))
    modules = dict(model.named_modules())
    for name in names:
        base = name.removesuffix(".weight")
        layer = modules[base]
        assert isinstance(layer, nn.QuantizedLinear) and (layer.group_size, layer.bits) == (64, 4), base
        got = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=64, bits=4)
        want = dequantize_af4g64(stored[f"{base}.weight"], stored[f"{base}.scales"], stored[f"{base}.biases"], dtype=torch.float32)
        assert np.array_equal(_np(got), want.numpy()), base
    assert not any(isinstance(m, nn.QuantizedLinear) for p, m in modules.items() if f"{p}.weight" not in names)


def _edit_config(export: Path, **quantization) -> None:
    cfg = json.loads((export / "config.json").read_text())
    if quantization.get("drop"):
        cfg.pop("quantization")
    else:
        cfg["quantization"].update(quantization)
    (export / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("edit", "error", "named"),
    [
        ({"drop": True}, CheckpointError, "has no `quantization` block"),
        ({"group_size": 32}, CheckpointError, "group_size `32`"),
        ({"bits": 8}, CheckpointError, "bits `8`"),
        ({"mode": "mxfp4"}, ConfigError, "`quantization.mode` `mxfp4`"),
        ({"group_size": "64"}, ConfigError, "`quantization.group_size`"),
    ],
)
def test_af4g64_config_that_disagrees_with_its_tensors_is_refused(exports, edit, error, named, tmp_path) -> None:
    import shutil

    root, _ = exports
    export = tmp_path / "e"
    shutil.copytree(root / "af4g64", export)
    _edit_config(export, **edit)
    with pytest.raises(error, match=re.escape(named)) as info:
        load_draft(export)
    assert str(export) in str(info.value)


def test_quantization_block_without_quantized_tensors_is_refused(exports, tmp_path) -> None:
    import shutil

    root, _ = exports
    export = tmp_path / "e"
    shutil.copytree(root / "bf16", export)
    cfg = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps({**cfg, "quantization": {"group_size": 64, "bits": 4, "mode": "affine"}}))
    with pytest.raises(CheckpointError, match="no tensor .* has `.scales`"):
        load_draft(export)


def test_dflash_worker_imports_no_mlx_unless_serving_mlx_is_imported() -> None:
    code = (
        "import importlib, pkgutil, sys, dflash_worker\n"
        "for m in pkgutil.walk_packages(dflash_worker.__path__, 'dflash_worker.'):\n"
        "    if m.name != 'dflash_worker.serving.mlx' and not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in ('mlx', 'mlx_lm', 'dflash')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
