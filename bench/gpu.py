"""The GPU check's benchmark (`scripts/gpu-check.sh`): capture, training and speculative generation on
a full-width random Qwen3 target with a DFlash2 draft of the released geometry, on 1 rank and on N.

Phases, each through the real CLI (`dflash-worker capture | train | evaluate`; N ranks under
`torch.distributed.run --standalone --nproc-per-node N`), each printed with its wall time:
1. build: a random Qwen3 target (`--hidden`, `--layers`; bf16, initialised on the device, saved as
   sharded safetensors) with the test tokenizer (a small vocabulary: the width and depth are what
   cost), a fresh draft (`init-draft --geometry standard`: 5 layers, block 16, the selector),
   rows and prepared data;
2. capture on 1 rank, then on N ranks into a second directory: examples/s and tokens/s, the
   teacher's peak memory (the manifest's `peak_memory`, rank 0's), and whether the two captures
   hold the same shard bytes (bf16 kernels on GPUs may differ in the last bit: reported, not
   required);
3. train the same global batch on 1 rank and on N: tokens/s (median over the steps after the
   first, `metrics.jsonl`) and the scaling ratio; `preflight` gives the training peak memory;
4. evaluate the N-rank run: real speculative generation with the released and the trained draft,
   pooled acceptance length, and the committed tokens over the command's wall time.

On CPU it runs too, with small sizes and `DFLASH_CPU_RANKS=1` (`--device cpu --ranks 2 --hidden 64 --layers 2 ...`).

Usage: .venv/bin/python bench/gpu.py [--device cuda] [--ranks N] [--hidden 4096] [--layers 36] ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLI = [sys.executable, "-m", "dflash_worker.cli"]


def _torchrun(ranks: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m", "dflash_worker.cli"]


def _run(cmd: list[str], env: dict[str, str]) -> tuple[str, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout, time.perf_counter() - t0


def _gib(n: float | int | None) -> str:
    return "n/a" if not n else f"{n / 2**30:.2f} GiB"


def build_target(path: Path, args) -> None:
    """A random Qwen3 of the asked width and depth, initialised on the device in bf16 (fast even at 8B)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_worker.testing.tiny import tiny_qwen3_config
    from dflash_worker.testing.tokenizer import IM_END, PAD_TOKEN, build_tiny_tokenizer, save_tiny_tokenizer

    tok = build_tiny_tokenizer()
    heads = max(1, args.hidden // args.head_dim)
    config = tiny_qwen3_config(
        vocab_size=len(tok), eos_token_id=tok.convert_tokens_to_ids(IM_END), pad_token_id=tok.convert_tokens_to_ids(PAD_TOKEN),
        bos_token_id=None, hidden_size=args.hidden, intermediate_size=args.intermediate or 3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
        head_dim=args.head_dim, max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    with torch.device(args.device if args.device != "cuda" else "cuda:0"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(path), max_shard_size="4GB")
    save_tiny_tokenizer(path, tok)
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()


def write_recipe(root: Path, args, capture: str, run: str) -> Path:
    recipe = root / f"recipe-{capture}.toml"
    recipe.write_text(f"""
[model]
target = "{root / 'target'}"
draft = "{root / 'draft'}"
family = "qwen3"

[data]
dir = "{root / 'data'}"
thinking = "off"
max_length = {args.max_length}

[capture]
output = "{root / capture}"
dtype = "bfloat16"
device = "{args.device}"
shard_examples = {args.shard_examples}

[train]
scope = "full"
steps = {args.steps}
lr = 3e-4
grad_accum = {args.grad_accum}
blocks_per_sequence = {args.blocks}
checkpoint_every = {args.steps}
val_every = {args.steps}
val_examples = 2
device = "{args.device}"
output = "{root / run}"

[evaluate]
max_new_tokens = {args.new_tokens}
device = "{args.device}"
""")
    return recipe


def _shard_hashes(manifest: dict) -> list[str]:
    return [s["sha256"] for s in manifest["shards"]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="where every phase runs (default cuda)")
    p.add_argument("--ranks", type=int, default=0, help="ranks of the multi-rank arm (default: every GPU; on CPU 2)")
    p.add_argument("--hidden", type=int, default=4096, help="target width (default 4096)")
    p.add_argument("--layers", type=int, default=36, help="target depth (default 36)")
    p.add_argument("--head-dim", type=int, default=128, help="attention head width (default 128)")
    p.add_argument("--intermediate", type=int, default=0, help="target MLP width (default 3 x hidden)")
    p.add_argument("--examples", type=int, default=256, help="rows (default 256)")
    p.add_argument("--max-length", type=int, default=512, help="[data].max_length (default 512)")
    p.add_argument("--shard-examples", type=int, default=16, help="examples per capture shard (default 16)")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per training run (default 12)")
    p.add_argument("--grad-accum", type=int, default=16, help="sequences per step, split over the ranks (default 16)")
    p.add_argument("--blocks", type=int, default=8, help="anchored blocks per sequence (default 8)")
    p.add_argument("--block-size", type=int, default=16, help="draft block size (default 16, the released one)")
    p.add_argument("--geometry", default="standard", help="draft geometry for init-draft (default standard)")
    p.add_argument("--prompts", type=int, default=8, help="evaluation prompts (default 8)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    p.add_argument("--keep", type=Path, help="work here and keep the files (default: a temporary directory)")
    args = p.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no CUDA device")
    ranks = args.ranks or (torch.cuda.device_count() if args.device == "cuda" else 2)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if args.device == "cpu":
        env.update(DFLASH_CPU_RANKS="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    with tempfile.TemporaryDirectory(prefix="dflash-bench-gpu-") as tmp:
        root = (args.keep or Path(tmp)).resolve()
        root.mkdir(parents=True, exist_ok=True)
        results = run_phases(root, args, ranks, env)
    print(json.dumps(results, sort_keys=True))
    return 0


def run_phases(root: Path, args, ranks: int, env: dict[str, str]) -> dict:
    from dflash_worker.data import prepare_data
    from dflash_worker.testing.world import write_rows

    out: dict = {"device": args.device, "ranks": ranks, "hidden": args.hidden, "layers": args.layers}
    if args.device == "cuda":
        import torch

        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    t0 = time.perf_counter()
    build_target(root / "target", args)
    _run([*CLI, "init-draft", "--target", str(root / "target"), "--geometry", args.geometry, "--block-size",
          str(args.block_size), "-o", str(root / "draft")], env)
    rows = write_rows(root / "rows.jsonl", examples=args.examples, seed=0)
    prepare_data([rows], root / "data", seed=0, val_fraction=0.05, test_fraction=max(0.05, 1.5 * args.prompts / args.examples))
    out["build_seconds"] = round(time.perf_counter() - t0, 1)
    print(f"build: target hidden {args.hidden} x {args.layers} layers (bf16), draft `{args.geometry}` "
          f"block {args.block_size}: {out['build_seconds']} s", flush=True)

    one, many = write_recipe(root, args, "capture-1", "run-1"), write_recipe(root, args, f"capture-{ranks}", f"run-{ranks}")
    arms = ((1, one),) if ranks == 1 else ((1, one), (ranks, many))  # one GPU: the 1-rank arm alone
    caps = {}
    for n, recipe in arms:
        stdout, secs = _run([*(CLI if n == 1 else _torchrun(n)), "capture", "--recipe", str(recipe), "--json"], env)
        manifest = json.loads(stdout)
        examples = sum(s["examples"] for s in manifest["shards"])
        tokens = sum(s["tokens"] for s in manifest["shards"])
        caps[n] = manifest
        mem = manifest["run"].get("peak_memory") or {}
        peak = mem.get("bytes") or mem.get("process_max_rss_bytes")
        out[f"capture_{n}"] = {"seconds": round(secs, 1), "examples_per_s": examples / secs if secs else 0.0,
                               "tokens_per_s": tokens / secs if secs else 0.0, "peak_bytes": peak}
        print(f"capture, {n} rank(s): {secs:.1f} s, {examples / secs:.2f} examples/s, {tokens / secs:,.0f} tokens/s "
              f"(process start and teacher load included), peak {_gib(peak)} (rank 0)", flush=True)
    if ranks > 1:
        same = _shard_hashes(caps[1]) == _shard_hashes(caps[ranks])
        out["capture_same_bytes"] = same
        print(f"capture shards on {ranks} ranks byte-identical to 1 rank: {same}", flush=True)

    stdout, _ = _run([*CLI, "preflight", "--recipe", str(one), "--json"], env)
    pre = json.loads(stdout)
    out["preflight"] = {k: pre[k] for k in ("verdict", "reason", "sequence_length")}
    out["preflight"].update(capture_peak_bytes=pre["capture_peak"]["bytes"], train_peak_bytes=pre["optimization_peak"]["bytes"])
    print(f"preflight, one training step at length {pre['sequence_length']}: teacher peak {_gib(pre['capture_peak']['bytes'])}, "
          f"training peak {_gib(pre['optimization_peak']['bytes'])} ({pre['optimization_peak']['what']}); {pre['verdict']}", flush=True)
    rates = {}
    for n, recipe in arms:
        run_dir = root / f"run-{n}"
        _, secs = _run([*(CLI if n == 1 else _torchrun(n)), "train", "--recipe", str(recipe)], env)
        lines = [json.loads(raw) for raw in (run_dir / "metrics.jsonl").read_text().splitlines() if raw.strip()]
        assert all(x["world_size"] == n for x in lines), "metrics.jsonl world_size"
        rates[n] = statistics.median(x["tokens_per_s"] for x in lines[1:]) if len(lines) > 1 else lines[0]["tokens_per_s"]
        out[f"train_{n}"] = {"seconds": round(secs, 1), "tokens_per_s": rates[n]}
        print(f"train, {n} rank(s): {rates[n]:,.0f} tokens/s (median over steps 2-{len(lines)}), {secs:.1f} s in all", flush=True)
    if ranks > 1:
        out["train_scaling"] = rates[ranks] / rates[1]
        print(f"training scaling {ranks} ranks / 1 rank: x{out['train_scaling']:.2f} (ideal x{ranks:.2f})", flush=True)
    else:
        print("training scaling: one GPU, no multi-rank arm", flush=True)

    stdout, secs = _run([*CLI, "evaluate", "--run", str(root / f"run-{ranks}"), "--split", "test", "--max-prompts",
                         str(args.prompts), "--json"], env)
    report = json.loads(stdout)
    for arm in ("baseline", "trained"):
        r = report[arm]
        out[f"evaluate_{arm}"] = {"tau_pooled": r["tau_pooled"], "committed_tokens": r["committed_tokens"], "verify_steps": r["verify_steps"]}
        print(f"evaluate, {arm} draft: tau (pooled) {r['tau_pooled']:.3f} over {r['verify_steps']} verify steps", flush=True)
    committed = sum(report[arm]["committed_tokens"] for arm in ("baseline", "trained"))
    print(f"evaluate: {report['prompts']} prompts x 2 drafts, {committed} tokens in {secs:.1f} s "
          f"({committed / secs:,.1f} tokens/s, process start and model loads included)", flush=True)
    out["evaluate_seconds"] = round(secs, 1)
    return out


if __name__ == "__main__":
    sys.exit(main())
