"""Speculative generation on hybrid targets (Qwen3.5, Qwen3.5-MoE): Gated DeltaNet layers 3:1 with attention.

transformers' `cache.crop` restores only the linear-attention conv states; the recurrent state
must be replayed over the accepted tokens (`evaluate.rollback`). These tests show the output is
the target's own greedy decoding when steps reject inside a block, and that they fail without
the replay.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_worker.errors import FamilyError
from dflash_worker.evaluate import greedy_generate, speculate, speculative_generate
from dflash_worker.evaluate.rollback import RECURRENCE_FUNCTIONS, RecurrentRollback

from .conftest import make_draft

VOCAB = 256
PROMPT_LEN = 12
NEW = 64


def _hybrid(moe: bool, layers: int):
    """A tiny hybrid target from transformers' own classes, float32, seeded, eval mode.

    `initializer_range` 0.2, not the default 0.02: at 0.02 a random model this small falls into
    short loops whose argmax barely depends on the recurrent state, and the mutation test below
    could not fail (at 0.1 it caught the broken rollback on only some prompts)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    kw = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_conv_kernel_dim=4, layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * (layers // 4),
        max_position_embeddings=256, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    if moe:
        cfg = Qwen3_5MoeTextConfig(**kw, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
        return Qwen3_5MoeForCausalLM(cfg).float().eval()
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**kw, intermediate_size=128)).float().eval()


@pytest.fixture(scope="module")
def targets():
    return {"dense": _hybrid(False, 4), "moe": _hybrid(True, 8)}


def _prompts(n: int = 3) -> list[torch.Tensor]:
    return [torch.randint(3, VOCAB - 6, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(s)) for s in range(n)]


@pytest.fixture(scope="module")
def greedy(targets):
    """Each target's own greedy decoding of each prompt (the reference every test compares to)."""
    return {name: [greedy_generate(t, p, max_new_tokens=NEW) for p in _prompts()] for name, t in targets.items()}


class OracleDraft:
    """A real DFlash draft (its forward, cache and features all run) whose proposals are the target's
    true greedy continuation, corrupted from a chosen offset per step on: the target then accepts
    exactly the tokens before the corruption and rejects the rest of the block, so rejections land
    inside blocks. An offset past the block keeps the whole block. `greedy_ids` [1, n]: the reference."""

    candidate_selector = None  # propose through `logits` (the DFlash path of the loop)

    def __init__(self, real, greedy_ids: torch.Tensor, corrupt_at: list[int]):
        self.real, self.greedy_ids, self.corrupt_at = real, greedy_ids[0], corrupt_at
        self.verified = 0  # tokens the loop has verified so far; the next block's anchor sits there
        self.steps = 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def step(self, features, block_embeds, cache):
        self.verified += features.shape[1]  # the prompt's features first, then each step's accepted ones
        return self.real.step(features, block_embeds, cache)

    def logits(self, hidden, head):
        k = hidden.shape[1]
        proposal = self.greedy_ids[self.verified + 1 : self.verified + 1 + k].clone()
        off = self.corrupt_at[self.steps % len(self.corrupt_at)]
        self.steps += 1
        if off < k:
            proposal[off:] = (proposal[off:] + 97) % VOCAB  # all wrong from `off` on, as a draft that lost track
        return F.one_hot(proposal, VOCAB).float()[None] * 8.0


@pytest.fixture(scope="module")
def real_v1(targets):
    return {name: make_draft(t.config, v2=False, seed=5, block_size=16)[0] for name, t in targets.items()}


# per-step offsets of the first wrong proposal: inside block 8 and 16, at 0 (nothing accepted), past the block
CORRUPT = [3, 0, 1, 6, 20, 2, 0, 5, 12, 1, 9, 0]


def _oracle_runs(targets, real_v1, greedy, name: str, block: int):
    """(speculative result, greedy reference) per prompt with the oracle draft, lazily."""
    for prompt, ref in zip(_prompts(), greedy[name]):
        draft = OracleDraft(real_v1[name], ref, CORRUPT)
        yield speculative_generate(draft, targets[name], prompt, max_new_tokens=NEW, block_size=block), ref


def _inside_rejections(lengths: list[int], block: int) -> list[int]:
    """Steps that accepted >= 1 proposal and rejected a later one (the last step may be cut by the limit)."""
    return [n for n in lengths[:-1] if 2 <= n < block]


