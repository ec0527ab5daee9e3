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

Training is replayed too: with f > 0 one verify job replays the train job's training from the producer's
checkpoint the coordinator picks (`verify.replay_start`: the newest one it still holds, at least
ceil(f x T) steps before the selected step T; step 0 when there is none) up to T, exports checkpoint T,
and must reproduce the producer's checkpoint files and export exactly (the bench fails otherwise; the
path-bearing `manifest.json` and `state.json` aside). The train job commits a checkpoint every
`--checkpoint-every` steps; the coordinator holds the newest `--keep-checkpoints` (its default, 2). For
each fraction the bench runs the replay from that start and prints its seconds, the steps replayed, and
the totals with the capture verify jobs: extra work, and the critical path (evaluate waits for the
replay, which starts when train ends), and the extra upload over the train job's (its export, selection
and every checkpoint it commits, as the durable checkpoint policy uploads them).

On the tiny world each job is mostly process start and imports; a real capture's and a real training's
share of the run is larger than here, so read the percentages with `capture` and `train` beside them.

Usage: .venv/bin/python bench/replay_check.py [--shards 4] [--fractions 0,0.25,0.5,1] [--steps 8]
       [--checkpoint-every 2] [--keep-checkpoints 2] [--json FILE]
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


# The command a job runs with (`--job-dir DIR` appended), as `run-manager --worker-cmd`; `--worker-cmd` sets it.
WORKER = [sys.executable, "-m", "dflash_worker.job"]


def run_job(
    root: Path, name: str, spec: dict, kind: str, index: int, count: int, needs: list[list[dict]], resume: Path | None = None
) -> tuple[list[dict], float]:
    """One graph job as the run-manager runs it: its inputs copied into its own job directory, `resume` its resume
    checkpoint's manifest. Returns (artifacts, seconds)."""
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
    doc = {"schema_version": 1, "spec": spec, "graph": graph} | ({} if resume is None else {"resume_checkpoint": str(resume)})
    (job_dir / "spec.json").write_text(json.dumps(doc))
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "python")}
    t0 = time.perf_counter()
    out = subprocess.run([*WORKER, "--job-dir", str(job_dir)], capture_output=True, text=True, timeout=1800, env=env)
    seconds = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{name} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    events = [json.loads(line) for line in out.stdout.splitlines()]
    return [e for e in events if e["event"] == "artifact" and e["kind"] not in ("checkpoint", "checkpoint_file")], seconds


def replay_starts(fractions: list[float], selected: int, held: list[int]) -> dict[float, int]:
    """The step each fraction's train replay starts from (the coordinator's `verify.replay_start`); f = 0 replays nothing."""
    from dflash_worker.coordinator.store.verify import replay_start

    return {f: replay_start(selected, [c for c in held if c < selected], f) for f in fractions if f}


