"""Fake quantization (straight-through) and the swap/restore helper used by QAT,
validation and export; plus the quantization scope selectors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from af4g64_oracle import mx, mx_bits, np_bits, to_mx
from torch import nn

from dflash_worker.errors import ConfigError
from dflash_worker.model.quant import (
    SCOPES,
    dequantize_af4g64,
    fake_quantize_af4g64,
    full_projection,
    never_quantized,
    quantize_af4g64,
    quantized_weights,
    selector_context,
)


def _w(seed=0, shape=(96, 192)):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.05)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_fake_quantize_forward_is_loader_reconstruction(dtype):
    w = _w()
    out = fake_quantize_af4g64(w, dtype)
    assert out.dtype == dtype
    q, s, b = quantize_af4g64(w)
    assert torch.equal(out.view(torch.uint8), dequantize_af4g64(q, s, b, dtype).view(torch.uint8))
    mdt = {torch.bfloat16: mx.bfloat16, torch.float32: mx.float32, torch.float16: mx.float16}[dtype]
    ref = mx.dequantize(to_mx(q), to_mx(s), to_mx(b), group_size=64, bits=4, dtype=mdt, stream=mx.cpu)
    assert np.array_equal(np_bits(out), mx_bits(ref))
    # Not the identity: quantization really changed the weights.
    assert not torch.equal(out.float(), w)


def test_fake_quantize_gradient_is_straight_through():
    w = _w(1).requires_grad_(True)
    out = fake_quantize_af4g64(w, torch.bfloat16)
    upstream = torch.from_numpy(np.random.default_rng(2).standard_normal(w.shape).astype(np.float32)).to(torch.bfloat16)
    out.backward(upstream)
    assert w.grad.dtype == torch.float32
    assert torch.equal(w.grad, upstream.float())

    # out_dtype: bf16 values in an fp32 tensor, fp32 gradient passed through bit for bit.
    w3 = _w(1).requires_grad_(True)
    out3 = fake_quantize_af4g64(w3, torch.bfloat16, out_dtype=torch.float32)
    assert out3.dtype == torch.float32 and torch.equal(out3, out.detach().float())
    g3 = torch.randn(w3.shape, generator=torch.Generator().manual_seed(7))
    out3.backward(g3)
    assert torch.equal(w3.grad, g3)

    w2 = _w(1).requires_grad_(True)
    g32 = torch.randn(w2.shape, generator=torch.Generator().manual_seed(3))
    fake_quantize_af4g64(w2, torch.float32).backward(g32)
    assert torch.equal(w2.grad, g32)


def test_fake_quantize_does_not_touch_master():
    w = _w(4)
    before = w.clone()
    fake_quantize_af4g64(w)
    assert torch.equal(w.view(torch.int32), before.view(torch.int32))


class _Tiny(nn.Module):
    """Names shaped like a draft's: a context fc, an MLP, a conv, a selector, norms."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(128, 64, bias=False)
        self.hidden_norm = nn.LayerNorm(64)
        self.mlp = nn.ModuleDict(
            {"up_proj": nn.Linear(64, 128, bias=True), "down_proj": nn.Linear(128, 64, bias=False)}
        )
        self.conv = nn.Module()
        self.conv.base_kernel = nn.Parameter(torch.randn(2, 3, 64))
        self.conv.kernel_projection = nn.Linear(64, 12, bias=False)
        self.candidate_selector = nn.Module()
        self.candidate_selector.predecessor_codebook = nn.Embedding(32, 64)
        self.candidate_selector.hidden_projection = nn.Linear(64, 64, bias=False)
        self.odd = nn.Linear(48, 64, bias=False)  # in-features not a multiple of 64

    def forward(self, ctx):
        h = self.hidden_norm(self.fc(ctx))
        h = h + self.mlp["down_proj"](torch.relu(self.mlp["up_proj"](h)))
        return self.candidate_selector.hidden_projection(h) + self.conv.kernel_projection(h).sum(-1, keepdim=True)


def _snapshot(model):
    return [(n, p, p.detach().clone()) for n, p in model.named_parameters()]


def _assert_restored(model, snap, opt):
    now = list(model.named_parameters())
    assert [n for n, _ in now] == [n for n, _, _ in snap]
    for (n, p), (_, p0, v0) in zip(now, snap):
        assert p is p0, f"{n} is a different object after restore"
        assert type(p) is nn.Parameter
        assert torch.equal(p.detach().view(torch.uint8), v0.view(torch.uint8)), f"{n} changed"
    flat = [q for g in opt.param_groups for q in g["params"]]
    assert [id(q) for q in flat] == [id(p) for _, p, _ in snap]


def test_swap_restores_identity_after_exception_midway():
    torch.manual_seed(0)
    model = _Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    snap = _snapshot(model)
    names = full_projection(model).names
    x = torch.randn(3, 128)
    with pytest.raises(RuntimeError, match="boom"):
        with quantized_weights(model, names) as swapped:
            assert set(swapped) == set(names)
            assert not isinstance(model.fc.weight, nn.Parameter)
            model(x).sum().backward()
            raise RuntimeError("boom")
    _assert_restored(model, snap, opt)