@pytest.mark.parametrize("block", [8, 16])
@pytest.mark.parametrize("name", ["dense", "moe"])
def test_rejections_inside_blocks_keep_the_greedy_output(targets, real_v1, greedy, name, block):
    lengths, inside = [], []
    for res, ref in _oracle_runs(targets, real_v1, greedy, name, block):
        assert torch.equal(res.output_ids, ref), (res.acceptance_lengths, res.output_ids, ref)
        lengths += res.acceptance_lengths
        inside += _inside_rejections(res.acceptance_lengths, block)
    assert inside, lengths  # the case the replay exists for did happen
    assert block in lengths and 1 in lengths, lengths  # whole blocks kept (no replay) and nothing accepted


@pytest.mark.parametrize("block", [8, 16])
@pytest.mark.parametrize("name", ["dense", "moe"])
def test_without_the_replay_the_output_drifts(targets, real_v1, greedy, name, block, monkeypatch):
    """Mutation: transformers' crop alone (the path before the replay) leaves the recurrent state
    after the whole block, and the same test sees output that is not the target's greedy decoding."""
    monkeypatch.setattr(RecurrentRollback, "replay", lambda self, cache, produced: self.recorded.clear())
    differ = any(not torch.equal(res.output_ids, ref) for res, ref in _oracle_runs(targets, real_v1, greedy, name, block))
    assert differ, "the oracle test cannot tell a broken recurrent-state rollback from a working one"


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_random_dflash2_draft_matches_greedy(targets, greedy, name):
    draft, _ = make_draft(targets[name].config, v2=True, seed=13, block_size=16)
    res = speculative_generate(draft, targets[name], _prompts()[1], max_new_tokens=NEW)
    assert torch.equal(res.output_ids, greedy[name][1])
    assert res.num_output_tokens == NEW == sum(res.acceptance_lengths) + 1
    assert max(res.acceptance_lengths) < 16  # a random draft: every step rejected part of its block


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_hf_generate_and_teacher_regeneration_equal_our_greedy(targets, greedy, name):
    from dflash_worker.capture.generate import generate

    prompt, ref = _prompts()[0], greedy[name][0]
    plain = targets[name].generate(prompt, max_new_tokens=NEW, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(plain, ref)
    # capture's teacher regeneration lets the model create its own cache
    got = generate(targets[name], prompt[0].tolist(), max_new_tokens=NEW, stop_ids=[], greedy=True)
    assert got.ids == ref[0, PROMPT_LEN:].tolist() and not got.stopped


def _capture_caches(monkeypatch) -> list:
    caches = []
    original = speculate._target_cache

    def capturing(target, **kw):
        caches.append(original(target, **kw))
        return caches[-1]

    monkeypatch.setattr(speculate, "_target_cache", capturing)
    return caches


def test_linear_attention_conv_states_stay_at_the_kernel_width(targets, greedy, real_v1, monkeypatch):
    """Recorded conv states grow until cropped: the loop trims them every step (whole blocks
    included), and greedy decoding, never cropped, does not record at all."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    caches = _capture_caches(monkeypatch)
    target, prompt = targets["dense"], _prompts()[0]
    speculative_generate(OracleDraft(real_v1["dense"], greedy["dense"][0], [20]), target, prompt, max_new_tokens=NEW, block_size=8)
    greedy_generate(target, prompt, max_new_tokens=NEW)
    spec, plain = caches
    linear = [layer for layer in spec.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]
    assert len(linear) == 3 and all(layer.conv_states[0].shape[-1] == 4 for layer in linear)
    assert all(layer.record_past for layer in linear)
    assert not any(getattr(layer, "record_past", False) for layer in plain.layers)


def test_profile_has_a_rollback_phase_on_hybrid_targets_only(targets, real_v1, greedy):
    from transformers import AutoModelForCausalLM

    from dflash_worker.testing.tiny import tiny_qwen3_config

    target, prompt = targets["dense"], _prompts()[0]
    draft = OracleDraft(real_v1["dense"], greedy["dense"][0], CORRUPT)
    res = speculative_generate(draft, target, prompt, max_new_tokens=NEW, block_size=8, profile=True)
    assert torch.equal(res.output_ids, greedy["dense"][0])
    phases = res.extra["phase_seconds"]
    assert list(phases) == ["draft", "verify", "accept", "rollback", "crop"]
    assert all(v > 0 for v in phases.values()) and sum(phases.values()) <= res.decode_seconds
    # a plain Qwen3 target takes today's path: no rollback, no phase for it
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(tiny_qwen3_config()).eval()
    d, _ = make_draft(plain.config, v2=True, seed=13)
    phases = speculative_generate(d, plain, prompt, max_new_tokens=20, profile=True).extra["phase_seconds"]
    assert phases.get("rollback", 0.0) == 0.0 and list(phases) == ["draft", "verify", "accept", "crop"]


def test_targets_without_linear_attention_install_nothing(monkeypatch):
    from transformers import AutoModelForCausalLM

    from dflash_worker.testing.tiny import tiny_qwen3_config, tiny_qwen3_moe_config

    def refuse(*a, **k):
        raise AssertionError("a rollback was built for a target without linear-attention layers")

    monkeypatch.setattr(RecurrentRollback, "__init__", refuse)
    for cfg in (tiny_qwen3_config(), tiny_qwen3_moe_config()):
        torch.manual_seed(0)
        target = AutoModelForCausalLM.from_config(cfg).eval()
        draft, _ = make_draft(target.config, v2=True, seed=13)
        ids = _prompts(1)[0]
        res = speculative_generate(draft, target, ids, max_new_tokens=12)
        assert torch.equal(res.output_ids, greedy_generate(target, ids, max_new_tokens=12))


def _recurrence_globals():
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

    return {(m.__name__, n): getattr(m, n) for m in (modeling_qwen3_5, modeling_qwen3_5_moe) for n in RECURRENCE_FUNCTIONS}


def test_a_layer_that_bypasses_the_recurrence_functions_is_an_error(targets, real_v1, greedy, monkeypatch):
    """A hub kernel replacing the layer's forward would run its own recurrence, not the wrapped
    globals: refused, not drifting, and everything patched is put back."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as home

    before = _recurrence_globals()
    layer = targets["dense"].model.layers[1].linear_attn
    real_forward = layer.forward

    def kernel_forward(*args, **kwargs):  # the same computation through the unwrapped functions
        seen = {n: getattr(home, n) for n in RECURRENCE_FUNCTIONS}
        for (_, n), fn in before.items():
            if _ == home.__name__:
                setattr(home, n, fn)
        try:
            return real_forward(*args, **kwargs)
        finally:
            for n, fn in seen.items():
                setattr(home, n, fn)

    monkeypatch.setattr(layer, "forward", kernel_forward)
    draft = OracleDraft(real_v1["dense"], greedy["dense"][0], CORRUPT)
    with pytest.raises(FamilyError, match=r"layer `1`.*without calling.*\n.*hint:"):
        speculative_generate(draft, targets["dense"], _prompts()[0], max_new_tokens=8)
    assert _recurrence_globals() == before  # restored in `finally`
    assert not layer._forward_hooks and not layer._forward_pre_hooks


def test_missing_gated_deltanet_module_or_recurrence_global_is_an_error(targets, monkeypatch):
    from transformers.models.qwen3_5 import modeling_qwen3_5

    target, draft = targets["dense"], make_draft(targets["dense"].config, v2=True, seed=13)[0]
    monkeypatch.delattr(modeling_qwen3_5, "torch_recurrent_gated_delta_rule")
    with pytest.raises(FamilyError, match=r"has no `torch_recurrent_gated_delta_rule`.*\n.*hint:"):
        speculative_generate(draft, target, _prompts()[0], max_new_tokens=8)
    monkeypatch.undo()

    class Mixer(torch.nn.Module):  # some other linear-attention kind: its state cannot be replayed here
        def forward(self, hidden_states, **kw):
            return hidden_states

    # through `_modules`: pytest's setattr would delete a submodule on undo (it is not in `__dict__`)
    monkeypatch.setitem(target.model.layers[2]._modules, "linear_attn", Mixer())
    with pytest.raises(FamilyError, match=r"linear-attention layers `\[2\]` without a Gated DeltaNet module"):
        speculative_generate(draft, target, _prompts()[0], max_new_tokens=8)


def test_prompt_shorter_than_the_conv_kernel(targets, real_v1):
    """The conv states start shorter than the kernel (a 2-token prompt, kernel 4): the trimmed,
    recorded states must still be what 1-token decoding sees (zeros before the prompt)."""
    target = targets["dense"]
    prompt = torch.tensor([[17, 42]])
    ref = greedy_generate(target, prompt, max_new_tokens=24)
    res = speculative_generate(OracleDraft(real_v1["dense"], ref, CORRUPT), target, prompt, max_new_tokens=24, block_size=8)
    assert torch.equal(res.output_ids, ref) and _inside_rejections(res.acceptance_lengths, 8), res.acceptance_lengths
