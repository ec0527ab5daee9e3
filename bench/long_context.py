"""Long contexts (issue 53): the `--lengths` mode of bench/capture.py and bench/train.py.

For each tiny target (the hybrid `qwen3_5` and the dense `qwen3`, built by the tiny-world builder
in a temporary dir) and each length, two measurements, each in its own subprocess so that one's
peak never mixes into the other's:

- baseline: transformers' own plain forward of the same target at the same length
  (``model(ids, output_hidden_states=True, use_cache=False, logits_to_keep=1)``);
- capture (bench/capture.py): `capture.teacher.Teacher.features`, the forward capture runs per
  example (chunked by `--chunk-tokens`, only the tap hidden states kept);
- train (bench/train.py): one online training step at that length: `Teacher.features` beside the
  draft, then the draft's forward, loss, backward and AdamW update over `--blocks` anchored blocks.

`--length-repeats R` runs R alternating rounds of both children per length and keeps the fastest
run of each (its peak with it). Each child loads the model, runs one 128-token warm-up, then resets the process peak (Linux VmHWM
through /proc/self/clear_refs, as preflight measures) and times one run. Printed per length: the
RSS after the load, the peak during the run, their difference (what the run adds above the
loaded model and process: `added`), seconds and microseconds per token, and the ratios: ours over
the baseline (time, added memory) and each length's added memory over the first length's. Goals
(issue 53): added memory grows at most linearly (16k/2k <= 8.5x); capture time <= 1.2x the plain
forward at every length.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FAMILIES = ("qwen3_5", "qwen3")


def add_arguments(ap) -> None:
    ap.add_argument("--lengths", default=None, metavar="L1,L2,...",
                    help="long-context mode (bench/long_context.py): e.g. 2048,4096,8192,16384")
    ap.add_argument("--chunk-tokens", type=int, default=2048, help="--lengths: `[capture].chunk_tokens`")
    ap.add_argument("--families", default=",".join(FAMILIES), help="--lengths: tiny targets to measure")
    ap.add_argument("--length-repeats", type=int, default=1,
                    help="--lengths: rounds of (baseline, ours) children per length; the fastest run of each is kept")


def build(root: Path, family: str) -> Path:
    """A tiny world of `family` (target + draft) whose rope reaches past the longest length."""
    from dflash_worker.testing.world import build_world

    return build_world(root / family, examples=1, family=family, max_position_embeddings=131_072).root


def run(args, mode: str) -> int:
    """The parent: build the targets, run every (family, length, variant) child, print the table."""
    lengths = [int(x) for x in args.lengths.split(",")]
    threads = getattr(args, "threads", 1) or 1
    print(f"mode {mode}, chunk_tokens {args.chunk_tokens}, torch threads {threads}, lengths {lengths}, "
          f"each measurement in its own process; peak = VmHWM reset after load; added = peak - rss after load", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            world = build(Path(tmp), family)
            rows = []
            for L in lengths:
                runs = [(_child(world, "plain", L, args, threads), _child(world, mode, L, args, threads))
                        for _ in range(args.length_repeats)]  # alternating: a load burst falls on both
                rows.append((L, min((b for b, _ in runs), key=_secs), min((o for _, o in runs), key=_secs)))
            _print(family, mode, rows, world)
    return 0


def _secs(run: dict) -> float:
    return run["seconds"]


def _child(world: Path, mode: str, length: int, args, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, str(world), str(length), str(args.chunk_tokens), str(threads),
           str(getattr(args, "blocks", 16))]
    res = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"TOKENIZERS_PARALLELISM": "false"})
    if res.returncode != 0:
        raise SystemExit(f"child {mode} at {length} failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _print(family: str, mode: str, rows: list, world: Path) -> None:
    mib = 2**20
    print(f"\n{family} (tiny: {rows[0][1]['model_bytes'] / mib:.2f} MiB of weights; {world.name})")
    print(f"{'length':>7} | {'plain: rss MiB':>14} {'peak':>7} {'added':>7} {'s':>7} {'us/tok':>7} | "
          f"{mode + ': rss':>10} {'peak':>7} {'added':>7} {'s':>7} {'us/tok':>7} | "
          f"{'time x plain':>12} {'added x plain':>13} | {'added / first length':>20} (plain, {mode})")
    first = rows[0]
    for L, b, o in rows:
        fb, fo = first[1]["added"], first[2]["added"]
        print(f"{L:>7} | {b['rss_loaded'] / mib:>14.1f} {b['peak'] / mib:>7.1f} {b['added'] / mib:>7.1f} {b['seconds']:>7.2f} "
              f"{1e6 * b['seconds'] / L:>7.1f} | {o['rss_loaded'] / mib:>10.1f} {o['peak'] / mib:>7.1f} {o['added'] / mib:>7.1f} "
              f"{o['seconds']:>7.2f} {1e6 * o['seconds'] / L:>7.1f} | {o['seconds'] / b['seconds']:>12.3f} "
              f"{o['added'] / max(b['added'], 1):>13.3f} | {b['added'] / max(fb, 1):>9.2f}, {o['added'] / max(fo, 1):>8.2f}")
    last = rows[-1]
    if len(rows) > 1:
        growth = last[2]["added"] / max(first[2]["added"], 1)
        print(f"goal: {mode} added memory {last[0]}/{first[0]} = {growth:.2f}x (<= {8.5 * last[0] / first[0] / 8:.1f}x); "
              f"{mode} time / plain forward: max {max(o['seconds'] / b['seconds'] for _, b, o in rows):.3f} (<= 1.2)")


# --------------------------------------------------------------------- the child process
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(mode: str, world: str, length: int, chunk: int, threads: int, blocks: int) -> None:
    import torch

    torch.set_num_threads(threads)
    from dflash_worker.model.io import read_target_layer_ids
    from dflash_worker.train.preflight import _PeakRSS

    target, draft = Path(world) / "target", Path(world) / "draft"
    layer_ids = read_target_layer_ids(draft)
    gen = torch.Generator().manual_seed(0)
    if mode == "plain":
        from dflash_worker.weights import load_model

        model = load_model(target, device="cpu", dtype=torch.float32).eval()

        def once(ids: list[int]) -> None:
            with torch.inference_mode():
                out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False, logits_to_keep=1)
                _ = out.hidden_states[-1][0, -1, 0].item()
    else:
        from dflash_worker.capture.teacher import Teacher

        teacher = Teacher.load(target, layer_ids, device="cpu", dtype="float32", chunk_tokens=chunk)
        model = teacher.model
        once = teacher.features if mode == "capture" else _train_step(teacher, draft, target, blocks, gen)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (length,), generator=gen).tolist()
    once(ids[:128])  # one-time kernel setup, outside the measurement
    loaded = _rss()
    with _PeakRSS() as peak:
        t = time.perf_counter()
        once(ids)
        seconds = time.perf_counter() - t
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"rss_loaded": loaded, "peak": peak.peak, "added": peak.peak - loaded, "seconds": seconds,
                      "model_bytes": model_bytes, "method": peak.method}))


def _train_step(teacher, draft_dir: Path, target: Path, blocks: int, gen):
    """One online training step (features, draft forward, loss, backward, AdamW) as a function of ids."""
    import torch

    from dflash_worker.model import load_draft
    from dflash_worker.train.data import sample_anchors
    from dflash_worker.train.objectives import block_labels, position_weights, token_loss_sum, weight_total
    from dflash_worker.train.params import load_target_head

    model = load_draft(draft_dir, device="cpu", dtype=torch.float32)
    head = load_target_head(target, device="cpu", dtype=torch.float32)
    opt = torch.optim.AdamW(list(model.parameters()), lr=1e-4)
    pw = position_weights(model.block_size, None)

    def step(ids: list[int]) -> None:
        x = torch.tensor(ids)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[len(ids) // 8 :] = True
        feats = teacher.features(ids).clone()[None]
        anchors = sample_anchors(mask, blocks, 0)
        labels, valid = block_labels(x, mask, anchors, model.block_size)
        emb = model.embed(model.make_blocks(x[None], anchors[None]), head.embed)
        hidden = model.forward_blocks(feats, anchors[None], emb, attention="sdpa")
        logits = model.logits(hidden[0, :, 1:], head.head)
        loss = token_loss_sum(logits, labels, valid, pw, "weighted_ce") / max(weight_total(valid, pw), 1e-9)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--child":
    m, w, n, c, th, b = sys.argv[2:8]
    child(m, w, int(n), int(c), int(th), int(b))
