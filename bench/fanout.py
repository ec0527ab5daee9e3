"""Capture fan-out: wall time of a run's teacher capture over K providers (K = 1, 2), same data, one run.

Everything is the real system on loopback: `dflash-coordinator serve` (SQLite), and K `run-manager`
processes, each with its own work directory and HOME, each pinned to its own core (`taskset -c i`,
`OMP_NUM_THREADS=1`) as K one-core machines would be. For each K a fresh coordinator gets a job
graph run with `--capture-shards K` (stages prepare, check and capture: the train job only
assembles the capture, the evaluate job has nothing to do). The capture wall time is read from the
coordinator's own records: from the start of the first capture attempt to the end of the last one,
so it covers each provider's teacher load, the downloads of the prepared data and the uploads of
the shards. The arms alternate (1, 2, 1, 2, ...) so drift in machine load hits both alike; the
figure per arm is the median over repeats. Prints the speedup K=2 over K=1 (ideal x2.00 on two
free cores) and checks that both arms captured the same bytes (capture key and shard hashes of the
assembled manifest). Each capture job pays a fixed start (the worker's imports, the capture plan,
the teacher load: about 6 s here), so the defaults make the capture itself dominate (about 70 s on
one core). Providers long-poll (`--max-wait 30`, `--poll-wait 30`): the coordinator wakes them when
prepare's success readies the capture jobs, so both start at once.

Usage: .venv/bin/python bench/fanout.py [--repeats N] [--examples N] [--hidden H] [--layers L]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = REPO / ".venv" / "bin"


def build_world(root: Path, args) -> dict:
    """A target of width `hidden` with a tokenizer, a released-layout draft and own-data rows; returns the job spec."""
    import torch

    from dflash_worker.model.geometry import plan_draft, write_fresh_draft
    from dflash_worker.testing.tokenizer import save_tiny_target_with_tokenizer
    from dflash_worker.testing.world import write_rows

    torch.set_num_threads(1)
    H = args.hidden
    save_tiny_target_with_tokenizer(root / "target", hidden_size=H, intermediate_size=2 * H, num_attention_heads=H // 16,
                                    num_key_value_heads=H // 32, head_dim=16, num_hidden_layers=args.layers)
    write_fresh_draft(plan_draft(root / "target", geometry="tiny", block_size=4), root / "draft")
    rows = write_rows(root / "rows.jsonl", examples=args.examples, seed=0)
    return {
        "stages": ["prepare", "check", "capture"],
        "inputs": [str(rows)],
        "prepare": {"seed": 0, "val_fraction": 0.1, "test_fraction": 0.0},
        "recipe": {
            "model": {"target": str(root / "target"), "draft": str(root / "draft"), "family": "qwen3"},
            "data": {"thinking": "off", "max_length": 256},
            "capture": {"dtype": "float32", "splits": ["train", "val"], "device": "cpu", "shard_examples": args.shard_examples},
        },
    }


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env.update(VIRTUAL_ENV=str(REPO / ".venv"), NO_COLOR="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


class System:
    """One coordinator and K pinned run-managers; everything is killed on exit."""

    def __init__(self, root: Path, k: int, worker_cmd: str | None = None):
        self.root, self.k, self.worker_cmd = root, k, worker_cmd
        self.token = secrets.token_hex(16)
        self.procs: list[subprocess.Popen] = []
        root.mkdir(parents=True)
        self.db = root / "coordinator.db"

    def __enter__(self) -> System:
        coord = subprocess.Popen(
            [str(BIN / "dflash-coordinator"), "serve", "--db", str(self.db), "--listen", "127.0.0.1:0", "--lease-ttl", "30", "--max-wait", "30"],
            stdout=subprocess.PIPE, stderr=open(self.root / "coordinator.log", "wb"), env=_env(DFLASH_ADMIN_TOKEN=self.token),
        )
        self.procs.append(coord)
        line = coord.stdout.readline()
        if not line:
            raise SystemExit(f"the coordinator did not start:\n{(self.root / 'coordinator.log').read_text()[-3000:]}")
        self.address = json.loads(line)["address"]
        return self

    def cli(self, *args: str) -> dict:
        out = subprocess.run([str(BIN / "dflash-coordinator"), *args, "--server", self.address, "--json"], capture_output=True, text=True,
                             env=_env(DFLASH_ADMIN_TOKEN=self.token), timeout=120)
        if out.returncode != 0:
            raise SystemExit(f"dflash-coordinator {' '.join(args)} failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout)

    def providers(self) -> None:
        cores = os.sched_getaffinity(0)
        for i in range(self.k):
            name = f"p{i}"
            token = self.cli("providers", "create", name)["token"]
            home = self.root / name / "home"
            home.mkdir(parents=True)
            core = sorted(cores)[i % len(cores)]
            worker = ["--worker-cmd", self.worker_cmd] if self.worker_cmd else ["--native-client", str(BIN / "dflash-native-client")]
            cmd = ["taskset", "-c", str(core), str(BIN / "run-manager"), "--work-dir", str(self.root / name / "work"),
                   *worker, "--device", "cpu", "--log-format", "json",
                   "--heartbeat-interval", "0.5", "--poll-wait", "30", "--coordinator", self.address, "--token", token, "--name", name]
            self.procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.root / f"{name}.log", "wb"), env=_env(HOME=str(home))))

    def query(self, sql: str, *params) -> list[tuple]:
        con = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=10)
        try:
            return con.execute(sql, params).fetchall()
        finally:
            con.close()

    def __exit__(self, *exc) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def capture_once(root: Path, spec: dict, k: int, timeout: float, worker_cmd: str | None = None) -> tuple[float, tuple]:
    """Run the graph with `k` capture shards on `k` providers; the capture window in seconds and the capture's identity."""
    with System(root, k, worker_cmd) as sys_:
        run_id = sys_.cli("runs", "create", "--name", f"fanout-{k}", "--spec-json", json.dumps(spec), "--capture-shards", str(k),
                          "--client-version", _client_version())["run_id"]
        sys_.providers()
        end = time.monotonic() + timeout
        while True:
            ((failure,),) = sys_.query("SELECT failure FROM runs WHERE run_id=?", run_id)
            states = {s for (s,) in sys_.query("SELECT state FROM jobs WHERE run_id=?", run_id)}
            state = "failed" if failure else "succeeded" if states == {"succeeded"} else f"running ({', '.join(sorted(states))})"
            if not state.startswith("running"):
                break
            if time.monotonic() > end:
                raise SystemExit(f"run {run_id} still `{state}` after {timeout:.0f}s; logs under {root}")
            time.sleep(0.5)
        if state != "succeeded":
            raise SystemExit(f"run {run_id} ended `{state}`: {failure}; logs under {root}")
        rows = sys_.query("SELECT a.started_unix, a.ended_unix FROM attempts a JOIN jobs j ON j.job_id=a.job_id"
                          " WHERE j.run_id=? AND j.kind='capture' AND a.state='succeeded'", run_id)
        assert len(rows) == k, rows
        t0 = min(s for s, _ in rows)
        window = max(e for _, e in rows) - t0
        print(f"  K={k}: capture jobs ran " + ", ".join(f"{s - t0:.2f}-{e - t0:.2f} s" for s, e in sorted(rows)), flush=True)
        (train_id,) = [j for (j,) in sys_.query("SELECT job_id FROM jobs WHERE run_id=? AND kind='train'", run_id)]
        manifests = list(root.glob(f"p*/work/jobs/{train_id}/capture/manifest.json"))
        assert len(manifests) == 1, manifests
        m = json.loads(manifests[0].read_text())
        return window, (m["capture_key"], [(s["file"], s["sha256"]) for s in m["shards"]])


