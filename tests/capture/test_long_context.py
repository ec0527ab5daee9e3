"""The chunked teacher forward (`capture.teacher`, `[capture].chunk_tokens`): long examples in bounded memory.

An example longer than `chunk_tokens` runs chunk by chunk through the target's own transformers
cache. Its features must equal the one-shot forward's: byte for byte where the example fits in one
chunk (the bytes every capture so far holds), and up to float reordering otherwise: a chunk's GEMMs
and attention reductions run over other shapes than the one-shot forward's, which moves the last bit
of some values, and the chunk's attention (`prefix_causal_sdpa`) merges two softmax halves by their
log-sum-exps. The bound is `ULPS[dtype]` float epsilons of the largest feature magnitude (observed on
these tiny targets: up to 2.6 in float32; up to 2.7 in bfloat16, 6.3 on `qwen3_moe`, where a last-bit
change can flip a token's top-2 experts); a chunk run without the carried cache misses it by more than
four times (checked too), so the bound tells a right chunking from a wrong one.
"""

from __future__ import annotations

import pytest
import torch

from dflash_worker.capture.teacher import teacher_features

FAMILIES = ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe")
LAYER_IDS = [0, 2, 3]  # 3: the last layer, whose hidden state is the final-normed output
LENGTH = 1000
ULPS = {torch.float32: 4, torch.bfloat16: 8}


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict:
    from dflash_worker.testing.tiny import save_tiny_target

    out = {}
    for family in FAMILIES:
        d = tmp_path_factory.mktemp(f"long_{family}")
        save_tiny_target(d, family=family, max_position_embeddings=65536)
        out[family] = d
    return out


def _load(path, dtype):
    from dflash_worker.weights import load_model

    return load_model(path, device="cpu", dtype=dtype).eval()


def _plain(model, ids: list[int]) -> torch.Tensor:
    """transformers' own one-shot forward, every hidden state returned: the reference."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[i + 1][0] for i in LAYER_IDS], dim=-1)


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_features_equal_the_one_shot_forward(targets, family, dtype):
    model = _load(targets[family], dtype)
    ids = _ids(LENGTH)
    ref = _plain(model, ids)
    # one chunk (the example fits): the one-shot forward, byte for byte
    for chunk in (None, LENGTH):
        assert torch.equal(teacher_features(model, ids, LAYER_IDS, "cpu", chunk_tokens=chunk), ref), chunk
    bound = ULPS[dtype] * torch.finfo(dtype).eps * float(ref.float().abs().max())
    # 256: a multiple of the Gated DeltaNet's 64-token chunks; 300 and 97: not, the last chunk short
    for chunk in (256, 300, 97):
        got = teacher_features(model, ids, LAYER_IDS, "cpu", chunk_tokens=chunk)
        assert got.shape == ref.shape and got.dtype == ref.dtype
        diff = float((got.float() - ref.float()).abs().max())
        assert diff <= bound, f"{family} {dtype} chunk {chunk}: max abs diff {diff:.3g} > bound {bound:.3g}"
    # the control: the second chunk run without the first one's cache is far outside the bound
    alone = teacher_features(model, ids[256:512], LAYER_IDS, "cpu")
    assert float((alone.float() - ref[256:512].float()).abs().max()) > 4 * bound


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_chunked_forward_builds_no_attention_mask(targets, family, monkeypatch):
    """Every attention call of a chunked forward goes through `prefix_causal_sdpa` with no mask (transformers
    builds none for it): queries of at most one chunk against the cached prefix plus the chunk, never a
    `[T, T]` mask or score matrix; after the loop the target's own SDPA is back."""
    from dflash_worker.capture import teacher as teacher_mod

    model = _load(targets[family], torch.float32)
    seen: list[tuple[int, int, bool]] = []
    inner = teacher_mod.prefix_causal_sdpa

    def spy(module, query, key, value, attention_mask, *args, **kwargs):
        seen.append((query.shape[-2], key.shape[-2], attention_mask is None))
        return inner(module, query, key, value, attention_mask, *args, **kwargs)

    monkeypatch.setattr(teacher_mod, "prefix_causal_sdpa", spy)
    T, chunk = 900, 128
    teacher_features(model, _ids(T), LAYER_IDS, "cpu", chunk_tokens=chunk)
    layers = sum(1 for t in model.config.get_text_config().layer_types if t == "full_attention")
    assert len(seen) == layers * -(-T // chunk), seen
    assert all(unmasked for _, _, unmasked in seen) and max(q for q, _, _ in seen) == chunk and max(k for _, k, _ in seen) == T
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("window", [None, 50])
def test_prefix_causal_sdpa_equals_masked_attention(dtype, window):
    """`prefix_causal_sdpa` against SDPA with the explicit lower-right causal (and sliding) mask, on GQA
    shapes: the CPU flash + log-sum-exp merge (float32, bfloat16) and the lower-right bias branch other
    devices take (float64 takes it on the CPU), with and without a cached prefix."""
    import torch.nn.functional as F

    from dflash_worker.capture.teacher import prefix_causal_sdpa

    gen = torch.Generator().manual_seed(1)
    for P, C in ((0, 64), (200, 64), (37, 1)):
        S = P + C
        q = torch.randn(1, 4, C, 16, generator=gen).to(dtype)
        k, v = (torch.randn(1, 2, S, 16, generator=gen).to(dtype) for _ in range(2))
        got, none = prefix_causal_sdpa(None, q, k, v, None, scaling=0.25, sliding_window=window)
        q_pos, k_pos = torch.arange(P, S)[:, None], torch.arange(S)[None, :]
        mask = (k_pos <= q_pos) & ((q_pos - k_pos < window) if window else True)
        want = F.scaled_dot_product_attention(q.double(), k.repeat_interleave(2, 1).double(), v.repeat_interleave(2, 1).double(),
                                              attn_mask=mask, scale=0.25).transpose(1, 2)
        assert none is None and got.shape == (1, C, 4, 16) and got.dtype == dtype
        assert float((got.double() - want).abs().max()) <= 4 * torch.finfo(dtype).eps * float(want.abs().max()), (P, C, dtype)
