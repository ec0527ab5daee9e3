"""What verification by replay costs: a graph run's spot-check fraction (`verify_fraction`) vs wall-clock.

A graph run's capture shard i that is spot-checked gets a `verify` job: another provider captures the
shard again and the coordinator compares the digests (docs/run-admin.md, Trust model). Its cost is one
more capture of that shard, on a provider that would otherwise be idle or doing other work, plus the
upload of what it recomputed; train waits for it.

What is run: the worker's jobs of one graph (`python -m dflash_worker.job` per job, each in a job
directory of its own fed with the earlier jobs' artifacts, as the run-manager places them): prepare,
`--shards` capture jobs, train and one evaluate job, then a verify job for every capture shard, each
timed from process start to exit. Every verify job must recompute its capture's bytes exactly (the
bench fails otherwise). For each fraction f the spot-checked shards are the ones the coordinator picks
(`RunSpecData.verified_shards`, ceil(f x N) of N), and the bench prints:

- extra work: the selected verify jobs' seconds over the run's jobs' seconds (one provider doing all);
- critical path: prepare + max over shards (capture_i + verify_i if checked) + train + evaluate, over
  the same without verification (a provider per shard: verification delays train by the slowest
  checked shard's recomputation);
- extra upload: the recomputed bytes the verify jobs send, over the capture jobs' bytes.

On the tiny world each job is mostly process start and imports; a real capture's share of the run is
larger than here, so read the percentages with `capture` beside them.

Usage: .venv/bin/python bench/replay_check.py [--shards 4] [--fractions 0,0.25,0.5,1] [--steps 8] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))


def _fractions(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"`{text}` is not a comma-separated list of numbers") from None
    if not out or any(not 0 <= f <= 1 for f in out):
        raise argparse.ArgumentTypeError("give fractions from 0 to 1")
    return out


def run_job(root: Path, name: str, spec: dict, kind: str, index: int, count: int, needs: list[list[dict]]) -> tuple[list[dict], float]:
    """One graph job as the run-manager runs it: its inputs copied into its own job directory. Returns (artifacts, seconds)."""
    job_dir = root / name
    job_dir.mkdir(parents=True)
    inputs = []
    for arts in needs:
        for a in arts:
            dest = job_dir / a["name"]
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(Path(a["path"]).read_bytes())
            inputs.append({k: a[k] for k in ("name", "kind", "sha256", "size_bytes")} | {"uri": f"dflash-artifact://bench/{a['name']}", "path": str(dest)})
    graph = {"kind": kind, "shard_index": index, "shard_count": count, "inputs": inputs}
    (job_dir / "spec.json").write_text(json.dumps({"schema_version": 1, "spec": spec, "graph": graph}))
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "python")}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "dflash_worker.job", "--job-dir", str(job_dir)], capture_output=True, text=True, timeout=1800, env=env)
    seconds = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{name} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    events = [json.loads(line) for line in out.stdout.splitlines()]
    return [e for e in events if e["event"] == "artifact" and e["kind"] not in ("checkpoint", "checkpoint_file")], seconds


def figures(times: dict[str, float], sizes: dict[str, int], n: int, fraction: float, run_id: str) -> dict:
    from dflash_worker.coordinator.store import RunSpecData

    spec = RunSpecData(name="bench", required_client_version="0.1.0", spec_json=json.dumps({"verify_fraction": fraction}), capture_shards=n)
    checked = spec.verified_shards(run_id)
    assert len(checked) == (math.ceil(fraction * n - 1e-9) if fraction else 0)
    base = sum(v for k, v in times.items() if not k.startswith("verify"))
    extra = sum(times[f"verify{i}"] for i in checked)
    fixed = times["prepare"] + times["train"] + times["evaluate"]
    path0 = fixed + max(times[f"capture{i}"] for i in range(n))
    path1 = fixed + max(times[f"capture{i}"] + (times[f"verify{i}"] if i in checked else 0.0) for i in range(n))
    captured = sum(sizes[f"capture{i}"] for i in range(n))
    return {
        "fraction": fraction, "checked": checked, "extra_work_s": extra, "work_s": base, "extra_work": extra / base,
        "critical_path_s": path1, "critical_path_unchecked_s": path0, "critical_path_overhead": path1 / path0 - 1,
        "extra_upload_bytes": sum(sizes[f"verify{i}"] for i in checked), "extra_upload": sum(sizes[f"verify{i}"] for i in checked) / captured,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, default=4, help="capture jobs (default 4)")
    ap.add_argument("--fractions", type=_fractions, default=[0.0, 0.25, 0.5, 1.0], help="spot-check fractions (default 0,0.25,0.5,1)")
    ap.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.shards < 1:
        ap.error("--shards must be >= 1")
    from dflash_worker.testing.world import build_world, job_spec

    with tempfile.TemporaryDirectory(prefix="replay-check-") as tmp:
        root = Path(tmp)
        spec = job_spec(build_world(root / "world"), steps=args.steps, checkpoint_every=args.steps, stages=["prepare", "check", "capture", "train", "evaluate"])
        spec["recipe"]["capture"]["shard_examples"] = 2
        spec["recipe"]["evaluate"] = {"max_new_tokens": 8}
        spec["evaluate"] = {"split": "test", "max_prompts": 2}
        n, times, sizes, arts = args.shards, {}, {}, {}
        arts["prepare"], times["prepare"] = run_job(root, "prepare", spec, "prepare", 0, 1, [])
        for i in range(n):
            arts[f"capture{i}"], times[f"capture{i}"] = run_job(root, f"capture{i}", spec, "capture", i, n, [arts["prepare"]])
        captures = [arts[f"capture{i}"] for i in range(n)]
        arts["train"], times["train"] = run_job(root, "train", spec, "train", 0, 1, [arts["prepare"], *captures])
        arts["evaluate"], times["evaluate"] = run_job(root, "evaluate", spec, "evaluate", 0, 1, [arts["prepare"], arts["train"]])
        for i in range(n):
            arts[f"verify{i}"], times[f"verify{i}"] = run_job(root, f"verify{i}", spec, "verify", i, n, [arts["prepare"], arts[f"capture{i}"]])
            theirs = {a["name"]: a["sha256"] for a in arts[f"capture{i}"]}
            ours = {a["name"].removeprefix("verify/"): a["sha256"] for a in arts[f"verify{i}"]}
            if ours != theirs:
                raise SystemExit(f"verify job {i} recomputed other bytes than capture job {i}: not byte-reproducible here\n{ours}\n{theirs}")
        sizes = {k: sum(a["size_bytes"] for a in v) for k, v in arts.items()}
    print(f"graph of {n} capture shards, {args.steps} training steps; job seconds (process start to exit):")
    print("  " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
    print(f"every verify job recomputed its capture byte for byte ({sum(len(arts[f'capture{i}']) for i in range(n))} files)")
    rows = [figures(times, sizes, n, f, run_id="bench-run") for f in args.fractions]
    print(f"{'fraction':>8}  {'checked':>7}  {'extra work':>16}  {'critical path':>22}  {'extra upload':>12}")
    for r in rows:
        print(
            f"{r['fraction']:8.2f}  {len(r['checked']):7d}  {r['extra_work_s']:6.1f} s {100 * r['extra_work']:6.1f}%"
            f"  {r['critical_path_s']:6.1f} s vs {r['critical_path_unchecked_s']:5.1f} s {100 * r['critical_path_overhead']:+6.1f}%"
            f"  {100 * r['extra_upload']:11.1f}%"
        )
    if args.json:
        args.json.write_text(json.dumps({"shards": n, "steps": args.steps, "times_s": times, "bytes": sizes, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