def _client_version() -> str:
    out = subprocess.run([str(BIN / "dflash-native-client"), "--version"], capture_output=True, text=True, check=True, timeout=60).stdout
    return out.split()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2, help="runs per arm, alternating (default 2)")
    p.add_argument("--examples", type=int, default=480, help="rows in the world (default 480)")
    p.add_argument("--shard-examples", type=int, default=8, help="examples per capture shard (default 8)")
    p.add_argument("--hidden", type=int, default=512, help="target width (default 512)")
    p.add_argument("--layers", type=int, default=16, help="target layers (default 16)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one run may take (default 1800)")
    p.add_argument("--keep", action="store_true", help="keep the work directories (logs) and print where")
    p.add_argument("--worker-cmd", metavar="LINE",
                   help="run each job with this command (`run-manager --worker-cmd`) instead of the native client; "
                        "its pinning is then the command's own (the smoke test passes a pre-warmed one)")
    args = p.parse_args(argv)
    if shutil.which("taskset") is None:
        raise SystemExit("bench/fanout.py pins each provider to a core with `taskset` (util-linux), which is missing")

    load_before = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="dflash-bench-fanout-"))
    try:
        spec = build_world(tmp / "world", args)
        windows: dict[int, list[float]] = {1: [], 2: []}
        identity: dict[int, tuple] = {}
        for i in range(args.repeats):
            for k in (1, 2):
                w, ident = capture_once(tmp / f"k{k}-{i}", spec, k, args.timeout, args.worker_cmd)
                windows[k].append(w)
                if identity.setdefault(k, ident) != ident:
                    raise SystemExit(f"two runs with K={k} captured different bytes")
                print(f"run {i + 1}/{args.repeats}, K={k}: capture {w:.2f} s", flush=True)
    finally:
        if args.keep:
            print(f"work directories kept under {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    load_after = os.getloadavg()
    one, two = statistics.median(windows[1]), statistics.median(windows[2])
    same = identity[1] == identity[2]
    shards = len(identity[1][1])
    print(f"capture of {args.examples} rows (train+val, {shards} shards of {args.shard_examples} examples), target hidden {args.hidden} "
          f"x {args.layers} layers; each provider pinned to one core; {os.cpu_count()} CPUs")
    print(f"K=1 provider : {one:.2f} s (median of {args.repeats})")
    print(f"K=2 providers: {two:.2f} s (median of {args.repeats})")
    print(f"speedup K=2 / K=1: x{one / two:.2f} (ideal x2.00 on two free cores)")
    print(f"same capture at K=1 and K=2 (capture key and every shard's sha256): {same}")
    print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}; "
          f"after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
