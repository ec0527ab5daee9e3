"""QAT (AF4G64 fake quantization, straight-through): exact resume, and validation/export failures
that never orphan or replace the optimizer's FP32 master parameters."""

from __future__ import annotations

import json
import signal

import pytest
import torch
from test_resume import N, _final, _run_to_end, _same_optimizer, _start_and_signal, _steps
from torch import nn

from dflash_worker.recipe import load_recipe
from dflash_worker.train import Hooks, Trainer


def _qat_recipe(pipeline, name, **kw):
    base = dict(steps=N, checkpoint_every=2, val_every=4, grad_accum=1, blocks_per_sequence=4, lr=5e-3,
                scope="full", qat="af4g64", qat_scope="selector_context", export={"format": "af4g64"})
    base.update(kw)
    return pipeline.recipe(name, **base)


def test_qat_resume_after_sigkill_is_bit_identical(pipeline):
    ref = _qat_recipe(pipeline, "qat-ref")
    _run_to_end(ref)
    a = _final(pipeline.root / "qat-ref")
    recipe = _qat_recipe(pipeline, "qat-kill")
    run = pipeline.root / "qat-kill"
    r1 = _start_and_signal(recipe, run, 3, signal.SIGKILL)
    assert r1.returncode == -signal.SIGKILL, r1.stderr[-2000:]
    _run_to_end(recipe, "--resume")
    b = _final(run)
    assert a["trainable_sha"] == b["trainable_sha"]
    _same_optimizer(a["optimizer"], b["optimizer"])
    assert a["export_weights_sha"] == b["export_weights_sha"]
    assert _steps(run) == list(range(1, N + 1))
    sel = json.loads((run / "selection.json").read_text())
    assert sel["export"]["format"] == "af4g64"
    manifest = json.loads((run / sel["export"]["dir"] / "manifest.json").read_text())
    assert "fc.weight" in manifest["quantized"]


def _snapshot(t: Trainer):
    objs = {n: p for n, p in t.parts.model.named_parameters()}
    vals = {n: p.detach().clone() for n, p in objs.items()}
    return objs, vals


def _assert_masters_intact(t: Trainer, objs, vals):
    now = dict(t.parts.model.named_parameters())
    assert now.keys() == objs.keys()
    for n, p in now.items():
        assert p is objs[n], f"`{n}` is not the original parameter object"
        assert isinstance(p, nn.Parameter) and p.dtype == torch.float32
        assert torch.equal(p.detach(), vals[n]), f"`{n}` changed"
    opt_ids = {id(p) for g in t.parts.optimizer.param_groups for p in g["params"]}
    assert opt_ids == {id(p) for n, p in now.items() if n in t.parts.tensors.name_set}


def test_validation_failure_midway_restores_fp32_masters(pipeline):
    recipe = load_recipe(_qat_recipe(pipeline, "qat-fail", steps=2))
    boom = RuntimeError("injected validation failure")
    seen = {}

    def inside(t):
        # inside validation the export values are in place: not the masters
        seen["swapped"] = {n for n, p in t.parts.model.named_parameters() if not isinstance(p, nn.Parameter)}
        raise boom

    t = Trainer(recipe, pipeline.root / "qat-fail", hooks=Hooks(inside_validation=inside), skip_data_check=True)
    t.setup()
    t.train_step()
    objs, vals = _snapshot(t)
    with pytest.raises(RuntimeError, match="injected"):
        t.validate()
    assert seen["swapped"] >= set(t.parts.tensors.qat_names)
    _assert_masters_intact(t, objs, vals)
    # and training continues from the same masters
    t.hooks.inside_validation = None
    t.validate()
    _assert_masters_intact(t, objs, vals)
    t.train_step()
    assert t.step == 2


def test_export_failure_midway_leaves_masters_and_no_partial_export(pipeline, tmp_path):
    from dflash_worker.export.bf16 import write_bf16
    from dflash_worker.train.params import export_values

    recipe = load_recipe(_qat_recipe(pipeline, "qat-exportfail", steps=2))
    t = Trainer(recipe, pipeline.root / "qat-exportfail", skip_data_check=True)
    t.setup()
    t.train_step()
    objs, vals = _snapshot(t)
    values = export_values(dict(t.parts.model.named_parameters()), t.parts.tensors.names, qat_names=t.parts.tensors.qat_names)

    def fault(i, key):
        if i == 5:
            raise OSError("injected disk failure")

    out = tmp_path / "export"
    with pytest.raises(OSError, match="injected"):
        write_bf16(pipeline.draft, values, out, _fault=fault)
    assert not out.exists() and not list(tmp_path.glob(".*"))  # no temporary or moved-aside export left
    _assert_masters_intact(t, objs, vals)
    # the QAT values are the fake-quantized ones, computed from the masters (never stored back)
    from dflash_worker.model.quant import fake_quantize_af4g64

    for n in t.parts.tensors.qat_names:
        assert torch.equal(values[n], fake_quantize_af4g64(objs[n].detach(), torch.bfloat16))
