"""Benchmark: streamed loader vs `transformers.from_pretrained` on a >= 1 GiB bf16 Qwen3 checkpoint.

Builds (once, cached under ``bench/out/``) a sharded bf16 checkpoint with the
geometry of Qwen3-0.6B (a real ``Qwen3Config``: 28 layers, hidden 1024, vocab
151936, tied embeddings) and random weights; then loads it with
`dflash_worker.weights.load_model` (its CPU default: copy-on-write mapped
shards), with ``load_model(mmap=False)`` (private copies) and with
``AutoModelForCausalLM.from_pretrained(dtype=bfloat16)``, each in its own fresh
subprocess. The goal is stated for the default; the copy mode is printed so
its cost is on record too.

Timed region, identical for all three: load + touch every weight (a sum over
each parameter and buffer). The model class is imported before the timer for
all. transformers 5 and our default memory-map bf16 tensors, so the touch is
inside the timing. Peak RSS is
measured over the process's baseline taken after imports, by a psutil sampling
thread (every 2 ms) and by ``getrusage(RUSAGE_SELF).ru_maxrss``; the larger is
reported, divided by the checkpoint's tensor bytes.

Page cache: each loader runs once unmeasured to warm the cache, then the
measured rounds run the loaders in alternating order (forward, then reversed)
so no loader always gets the colder cache; the median of the runs is reported.

``--cold`` measures cold loads instead: the page cache is dropped
(``/proc/sys/vm/drop_caches``, Linux, root) before every run and there is no
warm-up.

Usage: .venv/bin/python bench/load.py [--runs 5] [--cold] [--rebuild]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
CKPT = OUT / "qwen3-0.6b-geometry-random-bf16"
SHARD_BYTES = 300 * 1024 * 1024
KINDS = ("ours", "ours-copy", "transformers")

# Qwen3-0.6B geometry (public config of Qwen/Qwen3-0.6B).
QWEN3_06B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    bos_token_id=151643,
    eos_token_id=151645,
)


def build_checkpoint(path: Path) -> None:
    """Write a sharded bf16 checkpoint with random weights, the layout `save_pretrained` produces."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**QWEN3_06B, dtype="bfloat16")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    shapes.pop("lm_head.weight")  # tied: save_pretrained omits it too
    tmp = path.with_name(path.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = 2 * int(torch.Size(shape).numel())
        if groups[-1] and size + n > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    weight_map = {}
    total = 0
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in names:
            t = torch.randn(shapes[name], generator=gen, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)
            tensors[name] = t
            weight_map[name] = fname
            total += t.numel() * 2
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        del tensors
        print(f"  wrote {fname}", file=sys.stderr)
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    config.save_pretrained(str(tmp))
    tmp.rename(path)


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def touch(tensors):
    import torch

    acc = torch.zeros((), dtype=torch.float32)
    with torch.no_grad():
        for p in tensors:
            # sum in the tensor's dtype (accumulated in fp32 internally); `sum(dtype=float32)`
            # would materialise an fp32 copy of each tensor and distort peak RSS
            acc += p.sum().float()
    return acc


def worker(kind: str, path: Path) -> None:
    """Child process: import, take a baseline, then load + touch under timing; print one JSON line."""
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    # Import the model class before the baseline and the timer, for both loaders:
    # its import (~2-7 s) is not loading.
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM  # noqa: F401

    from dflash_worker.weights import load_model
    from dflash_worker.weights import stream as _stream  # noqa: F401

    # Run the touch once on small tensors so its kernels' code is paged in (matters with --cold).
    touch([torch.ones(1 << 16, dtype=dt) for dt in (torch.bfloat16, torch.float32)])
    baseline = _rss()
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = [baseline]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    c0 = time.process_time()  # all threads, user + system
    if kind == "ours":
        model = load_model(path, dtype=torch.bfloat16)
        assert model.load_report.bytes_mapped == model.load_report.bytes_read  # all mapped, as bf16 -> bf16
    elif kind == "ours-copy":
        model = load_model(path, dtype=torch.bfloat16, mmap=False)
        assert model.load_report.bytes_mapped == 0
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    t_load = time.perf_counter() - t0
    acc = touch(list(model.parameters()) + list(model.buffers()))
    t_total = time.perf_counter() - t0
    cpu = time.process_time() - c0
    stop.set()
    th.join()
    peak[0] = max(peak[0], _rss())
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        json.dumps(
            {
                "kind": kind,
                "load_s": t_load,
                "total_s": t_total,
                "cpu_s": cpu,
                "baseline": baseline,
                "peak_sampled": peak[0],
                "maxrss": maxrss,
                "maxrss_before": maxrss_before,
                "checksum": float(acc),
            }
        )
    )


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def run_child(kind: str, path: Path) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", kind, "--path", str(path)],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"{kind} worker failed with exit code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="measured runs per loader (alternating)")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the cached checkpoint")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every run (Linux, root)")
    ap.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--path", type=Path, default=CKPT, help="checkpoint directory (default: the cached one)")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.path)
        return 0

    if args.rebuild and CKPT.exists():
        import shutil

        shutil.rmtree(CKPT)
    if not args.path.exists():
        print(f"building {args.path} (once) ...", file=sys.stderr)
        build_checkpoint(args.path)

    from dflash_worker.weights import resolve_checkpoint

    ckpt = resolve_checkpoint(args.path)
    nbytes = ckpt.total_bytes
    print(f"checkpoint: {args.path}")
    print(f"  {len(ckpt.shards)} shards, {sum(len(h.tensors) for h in ckpt.shards)} tensors, "
          f"{nbytes} bytes ({nbytes / 2**30:.3f} GiB), bf16")
    cache = "dropped before every run (cold)" if args.cold else "one unmeasured warm-up run per loader"
    print(f"  cpu cores: {os.cpu_count()}; page cache: {cache}; runs alternate between loaders")

    if args.cold:
        try:
            drop_page_cache()
        except OSError as exc:
            raise SystemExit(f"--cold needs to write /proc/sys/vm/drop_caches (Linux, root): {exc}") from None
    else:
        for kind in KINDS:
            r = run_child(kind, args.path)
            print(f"  warm-up {kind:<12} total {r['total_s']:.2f}s")
    results: dict[str, list[dict]] = {k: [] for k in KINDS}
    for i in range(args.runs):
        order = KINDS if i % 2 == 0 else KINDS[::-1]
        for kind in order:
            if args.cold:
                drop_page_cache()
            results[kind].append(run_child(kind, args.path))

    checks = {r["checksum"] for rs in results.values() for r in rs}
    print(f"  checksum over all weights identical in every run: {len(checks) == 1} ({checks.pop():.6f})")

    def summary(kind: str) -> tuple[float, float, float, float]:
        rs = results[kind]
        total = statistics.median(r["total_s"] for r in rs)
        load = statistics.median(r["load_s"] for r in rs)
        cpu = statistics.median(r["cpu_s"] for r in rs)
        peak = statistics.median(max(r["peak_sampled"], r["maxrss"]) - r["baseline"] for r in rs)
        return total, load, peak / nbytes, cpu

    print()
    print(f"{'loader':<14}{'load s':>9}{'load+touch s':>14}{'cpu s':>8}{'peak RSS / ckpt bytes':>24}   (median of {args.runs})")
    rows = {k: summary(k) for k in results}
    for kind, (total, load, ratio, cpu) in rows.items():
        print(f"{kind:<14}{load:>9.2f}{total:>14.2f}{cpu:>8.2f}{ratio:>24.3f}")
    for kind in results:
        print(f"  {kind} load+touch per run: " + ", ".join(f"{r['total_s']:.2f}" for r in results[kind]))
    ours, copy, tf = rows["ours"], rows["ours-copy"], rows["transformers"]
    print(f"  load average while running (1 min): {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print()
    print(f"wall-time ratio ours/transformers (load+touch): {ours[0] / tf[0]:.3f}   (goal <= 1.0)")
    print(f"cpu-time ratio ours/transformers (load+touch):  {ours[3] / tf[3]:.3f}")
    print(f"peak RSS ratio ours (over baseline / checkpoint bytes): {ours[2]:.3f}   (goal <= 1.10)")
    print(f"peak RSS ratio transformers (same measure):            {tf[2]:.3f}")
    print(f"copy mode (mmap=False): wall-time ratio {copy[0] / tf[0]:.3f}, cpu-time ratio {copy[3] / tf[3]:.3f}, "
          f"peak RSS ratio {copy[2]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
