"""Capture throughput vs a plain teacher forward with `output_hidden_states`, in one run.

Baseline: the same teacher (same loader, dtype, device) runs the same token ids,
one example at a time, with ``output_hidden_states=True`` and the features
discarded. Capture: `run_capture` over the same prepared data (rendering, feature
concat, dtype cast, safetensors encoding, sha256, atomic shard writes). Both
loops are timed from the first example to the last committed shard (teacher
load excluded; the one-off release (del + gc.collect) and capture's end-to-end
time, which adds data checks, file hashing and the load, are printed separately).
Baseline and capture alternate `--repeats` times; the median and the best of each
are compared, so background load on a shared machine hurts both alike.

    .venv/bin/python bench/capture.py [--examples 32] [--dtype float32] [--threads 1] [--repeats 3]

Goal: capture overhead <= 10% over the baseline forward.

`--lengths 2048,4096,8192,16384`: long contexts instead (bench/long_context.py): peak RSS and time
per token of the capture forward (chunked by `--chunk-tokens`) beside transformers' plain forward of
the same tiny hybrid (`qwen3_5`) and dense (`qwen3`) targets at each length, each in its own process.

    .venv/bin/python bench/capture.py --lengths 2048,4096,8192,16384 [--chunk-tokens 2048]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch


def build(root: Path, n_examples: int, hidden: int, layers: int):
    from dflash_worker.data import prepare_data
    from dflash_worker.testing.tokenizer import corpus_lines, save_tiny_target_with_tokenizer

    target = root / "target"
    _, tok = save_tiny_target_with_tokenizer(
        target, family="qwen3", hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8, max_position_embeddings=4096,
        max_shard_size="50MB",
    )
    from transformers import AutoConfig

    from dflash_worker.testing.tiny import save_tiny_dflash2_draft

    draft = root / "draft"
    ids = sorted({1, layers // 2, layers - 2})
    save_tiny_dflash2_draft(draft, AutoConfig.from_pretrained(target), target_layer_ids=ids)
    lines = corpus_lines(n_examples * 12, seed=11)
    rows = []
    for i in range(n_examples):
        chunk = lines[i * 12 : (i + 1) * 12]
        rows.append({"prompt": " ".join(chunk[:3]), "response": " ".join(chunk[3:])})
    src = root / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare_data([src], root / "prepared", val_fraction=0.0, test_fraction=0.0)
    return target, draft, tok, ids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=32, help="number of examples (default 32)")
    ap.add_argument("--hidden", type=int, default=256, help="teacher hidden size (default 256)")
    ap.add_argument("--layers", type=int, default=6, help="teacher layers (default 6)")
    ap.add_argument("--dtype", default="float32", choices=("bfloat16", "float32", "float16"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shard-examples", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="alternating baseline/capture rounds (best kept)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: on a small shared CPU, spinning OpenMP threads distort timings)")
    import long_context

    long_context.add_arguments(ap)
    args = ap.parse_args()
    if args.lengths:
        return long_context.run(args, "capture")
    torch.set_num_threads(args.threads)

    from dflash_worker.capture import run_capture
    from dflash_worker.data import PreparedData, render_example
    from dflash_worker.device import synchronize
    from dflash_worker.recipe import load_recipe
    from dflash_worker.weights import load_model

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        target, draft, tok, layer_ids = build(root, args.examples, args.hidden, args.layers)
        prepared = PreparedData(root / "prepared")
        seqs = [render_example(tok, ex.messages, thinking="off").input_ids for ex in prepared.examples(("train",))]
        tokens = sum(len(s) for s in seqs)
        dtype = getattr(torch, args.dtype)

        def recipe(out: Path) -> Path:
            p = root / f"{out.name}.toml"
            p.write_text(
                f'[model]\ntarget = "{target}"\ndraft = "{draft}"\nfamily = "qwen3"\n'
                f'[data]\ndir = "{root / "prepared"}"\nthinking = "off"\nmax_length = 4096\n'
                f'[capture]\noutput = "{out}"\ndtype = "{args.dtype}"\nshard_examples = {args.shard_examples}\n'
                f'device = "{args.device}"\nsplits = ["train"]\n'
            )
            return p

        def baseline() -> float:
            model = load_model(target, device=args.device, dtype=dtype)
            with torch.inference_mode():  # no warm-up: capture's loop also starts cold after the load
                synchronize(args.device)
                t = time.perf_counter()
                for s in seqs:
                    out = model(input_ids=torch.tensor([s], device=args.device), output_hidden_states=True, use_cache=False, logits_to_keep=1)
                    _ = out.hidden_states[-1][0, -1, 0].item()  # force completion without keeping features
                synchronize(args.device)
                dt = time.perf_counter() - t
            del model
            return dt

        def capture(i: int) -> tuple[float, float, dict]:
            marks: dict[str, float] = {}

            def on_event(e) -> None:
                # capture's milestones are `Log` events (dflash_worker.capture.run docstring)
                msg = getattr(e, "message", "")
                if msg.startswith("teacher loaded in"):
                    marks["start"] = time.perf_counter()
                elif msg.endswith("shards committed"):
                    marks["end"] = time.perf_counter()
                elif msg == "teacher released" or msg.startswith("the teacher is still referenced"):
                    marks["released"] = time.perf_counter()

            t = time.perf_counter()
            m = run_capture(load_recipe(recipe(root / f"cap{i}")), on_event=on_event)
            release_times.append(marks["released"] - marks["end"])
            return marks["end"] - marks["start"], time.perf_counter() - t, m

        base_times, cap_times, e2e_times, release_times = [], [], [], []
        manifest = None
        for i in range(args.repeats):
            base_times.append(baseline())
            loop, e2e, manifest = capture(i)
            cap_times.append(loop)
            e2e_times.append(e2e)
        b, c, e = min(base_times), min(cap_times), min(e2e_times)

        # Components of the overhead, timed on their own (less sensitive to background load):
        # rendering every example, and encoding + hashing + writing + fsyncing every shard.
        t = time.perf_counter()
        for ex in prepared.examples(("train",)):
            render_example(tok, ex.messages, thinking="off")
        render_s = time.perf_counter() - t
        from dflash_worker.capture.shards import _commit_shard

        items = [{"index": i, "split": "train", "id": str(i), "ids": s, "mask": [1] * len(s),
                  "features": torch.zeros(len(s), len(layer_ids) * args.hidden, dtype=dtype)} for i, s in enumerate(seqs)]
        scratch = root / "scratch"
        scratch.mkdir()
        t = time.perf_counter()
        for k in range(0, len(items), args.shard_examples):
            part = items[k : k + args.shard_examples]
            side = {"capture_key": "bench", "shard": k, "file": f"shard-{k:05d}.safetensors", "first": k, "end": k + len(part),
                    "examples": len(part), "tokens": sum(len(x["ids"]) for x in part), "loss_tokens": 0, "generation_truncated": 0}
            _commit_shard(scratch, part, {"bench": True}, side)
        write_s = time.perf_counter() - t
        feat = len(layer_ids) * args.hidden * torch.tensor([], dtype=dtype).element_size()
        per_tok = manifest["totals"]["payload_bytes"] / manifest["totals"]["tokens"]
        print(f"device {args.device}, dtype {args.dtype}, teacher hidden {args.hidden} x {args.layers} layers, "
              f"layer ids {layer_ids}, {len(seqs)} examples, {tokens} tokens, torch threads {torch.get_num_threads()}")
        print(f"baseline forward (output_hidden_states): {b:.3f} s  {tokens / b:9.1f} tok/s   (runs: {', '.join(f'{x:.3f}' for x in base_times)})")
        print(f"capture loop (forward + cache writes):   {c:.3f} s  {tokens / c:9.1f} tok/s   (runs: {', '.join(f'{x:.3f}' for x in cap_times)})")
        print(f"capture end to end (checks, hashing, load, loop, manifest): {e:.3f} s  {tokens / e:9.1f} tok/s")
        print(f"teacher release after the loop (del + gc.collect, once per capture): {min(release_times):.3f} s")
        import statistics

        bm, cm = statistics.median(base_times), statistics.median(cap_times)
        print(f"capture loop / baseline time, median of runs: {cm / bm:.3f}  (overhead {100 * (cm / bm - 1):+.1f}%, goal <= +10%)")
        print(f"capture loop / baseline time, best of runs:   {c / b:.3f}  (overhead {100 * (c / b - 1):+.1f}%)")
        print(f"components: rendering {render_s:.3f} s ({100 * render_s / b:.1f}% of baseline), "
              f"shard encode+sha256+write+fsync {write_s:.3f} s ({100 * write_s / b:.1f}% of baseline; runs on a writer "
              f"thread overlapping the forward passes)")
        print(f"cache bytes per token: {per_tok:.1f}  (features {feat} + ids 4 + mask 1 = {feat + 5}; ratio {per_tok / (feat + 5):.3f})")
        print(f"peak memory (labelled peak): {manifest['run']['peak_memory']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
