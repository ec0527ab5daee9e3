"""`write_af4g64`: files MLX loads, bit-equal to the QAT forward; refusals; atomicity."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from af4g64_oracle import mx, mx_bits, np_bits

from dflash_worker.errors import ExportError
from dflash_worker.export import af4g64 as af4g64_mod
from dflash_worker.export import read_manifest, write_af4g64
from dflash_worker.manifest import sha256_file
from dflash_worker.model.quant import fake_quantize_af4g64, full_projection, selector_context

MX_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


def _draft_tensors(seed=0):
    """Named parameters of the upstream reference DFlash2 draft (tiny), randomised."""
    dflash_model = pytest.importorskip("dflash.model")
    from dflash_worker.testing.tiny import tiny_qwen3_config

    cfg = tiny_qwen3_config(
        num_hidden_layers=2, num_target_layers=4,
        dflash_config=dict(target_layer_ids=[1, 2], block_size=4, mask_token_id=3, selector_rank=64,
                           selector_top_k=4, conv_kernel_size=3, conv_group_size=16),
    )
    torch.manual_seed(seed)
    model = dflash_model.DFlash2DraftModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    return model, cfg.to_dict()


def _leftovers(parent: Path, name: str):
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_mlx_dequantized_export_equals_fake_quant_forward_bitwise(tmp_path, dtype):
    model, cfg = _draft_tensors()
    named = dict(model.named_parameters())
    names = full_projection(named).names
    out = tmp_path / "af4g64"
    res = write_af4g64(named, cfg, out, names)
    assert res.out_dir == out and set(res.quantized) == set(names)

    weights, meta = mx.load(str(out / "model.safetensors"), return_metadata=True)
    assert meta == {"format": "mlx"}
    mdt = getattr(mx, MX_DTYPES[dtype])
    for n in names:
        base = n[: -len(".weight")]
        w, s, b = weights[f"{base}.weight"], weights[f"{base}.scales"], weights[f"{base}.biases"]
        p = named[n]
        assert w.dtype == mx.uint32 and tuple(w.shape) == (p.shape[0], p.shape[1] // 8)
        assert s.dtype == mx.bfloat16 and b.dtype == mx.bfloat16 and tuple(s.shape) == (p.shape[0], p.shape[1] // 64)
        loaded = mx.dequantize(w, s, b, group_size=64, bits=4, mode="affine", dtype=mdt, stream=mx.cpu)
        ours = fake_quantize_af4g64(p.detach(), dtype)
        assert np.array_equal(mx_bits(loaded), np_bits(ours)), n
    # Everything else is BF16 (round to nearest even) of the FP32 master.
    for n, p in named.items():
        if n in names:
            continue
        assert weights[n].dtype == mx.bfloat16, n
        assert np.array_equal(mx_bits(weights[n]), np_bits(p.detach().to(torch.bfloat16))), n
    assert set(weights) == {n for n in named if n not in names} | {
        f"{n[:-7]}.{k}" for n in names for k in ("weight", "scales", "biases")}


def test_export_loads_into_mlx_quantized_linear_strictly(tmp_path):
    mnn = pytest.importorskip("mlx.nn")
    torch.manual_seed(3)
    named = {
        "fc.weight": torch.randn(64, 128) * 0.1,
        "hidden_norm.weight": torch.rand(64) + 0.5,
        "candidate_selector.hidden_projection.weight": torch.randn(32, 64) * 0.1,
    }
    write_af4g64(named, {"model_type": "test"}, tmp_path / "e", selector_context(named).names)

    class Sel(mnn.Module):
        def __init__(self):
            super().__init__()
            self.hidden_projection = mnn.Linear(64, 32, bias=False)

    class M(mnn.Module):
        def __init__(self):
            super().__init__()
            self.fc = mnn.Linear(128, 64, bias=False)
            self.hidden_norm = mnn.RMSNorm(64)
            self.candidate_selector = Sel()

    weights = mx.load(str(tmp_path / "e" / "model.safetensors"))
    cfg = json.loads((tmp_path / "e" / "config.json").read_text())
    q = cfg["quantization"]
    m = M()
    # The mlx-lm recipe: quantize exactly the layers that have `.scales` in the file.
    mnn.quantize(m, group_size=q["group_size"], bits=q["bits"], mode=q["mode"],
                 class_predicate=lambda path, _: f"{path}.scales" in weights)
    m.load_weights(list(weights.items()), strict=True)
    assert isinstance(m.fc, mnn.QuantizedLinear) and isinstance(m.candidate_selector.hidden_projection, mnn.QuantizedLinear)
    x = mx.random.normal((3, 128), key=mx.random.key(0))
    y = m.fc(x)
    ref = x @ mx.dequantize(m.fc.weight, m.fc.scales, m.fc.biases, group_size=64, bits=4).astype(mx.float32).T
    # quantized_matmul with bf16 scales returns bf16: compare within bf16 resolution.
    assert bool(mx.allclose(y.astype(mx.float32), ref, rtol=2e-2, atol=1e-2))


def test_config_manifest_and_hashes(tmp_path):
    named = {"fc.weight": torch.randn(64, 64), "norm.weight": torch.ones(64), "steps": torch.tensor([3], dtype=torch.int64)}
    cfg = {"model_type": "qwen3", "dflash_config": {"block_size": 16}}
    cfg_before = json.dumps(cfg, sort_keys=True)
    named_before = {k: v.clone() for k, v in named.items()}
    res = write_af4g64(named, cfg, tmp_path / "e", ["fc.weight"], {"recipe_fingerprint": "abc", "inputs": {"x": "1"}})
    out = tmp_path / "e"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "manifest.json", "model.safetensors"]
    written = json.loads((out / "config.json").read_text())
    assert written["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert written["dflash_config"] == {"block_size": 16}
    assert json.dumps(cfg, sort_keys=True) == cfg_before  # caller's config untouched
    for k, v in named.items():
        assert torch.equal(v, named_before[k])
    man = json.loads((out / "manifest.json").read_text())
    assert man["files"] == {"config.json": sha256_file(out / "config.json"), "model.safetensors": sha256_file(out / "model.safetensors")}
    assert man["recipe_fingerprint"] == "abc" and man["quantized"] == ["fc.weight"] and man["variant"] == "mlx_cpu"
    assert man["tensors"]["steps"]["dtype"] == "int64" and man == res.manifest
    assert read_manifest(out) == man
    # Tampering is detected.
    with open(out / "config.json", "a") as f:
        f.write(" ")
    with pytest.raises(ExportError, match="config.json.*sha256"):
        read_manifest(out)


def test_writes_are_deterministic(tmp_path):
    named = {"fc.weight": torch.randn(64, 128), "norm.weight": torch.ones(64)}
    a = write_af4g64(named, {}, tmp_path / "a", ["fc.weight"])
    b = write_af4g64(named, {}, tmp_path / "b", ["fc.weight"])
    assert a.files == b.files


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("target", ["fc.weight", "norm.weight"])
def test_non_finite_tensors_are_refused_by_name(tmp_path, bad, target):
    named = {"fc.weight": torch.randn(64, 64), "norm.weight": torch.ones(64)}
    named[target].view(-1)[5] = bad
    with pytest.raises(ExportError, match=f"tensor `{target}` has 1 non-finite"):
        write_af4g64(named, {}, tmp_path / "e", ["fc.weight"])
    assert not (tmp_path / "e").exists() and _leftovers(tmp_path, "e") == []


def test_bf16_overflow_and_scale_overflow_are_refused(tmp_path):
    with pytest.raises(ExportError, match="`norm.weight` overflows BF16"):
        write_af4g64({"norm.weight": torch.full((4,), 3.4e38)}, {}, tmp_path / "e", [])
    w = torch.tensor([3e38, -3e38] * 32).reshape(1, 64)  # range overflows float32
    with pytest.raises(ExportError, match="`fc.weight` quantizes to non-finite scales"):
        write_af4g64({"fc.weight": w}, {}, tmp_path / "e", ["fc.weight"])
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize(
    "named, names, match",
    [
        ({"fc.weight": torch.zeros(64, 64)}, ["nope.weight"], "`nope.weight` is listed for quantization but is not"),
        ({"fc.bias": torch.zeros(64, 64)}, ["fc.bias"], "only `.weight` tensors"),
        ({"fc.weight": torch.zeros(64, 96)}, ["fc.weight"], "shape `\\[64, 96\\]`.*multiple of 64"),
        ({"fc.weight": torch.zeros(64)}, ["fc.weight"], "cannot be quantized"),
        ({"fc.weight": torch.zeros(4, 64, dtype=torch.int32)}, ["fc.weight"], "cannot be quantized"),
        ({"fc.weight": torch.zeros(4, 64), "fc.scales": torch.zeros(4)}, ["fc.weight"], "`fc.scales` already exists"),
        ({"fc.weight": np.zeros((4, 64))}, [], "expected a torch.Tensor"),
    ],
)
def test_bad_requests_are_refused_before_writing(tmp_path, named, names, match):
    with pytest.raises(ExportError, match=match):
        write_af4g64(named, {}, tmp_path / "e", names)
    assert not (tmp_path / "e").exists() and _leftovers(tmp_path, "e") == []


def test_config_and_manifest_conflicts_are_refused(tmp_path):
    named = {"fc.weight": torch.zeros(4, 64)}
    with pytest.raises(ExportError, match="already declares quantization"):
        write_af4g64(named, {"quantization": {"group_size": 32, "bits": 4}}, tmp_path / "e", ["fc.weight"])
    with pytest.raises(ExportError, match="reserved key"):
        write_af4g64(named, {}, tmp_path / "e", ["fc.weight"], {"files": {}})
    with pytest.raises(ExportError, match="JSON"):
        write_af4g64(named, {"x": object()}, tmp_path / "e", ["fc.weight"])
    with pytest.raises(ExportError, match="one string"):
        write_af4g64(named, {}, tmp_path / "e", "fc.weight")
    assert not (tmp_path / "e").exists()


def test_existing_directory_is_kept_unless_overwrite(tmp_path):
    out = tmp_path / "e"
    first = write_af4g64({"fc.weight": torch.ones(4, 64)}, {}, out, ["fc.weight"])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ExportError, match="already exists"):
        write_af4g64({"fc.weight": torch.zeros(4, 64)}, {}, out, ["fc.weight"])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    second = write_af4g64({"fc.weight": torch.zeros(4, 64)}, {}, out, ["fc.weight"], overwrite=True)
    assert second.files != first.files and read_manifest(out)["files"] == second.files
    assert _leftovers(tmp_path, "e") == []


def test_crash_mid_write_leaves_nothing_and_keeps_old_export(tmp_path, monkeypatch):
    out = tmp_path / "e"
    write_af4g64({"fc.weight": torch.ones(4, 64)}, {}, out, ["fc.weight"])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_write = af4g64_mod.write_file

    def crash(path, data):
        real_write(path, data[: len(data) // 2])
        if Path(path).name == "manifest.json":
            raise OSError("disk full")

    monkeypatch.setattr(af4g64_mod, "write_file", crash)
    with pytest.raises(OSError, match="disk full"):
        write_af4g64({"fc.weight": torch.zeros(4, 64)}, {}, out, ["fc.weight"], overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert _leftovers(tmp_path, "e") == []
    with pytest.raises(OSError, match="disk full"):
        write_af4g64({"fc.weight": torch.zeros(4, 64)}, {}, tmp_path / "fresh", ["fc.weight"])
    assert not (tmp_path / "fresh").exists() and _leftovers(tmp_path, "fresh") == []


def test_tied_and_view_tensors_export(tmp_path):
    base = torch.randn(8, 64, dtype=torch.bfloat16)
    named = {"a.weight": base, "b.weight": base, "c.weight": base[2:4], "fc.weight": torch.randn(64, 64)}
    write_af4g64(named, {}, tmp_path / "e", ["fc.weight"])
    w = mx.load(str(tmp_path / "e" / "model.safetensors"))
    assert np.array_equal(mx_bits(w["c.weight"]), np_bits(base[2:4]))
    assert np.array_equal(mx_bits(w["a.weight"]), mx_bits(w["b.weight"]))


def test_read_manifest_rejects_corrupt_and_hostile_manifests(tmp_path):
    out = tmp_path / "e"
    write_af4g64({"fc.weight": torch.ones(4, 64)}, {}, out, ["fc.weight"])
    (out / "manifest.json").write_text("{not json")
    with pytest.raises(ExportError, match="cannot read"):
        read_manifest(out)
    (out / "manifest.json").write_text(json.dumps({"files": {"../x": "0" * 64}}))
    with pytest.raises(ExportError, match="outside the export"):
        read_manifest(out)
    (out / "manifest.json").write_text(json.dumps({"files": {"gone.bin": "0" * 64}}))
    with pytest.raises(ExportError, match="missing"):
        read_manifest(out)
    os.remove(out / "manifest.json")
    with pytest.raises(ExportError, match="cannot read"):
        read_manifest(out)


def test_failed_final_rename_puts_previous_export_back(tmp_path, monkeypatch):
    out = tmp_path / "e"
    write_af4g64({"fc.weight": torch.ones(4, 64)}, {}, out, ["fc.weight"])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_replace = os.replace

    def flaky(src, dst):
        if Path(src).name.startswith(".e.tmp-"):
            raise OSError("rename failed")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", flaky)  # the commit step (`export.commit`) renames
    with pytest.raises(OSError, match="rename failed"):
        write_af4g64({"fc.weight": torch.zeros(4, 64)}, {}, out, ["fc.weight"], overwrite=True)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert _leftovers(tmp_path, "e") == []
