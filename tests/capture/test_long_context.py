"""The chunked teacher forward (`capture.teacher`, `[capture].chunk_tokens`): long examples in bounded memory.

An example longer than `chunk_tokens` runs chunk by chunk through the target's own transformers
cache. Its features must equal the one-shot forward's: byte for byte where the example fits in one
chunk (the bytes every capture so far holds), and up to float reordering otherwise: a chunk's GEMMs
and attention reductions run over other shapes than the one-shot forward's, which moves the last bit
of some values. The bound is `ULPS` float epsilons of the largest feature magnitude (observed on these
tiny targets: up to 2.6 in float32, 1.04 in bfloat16); a chunk run without the carried cache misses it
by more than five times (checked too), so the bound tells a right chunking from a wrong one.
"""

from __future__ import annotations

import pytest
import torch

from dflash_worker.capture.teacher import teacher_features

FAMILIES = ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe")
LAYER_IDS = [0, 2, 3]  # 3: the last layer, whose hidden state is the final-normed output
LENGTH = 1000
ULPS = 4


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
    bound = ULPS * torch.finfo(dtype).eps * float(ref.float().abs().max())
    # 256: a multiple of the Gated DeltaNet's 64-token chunks; 300 and 97: not, the last chunk short
    for chunk in (256, 300, 97):
        got = teacher_features(model, ids, LAYER_IDS, "cpu", chunk_tokens=chunk)
        assert got.shape == ref.shape and got.dtype == ref.dtype
        diff = float((got.float() - ref.float()).abs().max())
        assert diff <= bound, f"{family} {dtype} chunk {chunk}: max abs diff {diff:.3g} > bound {bound:.3g}"
    # the control: the second chunk run without the first one's cache is far outside the bound
    alone = teacher_features(model, ids[256:512], LAYER_IDS, "cpu")
    assert float((alone.float() - ref[256:512].float()).abs().max()) > 5 * bound


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_chunked_forward_never_builds_a_length_squared_mask(targets, family, monkeypatch):
    """Every attention call of a chunked forward sees at most `chunk x T` scores: no `[T, T]` mask or
    score matrix (SDPA, through transformers' own attention path, is where both would be made)."""
    import torch.nn.functional as F

    model = _load(targets[family], torch.float32)
    seen: list[tuple[int, int, tuple | None]] = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *args, **kwargs):
        seen.append((q.shape[-2], k.shape[-2], None if attn_mask is None else tuple(attn_mask.shape)))
        return sdpa(q, k, v, attn_mask, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    T, chunk = 900, 128
    teacher_features(model, _ids(T), LAYER_IDS, "cpu", chunk_tokens=chunk)
    assert seen, "no attention call went through SDPA"
    assert max(q for q, _, _ in seen) == chunk and max(k for _, k, _ in seen) == T
    for q, k, mask in seen:
        assert q <= chunk and (mask is None or mask[-2] * mask[-1] <= chunk * T), (q, k, mask)
