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


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """The tiny Qwen3 target the drafts above fit, in torch (float32) and in mlx-lm."""
    from mlx_lm.utils import load_model as mlx_load_model

    from dflash_worker.testing.tiny import save_tiny_target

    path = tmp_path_factory.mktemp("target")
    torch_target = save_tiny_target(path, seed=5).float().eval()
    return torch_target, mlx_load_model(path)[0]


def _draft_logits(export: Path, target, ids: list[int], *, mlx_side: bool) -> np.ndarray:
    """The draft's logits for one block after the context `ids[:-1]` (features from the torch target): through
    z-lab's MLX draft as `load_draft` loads it, or through the project's torch draft of the same export."""
    from export_drafts import torch_draft

    from dflash_worker.model.draft import context_features

    torch_target, mlx_target = target
    cfg = DraftConfig.from_file(export / "config.json")
    with torch.no_grad():
        out = torch_target(torch.tensor([ids[:-1]]), output_hidden_states=True)
        features = context_features(out.hidden_states, cfg.target_layer_ids)
        block = [ids[-1]] + [cfg.mask_token_id] * (cfg.block_size - 1)
        if mlx_side:
            draft = load_draft(export).bind(mlx_target)
            return _np(draft(mx.array([block]), mx.array(features.numpy()), draft.make_cache(), logits_start=1))
        draft = torch_draft(export, float32_dequant=True)  # the arithmetic MLX's quantized layers use
        embed = torch_target.get_input_embeddings().weight
        hidden = draft.step(features, draft.embed(torch.tensor([block]), embed), draft.new_cache())[:, 1:]
        return draft.logits(hidden, torch_target.get_output_embeddings()).numpy()


IDS = [5, 17, 99, 3, 42, 42, 7, 18, 200, 11, 64, 9]  # longer than the sliding window (6): the window applies


@pytest.mark.parametrize("fmt", ["bf16", "af4g64"])
def test_mlx_draft_logits_equal_the_project_drafts(exports, target, fmt) -> None:
    """One block through both implementations of the same export: equal logits (float32, to rounding).
    AF4G64 is compared with its weights dequantized as MLX's quantized matmul does (float32 from the BF16
    scales), not as `mx.dequantize` does (BF16): the two differ in the third decimal of these logits."""
    root, _ = exports
    want = _draft_logits(root / fmt, target, IDS, mlx_side=False)
    got = _draft_logits(root / fmt, target, IDS, mlx_side=True)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * float(np.abs(want).max()))


@pytest.mark.parametrize("tensor", ["fc.weight", "layers.1.self_attn.q_proj.weight"])
def test_mlx_draft_logits_see_a_tensor_broken_in_the_export(exports, target, tensor, tmp_path) -> None:
    """The same comparison fails once one tensor of the export is changed (swapped for another's values)."""
    import shutil

    from safetensors.torch import load_file, save_file

    root, _ = exports
    broken = tmp_path / "broken"
    shutil.copytree(root / "bf16", broken)
    tensors = load_file(str(broken / "model.safetensors"))
    tensors[tensor] = tensors[tensor].flip(0).contiguous()
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    want = _draft_logits(root / "bf16", target, IDS, mlx_side=False)
    got = _draft_logits(broken, target, IDS, mlx_side=True)
    assert np.abs(got - want).max() > 1e-2 * float(np.abs(want).max())
