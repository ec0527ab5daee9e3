"""Benchmark our DFlash2 draft against the upstream reference (`dflash/model.py`), same weights, same inputs.

1. Training step throughput (trained block tokens per second, forward + loss +
   backward): our one-pass `forward_blocks` over M anchored blocks vs the
   reference looped over the same blocks one by one (its only way to train).
2. Speculative generation wall time: our `speculative_generate` vs the
   reference `dflash_generate` (greedy), with the outputs checked identical.

Runs are interleaved (ours, reference, ours, ...) and the median is reported,
so load from other processes hits both sides alike. Ratios > 1 mean ours is
faster. Usage: .venv/bin/python bench/draft.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build(args):
    from dflash.model import DFlash2DraftModel
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dflash_worker.model import DraftConfig, DraftModel
    from dflash_worker.testing.tiny import tiny_qwen3_config
    from dflash_worker.testing.tiny_draft import tiny_dflash2_config

    tcfg = tiny_qwen3_config(
        hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_attention_heads=8, num_key_value_heads=4,
        head_dim=args.hidden // 8, num_hidden_layers=6, vocab_size=2048, max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(tcfg).eval()
    raw = tiny_dflash2_config(tcfg, block_size=args.block, conv_group_size=32, selector_top_k=16, selector_rank=32,
                              final_logit_softcapping=30.0, sliding_window=128)
    ours = DraftModel(DraftConfig.from_dict(raw)).init_weights_(1, std=0.05)
    ref = DFlash2DraftModel(Qwen3Config(**raw))
    sd = {(k + ".weight" if k.endswith("_codebook") else k): v.clone() for k, v in ours.state_dict().items()}
    ref.load_state_dict(sd, strict=True)
    return target, ours, ref


def features(target, ids, layer_ids):
    from dflash_worker.model import context_features

    with torch.no_grad():
        return context_features(target(ids, output_hidden_states=True).hidden_states, layer_ids)


def loss_weights(T: int, gamma: float) -> torch.Tensor:
    k = torch.arange(1, T, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def train_ours(ours, target, ids, feats, anchors, w):
    emb_w = target.get_input_embeddings().weight.detach()
    blocks = ours.make_blocks(ids, anchors)
    h = ours.forward_blocks(feats, anchors, ours.embed(blocks, emb_w))
    logits = ours.logits(h[:, :, 1:], target.lm_head)
    labels = torch.stack([ids.gather(1, anchors + k) for k in range(1, ours.block_size)], -1)
    ce = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none").view(labels.shape)
    loss = (ce * w).sum() / (w.sum() * anchors.numel())
    loss.backward()
    return float(loss.detach())


def train_ref(ref, target, ids, feats, anchors, w):
    emb_w = target.get_input_embeddings().weight.detach()
    T = ref.block_size
    M = anchors.shape[1]
    total = 0.0
    for m in range(M):
        a = int(anchors[0, m])
        blk = torch.full((1, T), ref.mask_token_id)
        blk[0, 0] = ids[0, a]
        h = ref(position_ids=torch.arange(a + T)[None], noise_embedding=F.embedding(blk, emb_w), target_hidden=feats[:, :a])
        logits = ref.compute_logits(h[:, 1:], target.lm_head)
        ce = F.cross_entropy(logits[0], ids[0, a + 1 : a + T], reduction="none")
        loss = (ce * w).sum() / (w.sum() * M)
        loss.backward()
        total += float(loss.detach())
    return total


def timed(fn, *a):
    """(wall seconds, process CPU seconds, result). CPU time is the steadier figure on a shared machine."""
    t, c = time.perf_counter(), time.process_time()
    out = fn(*a)
    return time.perf_counter() - t, time.process_time() - c, out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (smoke run)")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: stable on a shared box)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per side (default 5, quick 2)")
    args = p.parse_args(argv)
    args.hidden = 128 if args.quick else 256
    args.block = 8 if args.quick else 16
    reps = args.repeats or (2 if args.quick else 5)
    torch.set_num_threads(args.threads)

    import dflash.model as ref_mod
    from dflash.model import dflash_generate

    from dflash_worker.evaluate import speculative_generate

    # the reference's timing helper calls torch.cuda.synchronize(); we time outside it
    ref_mod._cuda_time = time.perf_counter
    target, ours, ref = build(args)
    for m in (target, ours, ref):
        for prm in m.parameters():
            prm.requires_grad_(m is not target)

    # ---------------------------------------------------------------- training
    L = 256 if args.quick else 512
    M = 8 if args.quick else 16
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 2000, (1, L), generator=g)
    feats = features(target, ids, ours.target_layer_ids)
    anchors = torch.sort(torch.randperm(L - 2 * args.block, generator=g)[:M] + args.block).values[None]
    w = loss_weights(args.block, 7.0)
    tokens = M * args.block

    ours.train(), ref.train()
    # warm-up, and a check that both sides compute the same loss and gradients
    ours.zero_grad(), ref.zero_grad()
    lo = train_ours(ours, target, ids, feats, anchors, w)
    lr = train_ref(ref, target, ids, feats, anchors, w)
    gdiff = max(
        (po.grad - ref.get_parameter(n).grad).abs().max().item()
        for n, po in ours.named_parameters()
        if po.grad is not None and not n.startswith("candidate_selector")
    )
    log(f"training: loss ours {lo:.6f} ref {lr:.6f}, max grad diff {gdiff:.2e}")
    t_ours, t_ref = [], []
    for _ in range(reps):
        ours.zero_grad()
        t_ours.append(timed(train_ours, ours, target, ids, feats, anchors, w)[:2])
        ref.zero_grad()
        t_ref.append(timed(train_ref, ref, target, ids, feats, anchors, w)[:2])
    med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
    train = {
        clock: {"ours": tokens / med(t_ours, i), "reference_loop": tokens / med(t_ref, i)} for i, clock in enumerate(("wall", "cpu"))
    }
    for v in train.values():
        v["ratio"] = v["ours"] / v["reference_loop"]

    # ---------------------------------------------------------------- generation
    ours.eval(), ref.eval()
    prompts = [torch.randint(3, 2000, (1, 64 if args.quick else 128), generator=g) for _ in range(2 if args.quick else 3)]
    new = 48 if args.quick else 96
    s_ours, s_ref, same, steps = [], [], True, []
    for i in range(reps + 1):  # first round is warm-up
        to, tr = [0.0, 0.0], [0.0, 0.0]
        for pr in prompts:
            *dt, a = timed(lambda: speculative_generate(ours, target, pr, max_new_tokens=new))
            to = [x + y for x, y in zip(to, dt)]
            *dt, b = timed(lambda: dflash_generate(ref, target, pr, new, None, return_stats=True))
            tr = [x + y for x, y in zip(tr, dt)]
            same &= torch.equal(a.output_ids, b.output_ids) and a.acceptance_lengths == b.acceptance_lengths
            if i == 0:
                steps.append(a.mean_acceptance_length)
        if i:
            s_ours.append(to)
            s_ref.append(tr)
    gen = {clock: {"ours": med(s_ours, i), "reference": med(s_ref, i)} for i, clock in enumerate(("wall", "cpu"))}
    for v in gen.values():
        v["ratio"] = v["reference"] / v["ours"]

    res = {
        "config": {"hidden": args.hidden, "block_size": args.block, "draft_layers": ours.config.num_layers,
                   "target_layers": target.config.num_hidden_layers, "seq_len": L, "blocks_per_step": M,
                   "threads": args.threads, "repeats": reps},
        "train_tokens_per_s": train,
        "train_max_grad_diff": gdiff,
        "generate_seconds": gen,
        "generate_identical": bool(same),
        "mean_acceptance_length": statistics.mean(steps),
        "generated_tokens_per_run": new * len(prompts),
    }
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    c = res["config"]
    print(f"config: hidden {c['hidden']}, block {c['block_size']}, draft layers {c['draft_layers']} (1 sliding), "
          f"target layers {c['target_layers']}, seq {c['seq_len']}, {c['blocks_per_step']} blocks/step, threads {c['threads']}, median of {reps}")
    for clock in ("wall", "cpu"):
        t = train[clock]
        print(f"train fwd+bwd [{clock:4}]  ours {t['ours']:10.1f} tok/s  reference loop {t['reference_loop']:10.1f} tok/s  ratio {t['ratio']:.2f}x")
    print(f"  (same loss and gradients: max grad diff {gdiff:.1e})")
    for clock in ("wall", "cpu"):
        t = gen[clock]
        print(f"spec generate [{clock:4}]  ours {t['ours']:10.3f} s      reference      {t['reference']:10.3f} s      ratio {t['ratio']:.2f}x")
    print(f"  (identical output and acceptance lengths: {same}; mean acceptance {res['mean_acceptance_length']:.2f}; "
          f"{res['generated_tokens_per_run']} new tokens per run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