def figures(
    times: dict[str, float], sizes: dict[str, int], n: int, fraction: float, run_id: str, replay: tuple[int, int] | None = None
) -> dict:
    """One fraction's row. `replay`: (start step, selected step) of the train replay, whose seconds and bytes are
    `times`/`sizes` ``replay@START``; without it (or at f = 0) only the capture verify jobs count."""
    from dflash_worker.coordinator.store import RunSpecData

    spec = RunSpecData(name="bench", required_client_version="0.1.0", spec_json=json.dumps({"verify_fraction": fraction}), capture_shards=n)
    checked = spec.verified_shards(run_id)
    assert len(checked) == (math.ceil(fraction * n - 1e-9) if fraction else 0)
    base = sum(v for k, v in times.items() if not k.startswith(("verify", "replay@")))
    extra = sum(times[f"verify{i}"] for i in checked)
    fixed = times["prepare"] + times["train"] + times["evaluate"]
    path0 = fixed + max(times[f"capture{i}"] for i in range(n))
    path1 = fixed + max(times[f"capture{i}"] + (times[f"verify{i}"] if i in checked else 0.0) for i in range(n))
    captured = sum(sizes[f"capture{i}"] for i in range(n))
    row = {
        "fraction": fraction, "checked": checked, "extra_work_s": extra, "work_s": base, "extra_work": extra / base,
        "critical_path_s": path1, "critical_path_unchecked_s": path0, "critical_path_overhead": path1 / path0 - 1,
        "extra_upload_bytes": sum(sizes[f"verify{i}"] for i in checked), "extra_upload": sum(sizes[f"verify{i}"] for i in checked) / captured,
    }  # fmt: skip
    if replay is None or not fraction:
        return row
    start, selected = replay
    replay_s, replay_bytes = times[f"replay@{start}"], sizes[f"replay@{start}"]
    total = extra + replay_s
    row["train_replay"] = {
        "from_step": start, "to_step": selected, "steps": selected - start, "seconds": replay_s, "extra_work": replay_s / base,
        "upload_bytes": replay_bytes, "upload": replay_bytes / sizes["train"],
    }  # fmt: skip
    # Evaluate waits for the replay, which starts once train has ended.
    row["total"] = {"extra_work_s": total, "extra_work": total / base, "critical_path_s": path1 + replay_s, "critical_path_overhead": (path1 + replay_s) / path0 - 1}
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, default=4, help="capture jobs (default 4)")
    ap.add_argument("--fractions", type=_fractions, default=[0.0, 0.25, 0.5, 1.0], help="spot-check fractions (default 0,0.25,0.5,1)")
    ap.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    ap.add_argument("--checkpoint-every", type=int, default=2, help="the train job's checkpoint interval (default 2)")
    ap.add_argument("--keep-checkpoints", type=int, default=2, help="the producer's checkpoints the coordinator holds, newest first (default 2, its default)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--worker-cmd", metavar="LINE",
                    help="run each job with this command line (`--job-dir DIR` appended, as `run-manager --worker-cmd`) "
                         "instead of `python -m dflash_worker.job` (the smoke test passes a pre-warmed one)")
    args = ap.parse_args(argv)
    if args.shards < 1 or args.checkpoint_every < 1 or args.keep_checkpoints < 1:
        ap.error("--shards, --checkpoint-every and --keep-checkpoints must be >= 1")
    if args.worker_cmd is not None:
        if not args.worker_cmd.split():
            ap.error("--worker-cmd is empty")
        global WORKER
        WORKER = args.worker_cmd.split()  # split on whitespace, as the run-manager splits it
    from dflash_worker.testing.world import build_world, job_spec

    with tempfile.TemporaryDirectory(prefix="replay-check-") as tmp:
        root = Path(tmp)
        stages = ["prepare", "check", "capture", "train", "evaluate"]
        spec = job_spec(build_world(root / "world"), steps=args.steps, checkpoint_every=args.checkpoint_every, stages=stages)
        spec["recipe"]["train"]["keep_checkpoints"] = args.steps  # every checkpoint stays in the train job's directory
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
        selected, held, starts = replay_training(root, spec, arts, times, args)
        sizes = {k: sum(a["size_bytes"] for a in v) for k, v in arts.items()}
        # What the train job uploads under the durable policy: its checkpoints too.
        sizes["train"] += sum(f.stat().st_size for f in (root / "train" / "run" / "checkpoints").rglob("*") if f.is_file())
    print(f"graph of {n} capture shards, {args.steps} training steps; job seconds (process start to exit):")
    print("  " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
    print(f"every verify job recomputed its capture byte for byte ({sum(len(arts[f'capture{i}']) for i in range(n))} files)")
    if starts:
        print(
            f"every train replay reproduced the selected step {selected}'s checkpoint and export byte for byte"
            f" (from steps {', '.join(str(s) for s in sorted(set(starts.values())))}; the coordinator holds steps {', '.join(map(str, held))})"
        )
    rows = [figures(times, sizes, n, f, run_id="bench-run", replay=(starts[f], selected) if f in starts else None) for f in args.fractions]
    print(f"{'fraction':>8}  {'checked':>7}  {'extra work':>16}  {'critical path':>22}  {'extra upload':>12}")
    for r in rows:
        print(
            f"{r['fraction']:8.2f}  {len(r['checked']):7d}  {r['extra_work_s']:6.1f} s {100 * r['extra_work']:6.1f}%"
            f"  {r['critical_path_s']:6.1f} s vs {r['critical_path_unchecked_s']:5.1f} s {100 * r['critical_path_overhead']:+6.1f}%"
            f"  {100 * r['extra_upload']:11.1f}%"
        )
    print("train replay (evaluate waits for it) and the total with the capture verify jobs:")
    print(f"{'fraction':>8}  {'from step':>9}  {'steps':>5}  {'replay':>8}  {'extra work':>16}  {'critical path':>22}  {'extra upload':>12}")
    for r in rows:
        t, tot = r.get("train_replay"), r.get("total")
        if t is None:
            print(f"{r['fraction']:8.2f}  {'-':>9}  {0:5d}  {0.0:6.1f} s  {r['extra_work_s']:6.1f} s {100 * r['extra_work']:6.1f}%"
                  f"  {r['critical_path_s']:6.1f} s vs {r['critical_path_unchecked_s']:5.1f} s {100 * r['critical_path_overhead']:+6.1f}%  {0.0:11.1f}%")  # fmt: skip
            continue
        print(
            f"{r['fraction']:8.2f}  {t['from_step']:9d}  {t['steps']:5d}  {t['seconds']:6.1f} s  {tot['extra_work_s']:6.1f} s {100 * tot['extra_work']:6.1f}%"
            f"  {tot['critical_path_s']:6.1f} s vs {r['critical_path_unchecked_s']:5.1f} s {100 * tot['critical_path_overhead']:+6.1f}%"
            f"  {100 * t['upload']:11.1f}%"
        )
    if args.json:
        doc = {"shards": n, "steps": args.steps, "selected_step": selected, "held_checkpoints": held, "times_s": times, "bytes": sizes, "rows": rows}
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


def replay_training(root: Path, spec: dict, arts: dict, times: dict, args) -> tuple[int, list[int], dict[float, int]]:
    """Run the train replay from each start the fractions pick; each must reproduce the producer exactly.
    Returns the selected step, the checkpoints the coordinator holds, and each fraction's start."""
    from dflash_worker.coordinator.store.verify import PATH_BEARING

    train_dir = root / "train"
    selected = json.loads((train_dir / "run" / "selection.json").read_text())["step"]
    steps = sorted(int(p.name[5:]) for p in (train_dir / "run" / "checkpoints").glob("step-*"))
    held = steps[-args.keep_checkpoints :]
    starts = replay_starts(args.fractions, selected, held)
    ckpt = train_dir / "run" / "checkpoints" / f"step-{selected:08d}"
    theirs = {f"run/checkpoints/{ckpt.name}/{f.name}": f for f in ckpt.iterdir()}
    theirs |= {a["name"]: Path(a["path"]) for a in arts["train"] if a["kind"] == "export"}
    theirs = {k: sha256_of(v) for k, v in theirs.items() if Path(k).name not in PATH_BEARING}
    needs = [arts["prepare"], *(arts[f"capture{i}"] for i in range(args.shards)), [a for a in arts["train"] if a["name"] == "run/selection.json"]]
    for start in sorted(set(starts.values())):
        resume = None if start == 0 else train_dir / "run" / "checkpoints" / f"step-{start:08d}" / "manifest.json"
        name = f"replay@{start}"
        arts[name], times[name] = run_job(root, name, spec, "verify", 0, 1, needs, resume=resume)
        ours = {a["name"].removeprefix("verify/"): a["sha256"] for a in arts[name] if Path(a["name"]).name not in PATH_BEARING}
        if ours != theirs:
            raise SystemExit(f"the train replay from step {start} reproduced other bytes than the train job: not byte-reproducible here\n{ours}\n{theirs}")
    return selected, held, starts


def sha256_of(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


if __name__ == "__main__":
    sys.exit(main())
