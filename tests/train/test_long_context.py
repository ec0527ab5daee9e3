"""Long contexts in training: anchors over the whole response, sliding-window draft layers at long
range, and a 32k-token example captured and trained online (issue 53, "long contexts")."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_worker.train.data import anchor_candidates, mix, sample_anchors


def test_anchors_spread_over_the_whole_response():
    """Over many seeds, the anchors of one long response fall uniformly on its anchor candidates: each
    tenth of the response gets its share (within 10%), its last tenth included, and never a prompt
    position; a second response span (a later turn) gets anchors in proportion to its length."""
    L, prompt = 20_000, 1_500
    mask = torch.zeros(L, dtype=torch.bool)
    mask[prompt:] = True
    cand = anchor_candidates(mask)
    lo, hi = int(cand[0]), int(cand[-1])
    assert (lo, hi) == (prompt - 1, L - 2)  # an anchor's next token is a response token
    count, draws = 32, 400
    picks = torch.cat([sample_anchors(mask, count, mix(7, 1, g)) for g in range(draws)])
    assert picks.numel() == count * draws and int(picks.min()) >= lo and int(picks.max()) <= hi
    bins = torch.histc(picks.float(), bins=10, min=lo, max=hi + 1)
    want = count * draws / 10
    assert float((bins / want - 1).abs().max()) < 0.10, bins.tolist()
    # two response spans: 1/4 and 3/4 of the response tokens
    two = torch.zeros(L, dtype=torch.bool)
    two[2_000:6_000] = True
    two[8_000:20_000] = True
    picks = torch.cat([sample_anchors(two, count, mix(7, 1, g)) for g in range(draws)])
    first = float(((picks >= 1_999) & (picks < 5_999)).float().mean())
    assert abs(first - 0.25) < 0.02, first
    one = sample_anchors(two, count, 5)
    assert torch.equal(one, one.sort().values) and one.unique().numel() == count


@torch.no_grad()
def test_sliding_window_layers_hold_at_long_context():
    """A draft whose layers are all `sliding_attention` (window 64) at positions far past the window:
    training's batched forward (`forward_blocks`) equals evaluation's block-by-block path (`step`) at
    every anchor, a feature older than the window moves nothing, and one inside it does."""
    from dflash_worker.model import DraftConfig, build_draft
    from dflash_worker.testing.tiny import tiny_qwen3_config
    from dflash_worker.testing.tiny_draft import tiny_dflash2_config

    window, L = 64, 1_500
    raw = tiny_dflash2_config(tiny_qwen3_config(), num_hidden_layers=2, block_size=4,
                              layer_types=["sliding_attention"] * 2, use_sliding_window=True, sliding_window=window)
    draft = build_draft(DraftConfig.from_dict(raw), seed=3)
    assert [layer.self_attn.window for layer in draft.layers] == [window, window]
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(1, L, draft.config.context_width, generator=gen)
    ids = torch.randint(3, 250, (1, L), generator=gen)
    embed = torch.randn(256, draft.config.hidden_size, generator=gen)
    anchors = torch.tensor([[40, 700, 1_200, L - 4]])
    blocks = draft.embed(draft.make_blocks(ids, anchors), embed)
    batched = draft.forward_blocks(feats, anchors, blocks, attention="sdpa")
    for m, a in enumerate(anchors[0].tolist()):
        one = draft.step(feats[:, :a], blocks[:, m], draft.new_cache())
        assert float((batched[0, m] - one[0]).abs().max()) <= 1e-5, a
    # the block at 1200 sees context positions >= 1200 - window + 1 only
    a, m = 1_200, 2
    old, near = feats.clone(), feats.clone()
    old[:, : a - window + 1] += 5.0
    near[:, a - 8] += 5.0
    assert torch.equal(draft.forward_blocks(old, anchors, blocks, attention="sdpa")[0, m], batched[0, m])
    assert not torch.allclose(draft.forward_blocks(near, anchors, blocks, attention="sdpa")[0, m], batched[0, m])


def _long_world(root, tokens: int):
    """A tiny world (2-layer dense target, 2 heads) whose one row renders to at least `tokens` tokens."""
    from dflash_worker.data import prepare_data, render_example
    from dflash_worker.testing.tokenizer import corpus_lines
    from dflash_worker.testing.world import build_world

    world = build_world(root, examples=1, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        intermediate_size=64, max_position_embeddings=65_536)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(world.target))
    lines, n = corpus_lines(4_000, seed=3), 0
    while True:
        n += 500
        row = {"prompt": "recall the first line", "response": " ".join(lines[:n])}
        msgs = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]
        length = len(render_example(tok, msgs, thinking="off").input_ids)
        if length >= tokens:
            break
    world.rows.write_text(json.dumps(row) + "\n")
    prepare_data([world.rows], root / "data", seed=0, val_fraction=0.0, test_fraction=0.0)
    return world, length


@pytest.mark.slow
def test_a_32k_example_is_captured_and_trained_online(tmp_path, monkeypatch):
    """One example of >= 32768 tokens: the cache capture stores features for every position (the teacher
    in chunks of `chunk_tokens`), and online training computes them for the whole length at every step."""
    from safetensors import safe_open

    from dflash_worker.capture import open_capture, run_capture
    from dflash_worker.capture.teacher import Teacher
    from dflash_worker.recipe import recipe_from_dict
    from dflash_worker.train import train

    world, length = _long_world(tmp_path, 32_768)
    base = {
        "model": {"target": str(world.target), "draft": str(world.draft), "family": "qwen3"},
        "data": {"dir": str(tmp_path / "data"), "thinking": "off", "max_length": length},
        "capture": {"output": str(tmp_path / "cap"), "dtype": "float32", "splits": ["train"], "device": "cpu",
                    "chunk_tokens": 4096},
    }
    m = run_capture(recipe_from_dict(base, base=tmp_path))
    assert m["totals"]["tokens"] == length >= 32_768 and m["key_inputs"]["chunk_tokens"] == 4096
    with safe_open(str(open_capture(tmp_path / "cap").shards[0]), framework="pt") as f:
        feats = f.get_tensor("features")
    assert feats.shape == (length, m["feature_dim"]) and torch.isfinite(feats).all()
    assert float(feats[-4_096:].abs().sum(dim=-1).min()) > 0  # the last chunk's rows are features, not zeros

    seen: list[tuple[int, ...]] = []
    features = Teacher.features

    def spy(self, ids):
        out = features(self, ids)
        seen.append(tuple(out.shape))
        return out

    monkeypatch.setattr(Teacher, "features", spy)
    online = {**base, "capture": {**base["capture"], "output": str(tmp_path / "cap-online")}}
    trainer = {"scope": "full", "features": "online", "steps": 2, "lr": 1e-3, "blocks_per_sequence": 4,
               "val_every": 2, "checkpoint_every": 2, "device": "cpu", "warmup_steps": 1, "output": str(tmp_path / "run")}
    run_capture(recipe_from_dict({**online, "train": trainer}, base=tmp_path))
    train(recipe_from_dict({**online, "train": trainer}, base=tmp_path))
    assert seen and all(s == (length, m["feature_dim"]) for s in seen), seen
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in metrics if "loss" in x]
    assert [x["step"] for x in steps] == [1, 2] and all(x["loss"] == x["loss"] for x in steps), metrics


def test_preflight_plans_at_max_length_through_the_chunked_teacher(pipeline, monkeypatch):
    """Without `--length`, preflight measures one sequence of the real `[data].max_length`, and its
    capture and online phases run the teacher as capture does: `Teacher.features`, in chunks of
    `[capture].chunk_tokens`."""
    import copy

    from dflash_worker.capture.teacher import Teacher
    from dflash_worker.recipe import recipe_from_dict
    from dflash_worker.train import preflight as pf

    raw = copy.deepcopy(pipeline.recipe_base)
    raw["capture"]["chunk_tokens"] = 64
    raw["train"] = {"scope": "full", "steps": 2, "blocks_per_sequence": 4, "device": "cpu",
                    "output": str(pipeline.root / "preflight-long")}
    recipe = recipe_from_dict(raw, base=pipeline.root)
    seen: list[tuple[int, int]] = []
    features = Teacher.features

    def spy(self, ids):
        seen.append((len(ids), self.chunk_tokens))
        return features(self, ids)

    monkeypatch.setattr(Teacher, "features", spy)
    report = pf.preflight(recipe)
    L = recipe.data.max_length
    assert report["sequence_length"] == L == 256 and report["chunk_tokens"] == 64
    # capture phase once, online phase a warm-up and the timed call: every one at max_length, chunked
    assert seen == [(L, 64)] * 3, seen
