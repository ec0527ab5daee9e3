"""Throughput of AF4G64 quantize+pack: `dflash_worker.model.quant.quantize_af4g64` vs
`mlx.core.quantize` (CPU stream, forced with `mx.eval`) on the same matrices in one run.

Prints, per shape and input dtype, the best-of-N wall time (the two sides are
timed alternately), GB/s of input read (fp32 bytes = 4 * elements, bf16 =
2 * elements), the throughput ratio ours / mlx (>= 1 means we are faster) and
the best process CPU time of each side (robust on a loaded machine; includes
any spinning of torch's worker threads). Each row also checks that both produced the same
bytes (packed words; scales and biases after MLX's are rounded to BF16), so
the two sides did the same work.

On a shared, loaded 2-core machine torch's OpenMP workers lose time waiting on
each other, so the script runs once with torch's default thread count and once
with one thread.

Usage: .venv/bin/python bench/quant.py [--repeats N] [--shapes 4096x4096,1024x11008] [--threads 0,1]
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
import torch


def _interleaved_best(fns, repeats: int) -> list[tuple[float, float]]:
    """Best (wall, cpu) seconds of each fn, timed alternately so load from other
    processes on a shared machine hits every side alike."""
    for fn in fns:
        fn()  # warm-up (allocator, thread pool)
    best = [(float("inf"), float("inf")) for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            t1, c1 = time.perf_counter(), time.process_time()
            best[i] = (min(best[i][0], t1 - t0), min(best[i][1], c1 - c0))
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per measurement; the best is reported")
    ap.add_argument("--shapes", default="4096x4096,1024x11008,11008x4096", help="comma-separated OUTxIN shapes")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="input dtypes to time (float32, bfloat16, float16)")
    ap.add_argument(
        "--threads",
        default="0,1",
        help="comma-separated torch intra-op thread counts to run (0: torch's default); "
        "mlx's CPU quantize is single-threaded either way",
    )
    args = ap.parse_args(argv)
    default_threads = torch.get_num_threads()
    worst = float("inf")
    for n in (int(x) for x in args.threads.split(",")):
        torch.set_num_threads(n if n > 0 else default_threads)
        worst = min(worst, _run(args))
    print(f"min ratio ours/mlx over all runs: {worst:.2f} (goal >= 0.5)")
    return 0


def _run(args) -> float:
    import mlx.core as mx

    from dflash_worker.model.quant import quantize_af4g64

    print(
        f"# af4g64 quantize+pack, best of {args.repeats}; torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), mlx {mx.__version__} (cpu stream), {platform.machine()}",
    )
    header = (
        f"{'shape':>12} {'dtype':>8} {'ours s':>8} {'mlx s':>8} {'ours GB/s':>9} {'mlx GB/s':>9} "
        f"{'ratio':>6} {'cpu-s ours':>10} {'cpu-s mlx':>9} {'bytes':>6}"
    )
    print(header)
    mdt = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
    ratios = []
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        rows, cols = (int(x) for x in shape.lower().split("x"))
        w32 = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)
        for dname in args.dtypes.split(","):
            dtype = getattr(torch, dname)
            wt = torch.from_numpy(w32).to(dtype)
            wm = mx.array(w32).astype(mdt[dname])
            mx.eval(wm)

            def ours():
                return quantize_af4g64(wt)

            def theirs():
                out = mx.quantize(wm, group_size=64, bits=4, mode="affine", stream=mx.cpu)
                mx.eval(*out)
                return out

            (t_ours, c_ours), (t_mlx, c_mlx) = _interleaved_best([ours, theirs], args.repeats)
            q, s, b = ours()
            mq, ms, mb = theirs()
            same = (
                np.array_equal(q.view(torch.int32).numpy().view(np.uint32), np.array(mq))
                and np.array_equal(s.view(torch.int16).numpy().view(np.uint16), np.array(ms.astype(mx.bfloat16).view(mx.uint16)))
                and np.array_equal(b.view(torch.int16).numpy().view(np.uint16), np.array(mb.astype(mx.bfloat16).view(mx.uint16)))
            )
            nbytes = rows * cols * wt.element_size()
            ratio = t_mlx / t_ours
            ratios.append(ratio)
            print(
                f"{shape:>12} {dname:>8} {t_ours:8.4f} {t_mlx:8.4f} {nbytes / t_ours / 1e9:9.2f} "
                f"{nbytes / t_mlx / 1e9:9.2f} {ratio:6.2f} {c_ours:10.4f} {c_mlx:9.4f} {'same' if same else 'DIFF':>6}"
            )
    print(f"min ratio ours/mlx: {min(ratios):.2f}")
    return min(ratios)


if __name__ == "__main__":
    raise SystemExit(main())
