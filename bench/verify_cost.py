"""Does a block verify cost one target step on this machine? The hardware question behind issue 16's
speedup goal, measured apart from any trained model.

Issue 16 asks the speculative loop for a wall-clock speedup over plain greedy decoding of at least
0.8 x tau / (1 + d / t), where t is the target's greedy step, d the draft's step and tau the
acceptance length. One loop step costs d + v (v: the target's forward over the block; the loop's
bookkeeping comes on top) and yields tau tokens, so the speedup is at most tau x t / (d + v), and
its ratio to the goal at most

    ceiling = (t + d) / (0.8 x (d + v))      whatever tau is.

The goal is reachable only where ceiling >= 1, that is where v <= 1.25 t + 0.25 d: where a block
verify costs about one greedy step, as on an accelerator whose decoding step is bound by reading
the weights. Where the block's matrix products are bound by arithmetic instead (a CPU core and a
small target), v grows with the block and the goal is out of reach for any draft.

What is timed, each the same call the speculative loop or greedy decoding makes, the median of
`--repeat` samples taken in interleaved rounds (so drift in the machine's load hits every figure
alike), per thread count; the caches are rolled back to the context between samples, untimed:
- t = t(1): a greedy step, timed over 8 back to back as `greedy_generate` runs them (the KV cache
  of `--context` tokens growing by one each);
- t(k), k > 1: the target's forward over a k-token block after that cache, hidden states kept, as
  `speculative_generate` verifies (k = block size is the loop's verify, v), each after a draft step;
- d: one draft step (block forward over the newly verified features, then the proposal through the
  candidate selector);
- the GEMM under both: the target's MLP up-projection with 1 row and with a block of rows, GFLOP/s.

The target is a random Qwen3 of the given geometry and the draft a fresh DFlash2 draft for it (a
step's cost does not depend on the weights' values). The defaults are `bench/effectiveness.py`'s
world (hidden 256, 4 layers, a 2-layer draft, block 8), under the same `MKL_CBWR` setting.

Usage: .venv/bin/python bench/verify_cost.py [--threads 1,2] [--device cuda --dtype bfloat16
       --hidden 4096 --layers 36 --draft standard] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# the effectiveness bench's setting (bit-identical GEMMs for any thread count; the costs measured
# here are those of its evaluation), set by `main` before torch loads, never at import
MKL_CBWR = "AVX2,STRICT"

GOAL_FACTOR = 0.8  # issue 16: speedup >= 0.8 x tau / (1 + d / t)
RUN = 8  # back-to-back calls per greedy-step and GEMM sample


def ceiling(t_ms: float, d_ms: float, v_ms: float) -> float:
    """The largest speedup / goal ratio a loop with these step costs can reach, at any tau."""
    return (t_ms + d_ms) / (GOAL_FACTOR * (d_ms + v_ms))


def _positive_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"`{text}` is not a comma-separated list of integers") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"`{text}`: give one or more integers >= 1")
    return vals


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="The goal is reachable only where the printed ceiling is >= 1.")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "mps"), help="where to time (default cpu)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="weights and activations (default float32, the effectiveness bench's evaluation)")
    p.add_argument("--threads", type=_positive_list, default=[1, 2],
                   help="torch intra-op thread counts to time, comma-separated (default 1,2; CPU only)")
    p.add_argument("--hidden", type=int, default=256, help="target width (default 256)")
    p.add_argument("--layers", type=int, default=4, help="target depth (default 4)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    p.add_argument("--head-dim", type=int, default=0, help="head width (default hidden / heads)")
    p.add_argument("--intermediate", type=int, default=0, help="MLP width (default 3 x hidden)")
    p.add_argument("--vocab", type=int, default=2048, help="vocabulary (default 2048)")
    p.add_argument("--draft", default="tiny", choices=("tiny", "standard"),
                   help="draft geometry: `tiny` = the effectiveness bench's (default), `standard` = init-draft's")
    p.add_argument("--draft-layers", type=int, default=2, help="draft depth (default 2; `standard`: 5)")
    p.add_argument("--block-size", type=int, default=8, help="draft block = verified tokens per step (default 8)")
    p.add_argument("--accepted", type=int, default=0,
                   help="verified tokens whose features each draft step adds (default block / 2)")
    p.add_argument("--context", type=int, default=160, help="tokens already in the KV caches (default 160)")
    p.add_argument("--repeat", type=int, default=200, help="timed calls per figure (default 200)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    for name in ("hidden", "layers", "heads", "kv_heads", "vocab", "draft_layers", "context", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, found {getattr(args, name)}")
    if args.block_size < 2:
        p.error(f"--block-size must be >= 2 (one verified token and one proposal), found {args.block_size}")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    args.head_dim = args.head_dim or args.hidden // args.heads
    args.intermediate = args.intermediate or 3 * args.hidden
    args.accepted = args.accepted or max(1, args.block_size // 2)
    if not 1 <= args.accepted <= args.block_size:
        p.error(f"--accepted must be between 1 and --block-size {args.block_size}, found {args.accepted}")
    if args.device != "cpu":
        args.threads = args.threads[:1]
    return args


def build(args):
    """The random target and a fresh DFlash2 draft for it, on the device, in `--dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_worker.model import DraftConfig, build_draft
    from dflash_worker.model.geometry import plan_draft
    from dflash_worker.testing.tiny import tiny_qwen3_config
    from dflash_worker.testing.tiny_draft import tiny_dflash2_config

    dtype = getattr(torch, args.dtype)
    config = tiny_qwen3_config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                               num_hidden_layers=args.layers, num_attention_heads=args.heads,
                               num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                               max_position_embeddings=max(4096, 2 * (args.context + args.block_size)),
                               tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(args.device):
        target = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    if args.draft == "tiny":
        cfg = tiny_dflash2_config(config, num_hidden_layers=args.draft_layers, block_size=args.block_size,
                                  selector_top_k=min(8, args.vocab), selector_rank=16, mask_token_id=args.vocab - 1)
    else:
        with tempfile.TemporaryDirectory(prefix="dflash-verify-cost-") as tmp:
            config.save_pretrained(tmp)
            cfg = plan_draft(tmp, geometry="standard", layers=args.draft_layers, block_size=args.block_size,
                             mask_token_id=args.vocab - 1).config
    draft = build_draft(DraftConfig.from_dict(cfg, source="verify_cost draft"), device=args.device, dtype=dtype, seed=0)
    return target, draft.eval()


def measure(args, target, draft, threads: int) -> dict[str, Any]:
    """Median ms of each call at `threads` intra-op threads (see the module docstring)."""
    import torch

    from dflash_worker.device import now
    from dflash_worker.evaluate.speculate import _crop, _head, _target_cache
    from dflash_worker.model.draft import context_features

    if args.device == "cpu":
        torch.set_num_threads(threads)
    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(1)
    n, bs = args.context, args.block_size
    span = max(bs, RUN)
    ids = torch.randint(0, args.vocab - 1, (1, n + span), generator=g).to(dev)
    positions = torch.arange(n + span, device=dev)[None]
    head, embed_w = _head(target), target.get_input_embeddings().weight
    rows = sorted({1, 2, bs // 2, bs})  # bs >= 2
    w = target.model.layers[0].mlp.up_proj.weight
    gemm_in = {k: torch.randn(k, args.hidden, generator=g).to(dev, w.dtype) for k in (1, bs)}
    with torch.inference_mode():
        t_cache = _target_cache(target)
        out = target(ids[:, :n], position_ids=positions[:, :n], cache=t_cache, use_cache=True, logits_to_keep=1,
                     output_hidden_states=True)
        features = context_features(out.hidden_states, draft.target_layer_ids)
        d_cache = draft.new_cache()
        block = ids[:, n : n + bs].clone()
        # the draft's cache holds the prompt's context, as after the loop's first step
        draft.step(features[:, : n - args.accepted], draft.embed(block, embed_w), d_cache)
        d_len = n - args.accepted
        new_features = features[:, n - args.accepted :]

        def greedy_steps():  # greedy_generate's steps, the cache growing by one token each
            for j in range(RUN):
                target(ids[:, n + j : n + j + 1], position_ids=positions[:, n + j : n + j + 1], cache=t_cache,
                       use_cache=True)

        def target_call(k: int):  # exactly speculative_generate's verify
            target(block[:, :k], position_ids=positions[:, n : n + k], cache=t_cache, use_cache=True,
                   output_hidden_states=True)

        def draft_call():
            hidden = draft.step(new_features, draft.embed(block, embed_w), d_cache)[:, 1:]
            draft.propose(hidden, block[:, 0], head, 0.0, None)
            d_cache.crop(d_len)

        samples: dict[str, list[float]] = {}

        def timed(name: str, f, per: int = 1) -> None:
            t0 = now(dev)
            f()
            samples.setdefault(name, []).append((now(dev) - t0) / per)
            _crop(t_cache, n)  # untimed: back to the context (the loop's rollback is timed in its own phase)

        def runs(x):
            return lambda: [torch.nn.functional.linear(x, w) for _ in range(RUN)]

        for _ in range(2):  # untimed warm-up: allocations and dispatch caches
            for name, f, per in (("greedy", greedy_steps, RUN), ("draft", draft_call, 1),
                                 *((f"verify_{k}", lambda k=k: target_call(k), 1) for k in rows[1:]),
                                 *((f"gemm_{k}", runs(x), RUN) for k, x in gemm_in.items())):
                timed(name, f, per)
        samples.clear()
        for _ in range(args.repeat):
            # greedy decoding: target steps back to back (its weights stay in the caches)
            timed("target_1", greedy_steps, RUN)
            # the speculative loop: each draft step, then a verify, as in `speculative_generate`
            for k in rows[1:]:
                timed("draft" if k == bs else f"draft_{k}", draft_call)
                timed(f"target_{k}", lambda k=k: target_call(k))
            for k, x in gemm_in.items():
                timed(f"gemm_{k}", runs(x), RUN)
    ms = {name: 1000 * statistics.median(v) for name, v in samples.items()}
    t, v, d = ms["target_1"], ms[f"target_{bs}"], ms["draft"]
    gemm_flop = {k: 2.0 * k * args.hidden * args.intermediate for k in gemm_in}
    return {
        "threads": threads if args.device == "cpu" else None,
        "target_ms": {str(k): ms[f"target_{k}"] for k in rows},
        "draft_ms": d,
        "verify_over_step": v / t,
        "goal_needs_verify_over_step_at_most": (1 / GOAL_FACTOR) + (1 / GOAL_FACTOR - 1) * d / t,
        "ceiling": ceiling(t, d, v),
        "gemm_ms": {str(k): ms[f"gemm_{k}"] for k in gemm_in},
        "gemm_gflops": {str(k): gemm_flop[k] / (ms[f"gemm_{k}"] * 1e6) for k in gemm_in},
    }


def report(args, results: list[dict[str, Any]]) -> str:
    bs = args.block_size
    lines = [f"target: random Qwen3 hidden {args.hidden}, {args.layers} layers, MLP {args.intermediate}, vocab "
             f"{args.vocab}, {args.dtype} on {args.device}; draft: {args.draft} DFlash2, {args.draft_layers} layers, "
             f"block {bs}; KV cache {args.context} tokens; median of {args.repeat} calls; MKL_CBWR="
             f"{os.environ.get('MKL_CBWR', '')}", ""]
    ks = list(results[0]["target_ms"])
    lines.append("| threads | " + " | ".join(f"target {k} tok ms" for k in ks)
                 + f" | draft ms | verify / step | goal needs <= | ceiling | GEMM 1 / {bs} rows ms | GFLOP/s 1 / {bs} |")
    lines.append("|---" * (len(ks) + 7) + "|")
    for r in results:
        g, gf = r["gemm_ms"], r["gemm_gflops"]
        lines.append(f"| {r['threads'] if r['threads'] is not None else '-'} | "
                     + " | ".join(f"{r['target_ms'][k]:.3f}" for k in ks)
                     + f" | {r['draft_ms']:.3f} | {r['verify_over_step']:.2f} | "
                     f"{r['goal_needs_verify_over_step_at_most']:.2f} | {r['ceiling']:.3f} | "
                     f"{g['1']:.4f} / {g[str(bs)]:.4f} | {gf['1']:.1f} / {gf[str(bs)]:.1f} |")
    best = max(results, key=lambda r: r["ceiling"])
    where = f" ({best['threads']} thread{'s' if best['threads'] != 1 else ''})" if best["threads"] else ""
    reach = "reachable" if best["ceiling"] >= 1 else "NOT reachable"
    lines += ["", f"best ceiling {best['ceiling']:.3f}{where}: issue 16's speedup goal 0.8 x tau / (1 + d / t) is "
              f"{reach} here with this geometry, whatever the draft's acceptance (a {bs}-token verify costs "
              f"{best['verify_over_step']:.2f} greedy steps; the goal needs <= "
              f"{best['goal_needs_verify_over_step_at_most']:.2f}, before the loop's bookkeeping and prefill)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("MKL_CBWR", MKL_CBWR)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no CUDA device")
    if args.device == "mps" and not torch.backends.mps.is_available():
        raise SystemExit("--device mps, but torch sees no MPS device")
    t0 = time.perf_counter()
    target, draft = build(args)
    results = []
    for threads in args.threads:
        results.append(measure(args, target, draft, threads))
        print(f"[{time.perf_counter() - t0:6.1f}s] timed {threads if args.device == 'cpu' else args.device}",
              file=sys.stderr, flush=True)
    text = report(args, results)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: (str(v) if isinstance(v, Path) else v)
                                                  for k, v in vars(args).items()},
                                         "mkl_cbwr": os.environ.get("MKL_CBWR"), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
