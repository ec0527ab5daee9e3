"""`[train].l2sp` (L2-SP, anti-forgetting): the gradient it adds, its effect on how far the
trained tensors move from the starting draft, the metrics line, exact resume and the recipe check."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_worker.errors import ConfigError, ResumeError
from dflash_worker.manifest import sha256_file
from dflash_worker.recipe import load_recipe
from dflash_worker.train import StopFlags, Trainer, train
from dflash_worker.train import checkpoint as ckpt


def _distance(trainer: Trainer) -> float:
    """Squared distance of the trained tensors from the starting draft."""
    from dflash_worker.model import load_draft

    start = dict(load_draft(trainer.recipe.model.draft, device=torch.device("cpu"), dtype=torch.float32).named_parameters())
    return sum(float((p.detach() - start[n].detach()).square().sum()) for n, p in trainer.parts.model.named_parameters() if n in trainer.parts.tensors.name_set)


def _trainer(pipeline, run: str, **kw) -> Trainer:
    t = Trainer(load_recipe(pipeline.recipe(run, **kw)), pipeline.root / run, skip_data_check=True)
    t.setup()
    return t


def test_l2sp_adds_the_exact_gradient_and_reports_the_penalty(pipeline):
    lam = 0.37
    t = _trainer(pipeline, "l2sp-grad", l2sp=lam)
    start = [p.detach().clone() for p in t.parts.params]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in t.parts.params:
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    base = [torch.randn(p.shape, generator=g) for p in t.parts.params]
    for p, b in zip(t.parts.params, base):
        p.grad = b.clone()
    t.parts.params[0].grad = None  # a tensor the micro-batches did not reach
    penalty = t._l2sp()
    want = 0.5 * lam * sum(float((p.detach() - s).square().sum()) for p, s in zip(t.parts.params, start))
    assert penalty == pytest.approx(want, rel=1e-6) and penalty > 0
    for i, (p, s, b) in enumerate(zip(t.parts.params, start, base)):
        expected = lam * (p.detach() - s) + (0 if i == 0 else b)
        torch.testing.assert_close(p.grad, expected, rtol=1e-6, atol=1e-6)


def test_without_l2sp_nothing_is_added_and_no_penalty_is_reported(pipeline):
    t = _trainer(pipeline, "l2sp-off")
    assert t.parts.start is None and t._l2sp() is None
    assert "l2sp_penalty" not in t.train_step()


def test_l2sp_keeps_the_trained_tensors_closer_to_the_released_draft(pipeline):
    free = _trainer(pipeline, "l2sp-free", lr=3e-3)
    held = _trainer(pipeline, "l2sp-held", lr=3e-3, l2sp=50.0)
    lines = []
    for _ in range(6):
        free.train_step()
        lines.append(held.train_step())
    assert lines[0]["l2sp_penalty"] == 0.0  # the first step starts at the released weights
    assert all(line["l2sp_penalty"] > 0 for line in lines[1:])
    d_free, d_held = _distance(free), _distance(held)
    assert d_held < 0.5 * d_free, (d_held, d_free)


def test_l2sp_run_resumes_bit_identical(pipeline):
    kw = dict(steps=4, val_every=2, checkpoint_every=1, l2sp=5.0)
    ref = train(load_recipe(pipeline.recipe("l2sp-ref", **kw)))
    assert ref.status == "completed"
    flags = StopFlags()
    flags.request_stop("test")
    train(load_recipe(pipeline.recipe("l2sp-res", **kw)), flags=flags)
    train(load_recipe(pipeline.recipe("l2sp-res", **kw)), resume=True)
    last = ckpt.step_name(4)
    for name in ("trainable.safetensors",):
        assert sha256_file(pipeline.root / "l2sp-res" / ckpt.CHECKPOINTS / last / name) == sha256_file(
            pipeline.root / "l2sp-ref" / ckpt.CHECKPOINTS / last / name)
    a = [json.loads(x) for x in (pipeline.root / "l2sp-ref" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (pipeline.root / "l2sp-res" / "metrics.jsonl").read_text().splitlines()]
    assert [x["l2sp_penalty"] for x in a] == [x["l2sp_penalty"] for x in b]
    # a resume with another strength is refused, naming the field
    with pytest.raises(ResumeError, match="`train.l2sp`"):
        train(load_recipe(pipeline.recipe("l2sp-res", **{**kw, "steps": 6, "l2sp": 1.0})), resume=True)


@pytest.mark.parametrize("bad", [-1.0, "strong", True, float("nan")])
def test_l2sp_must_be_a_non_negative_number(pipeline, bad):
    raw = dict(pipeline.recipe_base, train={"scope": "full", "l2sp": bad})
    from dflash_worker.recipe import recipe_from_dict

    with pytest.raises(ConfigError, match="l2sp"):
        recipe_from_dict(raw, base=pipeline.root)
