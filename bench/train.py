"""Training throughput: our batched anchored-block step vs a naive per-block loop over the reference.

Measured in one run, on the same weights, features, anchors and labels:

- ours: `DraftModel.forward_blocks` over all M blocks of a sequence in one pass,
  logits through the frozen head, the training objectives of
  `dflash_worker.train.objectives`, backward, fused AdamW (what `Trainer.train_step` runs);
- naive baseline: the upstream reference `DFlash2DraftModel` (dflash==0.1.0)
  run one block at a time (context = features before the anchor, then the
  block), the same losses, backward per block, one AdamW step (torch's default
  per-tensor AdamW; ours uses the fused AdamW that `Trainer.setup` builds).

Two recipes: `full` (every draft tensor, weighted CE + selector objective) and
`selector` (the three selector tensors, selector objective). Prints tokens/s
(block positions trained per second, from the median step time; timed steps
of the two variants alternate), the ratio ours / naive in wall time and in
process CPU time (the steadier of the two on a shared machine), and the peak
RSS of each (process VmHWM, reset before each measurement; labelled peak).

Usage: .venv/bin/python bench/train.py [--steps N] [--length L] [--blocks M]

`--features` measures the other question instead (issue 36): `[train].features = "online"` vs
`"cache"`, end to end on a tiny world built in a temporary dir (real target, draft, prepared
data), in one run: the cache capture, cache training, the online capture (token ids only) and
online training, each timed; samples/s (training sequences per second) for cache training
alone, capture + cache training, and online capture + online training; bytes on disk per token
of each capture; and whether the two exports are byte-identical. The ratio the issue asks for
is online end to end over capture + cache training (goal <= 1.3x on CPU).

Times are medians over `--repeats` rounds in which the two modes alternate (a shared machine's
load then falls on both).

Usage: .venv/bin/python bench/train.py --features [--examples N] [--train-steps S] [--grad-accum A] [--repeats R]

`--lengths 2048,4096,8192,16384`: long contexts instead (bench/long_context.py): one online training
step (the chunked teacher forward beside the draft, then forward, backward and AdamW over `--blocks`
anchored blocks) beside transformers' plain forward of the same tiny hybrid (`qwen3_5`) and dense
(`qwen3`) targets at each length, peak RSS and time per token, each in its own process.

Usage: .venv/bin/python bench/train.py --lengths 2048,4096,8192,16384 [--chunk-tokens 2048] [--blocks M]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.nn import functional as F

from dflash_worker.model import DraftConfig, build_draft
from dflash_worker.testing.tiny import tiny_qwen3_config
from dflash_worker.testing.tiny_draft import tiny_dflash2_config
from dflash_worker.train.objectives import block_labels, position_weights, selector_loss_sum, token_loss_sum, weight_total
from dflash_worker.train.preflight import _PeakRSS
from dflash_worker.train.scopes import scope_names
from dflash_worker.train.setup import fused_adamw as _fused_adamw


def setup(args):
    tcfg = tiny_qwen3_config(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                             num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=4096)
    raw = tiny_dflash2_config(tcfg, num_hidden_layers=2, block_size=16, selector_rank=32, selector_top_k=32,
                              conv_group_size=64, layer_types=["full_attention", "full_attention"], use_sliding_window=False,
                              sliding_window=None)
    cfg = DraftConfig.from_dict(raw)
    g = torch.Generator().manual_seed(0)
    L, M = args.length, args.blocks
    data = {
        "ids": torch.randint(0, tcfg.vocab_size - 1, (L,), generator=g),
        "mask": torch.ones(L, dtype=torch.bool),
        "feats": torch.randn(1, L, cfg.context_width, generator=g),
        "embed": torch.randn(tcfg.vocab_size, tcfg.hidden_size, generator=g) * 0.02,
        "head": torch.randn(tcfg.vocab_size, tcfg.hidden_size, generator=g) * 0.02,
        "anchors": torch.randperm(L - cfg.block_size - 1, generator=g)[:M].add(1).sort().values,
    }
    data["mask"][: L // 8] = False
    return raw, cfg, data


def ours_step(model, opt, d, pw, scope):
    a = d["anchors"]
    labels, valid = block_labels(d["ids"], d["mask"], a, model.block_size)
    emb = model.embed(model.make_blocks(d["ids"][None], a[None]), d["embed"])
    hidden = model.forward_blocks(d["feats"], a[None], emb)
    h = hidden[0, :, 1:]
    logits = model.logits(h, d["head"])
    sel = selector_loss_sum(model.candidate_selector, h, logits, d["ids"][a], labels, valid, pw)
    loss = sel if scope == "selector" else token_loss_sum(logits, labels, valid, pw, "weighted_ce") + sel
    (loss / weight_total(valid, pw)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def naive_step(ref, opt, d, pw, scope, T):
    a_all = d["anchors"]
    labels_all, valid_all = block_labels(d["ids"], d["mask"], a_all, T)
    denom = weight_total(valid_all, pw)
    head = d["head"]
    sel_mod = ref.candidate_selector
    for m, a in enumerate(a_all.tolist()):
        block = torch.full((1, T), ref.mask_token_id, dtype=torch.long)
        block[0, 0] = d["ids"][a]
        noise = F.embedding(block, d["embed"])
        h = ref(position_ids=torch.arange(a + T)[None], noise_embedding=noise, target_hidden=d["feats"][:, :a])[:, 1:]
        logits = ref.compute_logits(h, lambda x: x @ head.T)[0]
        labels, valid = labels_all[m : m + 1], valid_all[m : m + 1]
        unary, cand = torch.topk(logits, sel_mod.top_k, dim=-1, sorted=False)
        prev = torch.cat((block[0, :1], labels[0, :-1]))
        q = sel_mod.hidden_projection(h[0]) * sel_mod.predecessor_codebook(prev)
        scores = unary + (sel_mod.successor_codebook(cand) @ q.unsqueeze(-1)).squeeze(-1)
        hit = cand == labels[0].unsqueeze(-1)
        w = (valid[0] & hit.any(-1)).float() * pw
        loss = (w * F.cross_entropy(scores, hit.float().argmax(-1), reduction="none")).sum()
        if scope != "selector":
            loss = loss + token_loss_sum(logits[None], labels, valid, pw, "weighted_ce")
        (loss / denom).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def bench(fns, steps):
    """{name: (median wall s/step, median process CPU s/step, peak RSS)} of each variant.

    Timed steps alternate between the variants, so a load burst on a shared machine lands on
    both instead of skewing the ratio (one variant's steps take seconds, the other's a fraction
    of that); the peak RSS is that of one further, separately watched step of each.
    """
    for fn in fns.values():
        fn()  # warm-up (allocations, kernels, optimizer state)
    peaks = {}
    for name, fn in fns.items():
        with _PeakRSS() as peak:
            fn()
        peaks[name] = peak.peak
    wall: dict = {n: [] for n in fns}
    cpu: dict = {n: [] for n in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return {n: (statistics.median(wall[n]), statistics.median(cpu[n]), peaks[n]) for n in fns}


def _timed(fn):
    """(result, wall seconds, process CPU seconds): CPU time is the steadier one on a shared machine."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def features_bench(args) -> None:
    """Cache vs online features end to end on a tiny world (module docstring)."""
    import copy
    import json
    import tempfile
    from pathlib import Path

    from dflash_worker.capture import run_capture
    from dflash_worker.data import prepare_data
    from dflash_worker.manifest import sha256_file
    from dflash_worker.recipe import recipe_from_dict
    from dflash_worker.testing.world import build_world
    from dflash_worker.train import train

    with tempfile.TemporaryDirectory(prefix="dflash-bench-train-") as tmp:
        root = Path(tmp)
        world = build_world(root, examples=args.examples, seed=0)
        prepare_data([world.rows], root / "data", seed=0, val_fraction=0.1, test_fraction=0.1)
        base = {
            "model": {"target": str(world.target), "draft": str(world.draft), "family": "qwen3"},
            "data": {"dir": str(root / "data"), "thinking": "off", "max_length": 256},
            "capture": {"dtype": "float32", "splits": ["train"], "device": "cpu"},
            "train": {"scope": "full", "steps": args.train_steps, "grad_accum": args.grad_accum, "lr": 3e-3,
                      "blocks_per_sequence": 4, "val_every": 0, "checkpoint_every": args.train_steps, "device": "cpu"},
        }
        samples: dict[str, list[dict]] = {"cache": [], "online": []}
        for r in range(args.repeats):  # the modes alternate, so load from others on the machine hits both
            for mode in ("cache", "online"):
                raw = copy.deepcopy(base)
                raw["capture"]["output"] = str(root / f"capture-{mode}-{r}")
                raw["train"].update(features=mode, output=str(root / f"run-{mode}-{r}"))
                recipe = recipe_from_dict(raw, base=root)
                manifest, cap_s, cap_c = _timed(lambda: run_capture(recipe))
                _, train_s, train_c = _timed(lambda: train(recipe))
                sel = json.loads((root / f"run-{mode}-{r}" / "selection.json").read_text())
                samples[mode].append({
                    "capture_s": cap_s, "train_s": train_s, "capture_c": cap_c, "train_c": train_c,
                    "tokens": manifest["totals"]["tokens"],
                    "bytes": manifest["totals"]["payload_bytes"],
                    "export": sha256_file(root / f"run-{mode}-{r}" / sel["export"]["dir"] / "model.safetensors"),
                })
        # medians of each timing over the repeats; bytes and exports are the same in every repeat
        runs = {m: {k: (statistics.median(x[k] for x in xs) if k.endswith(("_s", "_c")) else xs[0][k]) for k in xs[0]}
                for m, xs in samples.items()}
        exports = {x["export"] for xs in samples.values() for x in xs}
    n = args.train_steps * args.grad_accum  # training sequences per run
    c, o = runs["cache"], runs["online"]
    print(f"features bench: tiny world, {args.examples} examples ({c['tokens']} captured tokens), {args.train_steps} steps x "
          f"{args.grad_accum} sequences = {n} training sequences, float32 on cpu, torch threads {torch.get_num_threads()}, "
          f"median of {args.repeats} alternating repeats")
    rows = [
        ("cache training only", c["train_s"], c["train_c"], c["bytes"]),
        ("capture + cache training", c["capture_s"] + c["train_s"], c["capture_c"] + c["train_c"], c["bytes"]),
        ("online (token capture + online training)", o["capture_s"] + o["train_s"], o["capture_c"] + o["train_c"], o["bytes"]),
    ]
    for name, secs, cpu, nbytes in rows:
        print(f"  {name:<42} {secs:7.2f} s  {n / secs:7.2f} samples/s  (cpu {cpu:7.2f} s)  disk {nbytes / c['tokens']:9.1f} B/token")
    print(f"  captures: cache {c['capture_s']:.2f} s, online {o['capture_s']:.2f} s; training: cache {c['train_s']:.2f} s, "
          f"online {o['train_s']:.2f} s")
    ratio = (o["capture_s"] + o["train_s"]) / (c["capture_s"] + c["train_s"])
    cpu_ratio = (o["capture_c"] + o["train_c"]) / (c["capture_c"] + c["train_c"])
    print(f"  online end to end / capture + cache training: {ratio:.2f}x wall, {cpu_ratio:.2f}x cpu time (goal <= 1.3x); "
          f"online disk {o['bytes'] / o['tokens']:.1f} B/token (goal <= 16)")
    print(f"  exports byte-identical: {'yes' if len(exports) == 1 else 'NO'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--features", action="store_true", help="cache vs online features end to end instead (module docstring)")
    ap.add_argument("--examples", type=int, default=48, help="--features: examples in the tiny world")
    ap.add_argument("--train-steps", type=int, default=16, help="--features: optimizer steps of each training run")
    ap.add_argument("--grad-accum", type=int, default=2, help="--features: sequences per optimizer step")
    ap.add_argument("--repeats", type=int, default=3, help="--features: alternating repeats of both modes (medians reported)")
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps per variant (after one warm-up)")
    ap.add_argument("--length", type=int, default=1024, help="sequence length (context tokens)")
    ap.add_argument("--blocks", type=int, default=16, help="anchored blocks per sequence")
    import long_context

    long_context.add_arguments(ap)
    args = ap.parse_args()
    if args.lengths:
        sys.exit(long_context.run(args, "train"))
    if args.features:
        features_bench(args)
        return
    from dflash.model import DFlash2DraftModel
    from transformers import Qwen3Config

    raw, cfg, d = setup(args)
    T = cfg.block_size
    pw = position_weights(T, None)
    tokens = args.blocks * T  # per step
    print(f"config: hidden {cfg.hidden_size}, {cfg.num_layers} draft layers, vocab {cfg.vocab_size}, block {T}, "
          f"sequence {args.length}, {args.blocks} blocks/step, {args.steps} timed steps, torch threads {torch.get_num_threads()}")
    for scope in ("selector", "full"):
        ours = build_draft(cfg, seed=0)
        ref = DFlash2DraftModel(Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")}))
        ref_sd = {k[: -len(".weight")] if k.endswith("_codebook.weight") else k: v for k, v in ref.state_dict().items()}
        with torch.no_grad():
            for n, p in ours.named_parameters():
                ref_sd[n].copy_(p)
        ref.train()
        names = set(scope_names(scope, [n for n, _ in ours.named_parameters()]))
        for n, p in ours.named_parameters():
            p.requires_grad_(n in names)
        ref_params = []
        for k, p in ref.named_parameters():
            key = k[: -len(".weight")] if k.endswith("_codebook.weight") else k
            p.requires_grad_(key in names)
            if key in names:
                ref_params.append(p)
        # ours uses the optimizer `Trainer.setup` builds (fused AdamW where torch has it); the
        # naive baseline keeps torch's default AdamW
        opt_o = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=1e-4,
                                  fused=_fused_adamw(torch.device("cpu")))
        opt_r = torch.optim.AdamW(ref_params, lr=1e-4)
        r = bench({"naive": lambda: naive_step(ref, opt_r, d, pw, scope, T),
                   "ours": lambda: ours_step(ours, opt_o, d, pw, scope)}, args.steps)
        (s_n, c_n, rss_n), (s_o, c_o, rss_o) = r["naive"], r["ours"]
        print(f"{scope:>8}: ours {tokens / s_o:9.1f} tok/s (peak rss {rss_o / 2**20:7.1f} MiB) | "
              f"naive reference per block {tokens / s_n:9.1f} tok/s (peak rss {rss_n / 2**20:7.1f} MiB) | "
              f"speedup {s_n / s_o:5.2f}x (cpu time {c_n / c_o:5.2f}x: {c_o * 1e3:.0f} vs {c_n * 1e3:.0f} ms/step)")


if __name__ == "__main__":
    main()
