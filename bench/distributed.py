"""Data-parallel scaling: training tokens/s with 2 gloo ranks (1 thread each) vs 1 rank (1 thread).

Both arms train the same recipe (the same global batch: `grad_accum` sequences per step, the same
sample order) on one capture of a tiny world built here, through the real CLI: `dflash-worker train`
for one rank, under `torch.distributed.run --nproc-per-node 2` for two (`DFLASH_CPU_RANKS=1`). The
runs alternate (1, 2, 1, 2, ...) so drift in machine load hits both arms alike. Tokens/s per run is
the median over its steps after the first of `metrics.jsonl`'s `tokens_per_s` (block positions of
the whole step over rank 0's step time); the figure per arm is the median over runs. Prints the
scaling ratio 2-rank / 1-rank (the ideal on 2 free cores is 2.0) and the load average before and
after, since another busy process on a 2-core machine takes a rank's core.

Usage: .venv/bin/python bench/distributed.py [--repeats N] [--steps N] [--grad-accum N] [--hidden H]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def build(root: Path, args) -> Path:
    """A target of width `hidden`, a fresh tiny-geometry draft, prepared rows and their capture; returns the recipe."""
    import torch

    from dflash_worker.capture import run_capture
    from dflash_worker.data import prepare_data
    from dflash_worker.model.geometry import plan_draft, write_fresh_draft
    from dflash_worker.recipe import load_recipe
    from dflash_worker.testing.tokenizer import save_tiny_target_with_tokenizer
    from dflash_worker.testing.world import write_rows

    torch.set_num_threads(1)
    H = args.hidden
    save_tiny_target_with_tokenizer(root / "target", hidden_size=H, intermediate_size=2 * H, num_attention_heads=H // 16,
                                    num_key_value_heads=H // 32, head_dim=16, num_hidden_layers=4)
    write_fresh_draft(plan_draft(root / "target", geometry="tiny", block_size=args.block_size), root / "draft")
    rows = write_rows(root / "rows.jsonl", examples=args.examples, seed=0)
    prepare_data([rows], root / "data", seed=0, val_fraction=0.1, test_fraction=0.0)
    recipe = root / "recipe.toml"
    recipe.write_text(f"""
[model]
target = "{root / 'target'}"
draft = "{root / 'draft'}"
family = "qwen3"

[data]
dir = "{root / 'data'}"
thinking = "off"
max_length = 256

[capture]
output = "{root / 'capture'}"
dtype = "float32"
device = "cpu"

[train]
scope = "full"
steps = {args.steps}
lr = 1e-3
grad_accum = {args.grad_accum}
blocks_per_sequence = {args.blocks}
checkpoint_every = {args.steps}
val_every = 0
val_examples = 1
device = "cpu"
""")
    run_capture(load_recipe(recipe))
    return recipe


def train_once(recipe: Path, run: Path, ranks: int, python_cmd: list[str] | None = None) -> float:
    """Median tokens/s over the steps after the first of one training run; `python_cmd` stands for
    `python` (each rank's command under `torchrun --no-python`)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", DFLASH_CPU_RANKS="1", PYTHONWARNINGS="ignore")
    cli = ["-m", "dflash_worker.cli", "train", "--recipe", str(recipe), "--run-dir", str(run)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    if python_cmd:
        cmd = [*python_cmd, *cli] if ranks == 1 else [*torchrun, "--no-python", *python_cmd, *cli]
    else:
        cmd = [sys.executable, *cli] if ranks == 1 else [*torchrun, *cli]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    lines = [json.loads(raw) for raw in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(x["world_size"] == ranks for x in lines)
    return statistics.median(x["tokens_per_s"] for x in lines[1:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="runs per arm, alternating (default 3)")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per run (default 8)")
    p.add_argument("--grad-accum", type=int, default=32, help="sequences per step, split over the ranks (default 32)")
    p.add_argument("--blocks", type=int, default=8, help="anchored blocks per sequence (default 8)")
    p.add_argument("--block-size", type=int, default=8, help="draft block size (default 8)")
    p.add_argument("--hidden", type=int, default=256, help="target and draft width (default 256)")
    p.add_argument("--examples", type=int, default=48, help="rows in the tiny world (default 48)")
    p.add_argument("--python-cmd", metavar="CMD", help="the command that stands for `python` in each training run "
                   "(given `-m dflash_worker.cli train ...`; each rank's under `torchrun --no-python`); the smoke test "
                   "passes a stand-in that forks a pre-warmed interpreter, so its rates mean nothing")
    args = p.parse_args(argv)
    python_cmd = shlex.split(args.python_cmd) if args.python_cmd else None

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="dflash-bench-dist-") as tmp:
        root = Path(tmp)
        recipe = build(root, args)
        rates: dict[int, list[float]] = {1: [], 2: []}
        for i in range(args.repeats):
            for ranks in (1, 2):
                rate = train_once(recipe, root / f"run-{ranks}-{i}", ranks, python_cmd)
                rates[ranks].append(rate)
                print(f"run {i + 1}/{args.repeats}, {ranks} rank(s): {rate:,.0f} tokens/s", flush=True)
    load_after = os.getloadavg()
    one, two = statistics.median(rates[1]), statistics.median(rates[2])
    print(f"global batch: {args.grad_accum} sequences x {args.blocks} blocks x {args.block_size} positions; "
          f"hidden {args.hidden}; {args.steps} steps per run; {os.cpu_count()} CPUs")
    print(f"1 rank  (1 thread):          {one:,.0f} tokens/s (median of {args.repeats} runs)")
    print(f"2 ranks (1 thread each, gloo): {two:,.0f} tokens/s (median of {args.repeats} runs)")
    print(f"scaling 2 ranks / 1 rank: x{two / one:.2f} (ideal x2.00; goal >= x1.70 on 2 quiet cores)")
    print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}; "
          f"after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