def test_swap_values_forward_and_straight_through_grads():
    torch.manual_seed(1)
    model = _Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = selector_context(model).names
    assert set(names) == {"fc.weight", "candidate_selector.hidden_projection.weight"}
    x = torch.randn(5, 128)
    fc_master = model.fc.weight
    with quantized_weights(model, names, dtype=torch.bfloat16) as swapped:
        # The module now reads the loader's reconstruction (bf16 values, fp32 dtype).
        assert model.fc.weight is swapped["fc.weight"]
        assert model.fc.weight.dtype == torch.float32
        expect = fake_quantize_af4g64(fc_master.detach(), torch.bfloat16).float()
        assert torch.equal(model.fc.weight, expect)
        out_fc = model.fc(x)
        assert torch.equal(out_fc, x @ expect.t())
        out_fc.sum().backward()
    # STE: d(sum(x W^T))/dW = ones^T x, landing on the FP32 master.
    assert fc_master.grad is not None
    # Bitwise: the gradient is not rounded through bf16 on its way back.
    assert torch.equal(fc_master.grad, torch.ones(5, 64).t() @ x)
    before = fc_master.detach().clone()
    opt.step()
    assert model.fc.weight is fc_master and not torch.equal(fc_master.detach(), before)


def test_swap_then_switch_scope_keeps_same_objects():
    torch.manual_seed(2)
    model = _Tiny()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    snap = _snapshot(model)
    x = torch.randn(2, 128)
    with torch.no_grad(), quantized_weights(model, selector_context(model).names):
        model(x)
    _assert_restored(model, snap, opt)
    with quantized_weights(model, full_projection(model).names, dtype=torch.float32):
        model(x).sum().backward()
    _assert_restored(model, snap, opt)
    with torch.no_grad(), quantized_weights(model, selector_context(model).names):
        pass
    _assert_restored(model, snap, opt)
    # The optimizer still steps the masters in place.
    opt.step()
    assert all(p is p0 for (_, p), (_, p0, _) in zip(model.named_parameters(), snap))


def test_swap_refuses_bad_names_with_nothing_swapped():
    model = _Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = _snapshot(model)
    with pytest.raises(ConfigError, match="`odd.weight` has shape `\\[64, 48\\]`.*multiple of 64"):
        with quantized_weights(model, ["fc.weight", "odd.weight"]):
            pass
    _assert_restored(model, snap, opt)
    with pytest.raises(ConfigError, match="no parameter `nope.weight`|no submodule `nope`"):
        with quantized_weights(model, ["fc.weight", "nope.weight"]):
            pass
    _assert_restored(model, snap, opt)
    with pytest.raises(ConfigError, match="already swapped"):
        with quantized_weights(model, ["fc.weight"]):
            with quantized_weights(model, ["fc.weight"]):
                pass
    _assert_restored(model, snap, opt)


def test_swap_restores_on_generator_close_without_exception():
    model = _Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = _snapshot(model)
    cm = quantized_weights(model, ["fc.weight"])
    cm.__enter__()
    assert not isinstance(model.fc.weight, nn.Parameter)
    cm.__exit__(KeyboardInterrupt, KeyboardInterrupt(), None)
    _assert_restored(model, snap, opt)


# ---------------------------------------------------------------------------
# scopes on the upstream reference draft (real parameter names)


def _upstream_draft(hidden=64, intermediate=128):
    dflash_model = pytest.importorskip("dflash.model")
    from dflash_worker.testing.tiny import tiny_qwen3_config

    cfg = tiny_qwen3_config(
        num_hidden_layers=2,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_target_layers=4,
        dflash_config=dict(
            target_layer_ids=[1, 2], block_size=4, mask_token_id=3, selector_rank=64, selector_top_k=4,
            conv_kernel_size=3, conv_group_size=16,
        ),
    )
    return dflash_model.DFlash2DraftModel(cfg)


def test_scopes_on_reference_dflash2_draft():
    model = _upstream_draft()
    all_names = [n for n, _ in model.named_parameters()]
    full = full_projection(model)
    assert full.skipped == ()
    expected = {
        n for n in all_names
        if any(f".{k}.weight" in f".{n}" for k in (
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "kernel_projection",
            "hidden_projection")) or n == "fc.weight"
    }
    assert set(full.names) == expected
    assert len(full.names) == 2 * (7 + 2) + 2
    for n in all_names:
        if "norm" in n or n.endswith("base_kernel") or "codebook" in n:
            assert never_quantized(n) and n not in full.names
    ctx = selector_context(model)
    assert ctx.names == ("fc.weight", "candidate_selector.hidden_projection.weight") or set(ctx.names) == {
        "fc.weight", "candidate_selector.hidden_projection.weight"}
    # Scope functions accept an iterable or mapping of named parameters too.
    assert full_projection(dict(model.named_parameters())).names == full.names
    assert SCOPES["full_projection"] is full_projection and SCOPES["selector_context"] is selector_context


def test_scopes_report_what_they_skip():
    model = _Tiny()
    full = full_projection(model)
    assert "odd.weight" not in full.names  # not a draft projection name: never a candidate
    named = dict(model.named_parameters())
    named["layers.0.mlp.down_proj.weight"] = torch.zeros(64, 96)
    named["layers.0.self_attn.q_proj.weight"] = torch.zeros(2, 64, 64)
    sel = full_projection(named)
    assert dict(sel.skipped) == {
        "layers.0.mlp.down_proj.weight": "in-features `96` not a multiple of 64",
        "layers.0.self_attn.q_proj.weight": "shape `[2, 64, 64]` is not 2-D",
    }
    assert "mlp.up_proj.weight" in sel.names and "mlp.up_proj.bias" not in sel.names
    assert "conv.base_kernel" not in sel.names and "candidate_selector.predecessor_codebook.weight" not in sel.names
