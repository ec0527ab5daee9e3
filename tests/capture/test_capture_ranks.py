"""Capture as two gloo ranks under `torchrun` (`dflash_worker.dist`): the shards and the manifest's payload
are the bytes one rank writes; a SIGKILL of one rank stops both and a rerun resumes shard by shard."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from dflash_worker.capture import run_capture
from dflash_worker.recipe import load_recipe
from dflash_worker.testing.procs import children, rank_pid
from dflash_worker.train.loop import capture_fingerprint

from .conftest import payload, write_recipe

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "dflash_worker.cli", "capture"]


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", DFLASH_CPU_RANKS="1", PYTHONWARNINGS="ignore", **extra)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _payload_key(manifest):
    return manifest["capture_key"], manifest["shards"], manifest["totals"]


def _recipe(tmp, name, targets, draft_dir, prepared_dir, **capture):
    return write_recipe(tmp / f"{name}.toml", target=targets["qwen3"], draft=draft_dir, data=prepared_dir,
                        output=tmp / name, **capture)


def test_two_ranks_write_the_bytes_one_rank_writes(tmp_path, targets, draft_dir, prepared_dir):
    one = run_capture(load_recipe(_recipe(tmp_path, "one", targets, draft_dir, prepared_dir, shard_examples=3)))
    r = _recipe(tmp_path, "two", targets, draft_dir, prepared_dir, shard_examples=3)
    proc = subprocess.run([*TORCHRUN, "--recipe", str(r), "--json"], capture_output=True, text=True, timeout=600, env=_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    two = json.loads(proc.stdout)  # rank 0 alone prints: stdout is one JSON document
    assert two["shards_total"] == one["shards_total"] > 2 and two["run"]["ranks"] == 2
    assert _payload_key(two) == _payload_key(one)
    assert payload(tmp_path / "two") == payload(tmp_path / "one")
    # so a training run sees the same data (and resumes across the two)
    assert capture_fingerprint(tmp_path / "two") == capture_fingerprint(tmp_path / "one")
    # a rerun verifies everything and rewrites nothing
    again = subprocess.run([*TORCHRUN, "--recipe", str(r)], capture_output=True, text=True, timeout=600, env=_env())
    assert again.returncode == 0 and "already complete" in again.stderr, again.stderr[-4000:]






def test_sigkill_of_one_rank_stops_both_and_the_rerun_resumes_by_shard(tmp_path, targets, draft_dir, prepared_dir):
    # regenerating (a few greedy tokens per example) makes each shard slow enough to kill between shards
    cap = {"shard_examples": 1, "regenerate": True, "max_new_tokens": 6}
    one = run_capture(load_recipe(_recipe(tmp_path, "one", targets, draft_dir, prepared_dir, **cap)))
    out = tmp_path / "two"
    r = _recipe(tmp_path, "two", targets, draft_dir, prepared_dir, **cap)
    proc = subprocess.Popen([*TORCHRUN, "--recipe", str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env())
    deadline, victim = time.monotonic() + 300, None
    while time.monotonic() < deadline:
        if len(list(out.glob("shard-*.json"))) >= 3:
            victim = rank_pid(proc.pid, 1)
            break
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        time.sleep(0.02)
    assert victim is not None, f"no rank 1 among {children(proc.pid)} with 3 shards committed"
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0, err[-4000:]
    assert not (out / "manifest.json").exists()
    left = len(list(out.glob("shard-*.json")))
    assert 3 <= left < one["shards_total"], (left, err[-4000:])

    again = subprocess.run([*TORCHRUN, "--recipe", str(r), "--json"], capture_output=True, text=True, timeout=600, env=_env())
    assert again.returncode == 0, again.stderr[-4000:]
    m = json.loads(again.stdout)
    assert m["run"]["shards_reused"] >= 3 and m["run"]["shards_reused"] + m["run"]["shards_written"] == one["shards_total"]
    assert _payload_key(m) == _payload_key(one)
    assert payload(out) == payload(tmp_path / "one")


def test_token_sized_shards_are_refused_with_ranks(tmp_path, targets, draft_dir, prepared_dir):
    r = _recipe(tmp_path, "tok", targets, draft_dir, prepared_dir, shard_examples=None, shard_tokens=64)
    proc = subprocess.run([*TORCHRUN, "--recipe", str(r)], capture_output=True, text=True, timeout=600, env=_env())
    assert proc.returncode != 0
    assert "`[capture].shard_tokens` with 2 ranks" in proc.stderr and "use `shard_examples`" in proc.stderr
    assert not (tmp_path / "tok" / "manifest.json").exists()
