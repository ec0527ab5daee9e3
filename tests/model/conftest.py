"""Shared fixtures: a tiny Qwen3 target, tiny drafts (ours) and the upstream reference with identical weights."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from dflash_worker.evaluate.speculate import greedy_generate
from dflash_worker.model import DraftConfig, DraftModel, context_features
from dflash_worker.testing.tiny import tiny_qwen3_config
from dflash_worker.testing.tiny_draft import tiny_dflash2_config, tiny_dflash_config

ref_model = pytest.importorskip("dflash.model", reason="upstream reference `dflash==0.1.0` is not installed")


@pytest.fixture(scope="package", autouse=True)
def _one_torch_thread():
    # These models are tiny: a second intra-op thread buys nothing and, on a shared
    # 2-core machine, spin-waiting threads made the suite 20x slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _reference_timer_on_cpu(monkeypatch):
    # The reference times with torch.cuda.synchronize(), which fails without a GPU;
    # its statistics (acceptance lengths) are what we compare, so use a plain clock.
    monkeypatch.setattr(ref_model, "_cuda_time", time.perf_counter)


@pytest.fixture(scope="package")
def target():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_qwen3_config()).eval()


def perturb_unit_params(model: DraftModel, seed: int) -> DraftModel:
    """Move norms and conv bases away from 1/identity so their wiring is actually tested."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "base_kernel" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.15)
    return model


def make_draft(target_config, *, v2: bool = True, seed: int = 1, std: float = 0.05, **overrides) -> tuple[DraftModel, dict]:
    builder = tiny_dflash2_config if v2 else tiny_dflash_config
    raw = builder(target_config, **overrides)
    model = DraftModel(DraftConfig.from_dict(raw)).init_weights_(seed, std=std)
    return perturb_unit_params(model, seed).eval(), raw


def reference_twin(ours: DraftModel, raw: dict):
    """The upstream model built from the same config dict, holding our weights (copied by name)."""
    from transformers import Qwen3Config

    cls = ref_model.DFlash2DraftModel if ours.kind == "dflash2" else ref_model.DFlashDraftModel
    ref = cls(Qwen3Config(**raw))
    sd = {}
    for name, t in ours.state_dict().items():
        sd[name + ".weight" if name.endswith("_codebook") else name] = t.clone()
    ref.load_state_dict(sd, strict=True)
    return ref.eval()


def target_features(target, ids: torch.Tensor, layer_ids) -> torch.Tensor:
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    return context_features(out.hidden_states, layer_ids)


@pytest.fixture(scope="package")
def trained_pair(target):
    """A DFlash2 draft trained briefly (our training path) on the target's greedy text, so it
    agrees with the target often but not always: acceptance lengths vary from 1 to the block size."""
    torch.manual_seed(0)
    draft, raw = make_draft(target.config, seed=3, std=0.02)
    prompts = torch.randint(3, 250, (4, 8), generator=torch.Generator().manual_seed(11))
    seqs = torch.cat([greedy_generate(target, p[None], max_new_tokens=56) for p in prompts])
    feats = target_features(target, seqs, draft.target_layer_ids)
    emb = target.get_input_embeddings().weight.detach()
    T, L = draft.block_size, seqs.shape[1]
    anchors = torch.arange(4, L - T + 1)[None].expand(seqs.shape[0], -1).contiguous()
    labels = torch.stack([seqs.gather(1, anchors + k) for k in range(1, T)], -1)
    draft.train()
    opt = torch.optim.Adam(draft.parameters(), lr=1e-2)
    for _ in range(40):
        h = draft.forward_blocks(feats, anchors, draft.embed(draft.make_blocks(seqs, anchors), emb))
        logits = draft.logits(h[:, :, 1:], target.lm_head)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    draft.eval()
    return draft, raw, prompts
