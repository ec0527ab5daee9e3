"""Capture as two gloo ranks under `torchrun` (`dflash_worker.dist`): the shards and the manifest's payload
are the bytes one rank writes; a SIGKILL of one rank stops both and a rerun resumes shard by shard."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from prewarmed import worker_cli
from warm_worker import job_pid, torchrun

from dflash_worker.testing.procs import children, rank_pid
from dflash_worker.train.resume import capture_fingerprint

from .conftest import payload, write_recipe

CAPTURE = ["-m", "dflash_worker.cli", "capture"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *CAPTURE]


def warm_torchrun() -> list[str]:
    """`TORCHRUN` whose launcher and ranks are forks of a pre-warmed interpreter (tests/warm_worker.py); the first
    two-rank capture below keeps the plain launcher and python ranks, and every warm one is compared with the
    one-rank bytes too."""
    return [*torchrun(), *CAPTURE]


def _env(**extra):
    # both sides of a byte comparison run as fresh processes with one BLAS thread: an in-process
    # reference inherits whatever the pytest worker set up before (a clean-clone CI run once saw
    # two shards' features differ from an in-process one-rank capture)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DFLASH_CPU_RANKS="1", PYTHONWARNINGS="ignore", **extra)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _payload_key(manifest):
    return manifest["capture_key"], manifest["shards"], manifest["totals"]


def _one_rank(recipe) -> dict:
    """The reference: the same capture as one plain process (no torchrun), its manifest."""
    proc = worker_cli("capture", "--recipe", recipe, "--json", timeout=600, env=_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def _assert_same_payload(got, want):
    """Every shard file byte for byte; on a difference, which tensor of which shard and by how much."""
    a, b = payload(got), payload(want)
    if a == b:
        return
    from safetensors.torch import load_file

    found = []
    for name in sorted(set(a) | set(b)):
        if a.get(name) == b.get(name):
            continue
        if not name.endswith(".safetensors") or name not in a or name not in b:
            found.append(name)
            continue
        ta, tb = load_file(got / name), load_file(want / name)
        for key in sorted(set(ta) | set(tb)):
            x, y = ta.get(key), tb.get(key)
            if x is None or y is None or x.shape != y.shape:
                found.append(f"{name}:{key} missing or reshaped")
            elif not x.equal(y):
                found.append(f"{name}:{key} max |diff| {(x.double() - y.double()).abs().max().item():.3g}")
    raise AssertionError(f"{got} differs from {want}: {found}")


def _recipe(tmp, name, targets, draft_dir, prepared_dir, **capture):
    return write_recipe(tmp / f"{name}.toml", target=targets["qwen3"], draft=draft_dir, data=prepared_dir,
                        output=tmp / name, **capture)


def test_two_ranks_write_the_bytes_one_rank_writes(tmp_path, targets, draft_dir, prepared_dir):
    one = _one_rank(_recipe(tmp_path, "one", targets, draft_dir, prepared_dir, shard_examples=3))
    r = _recipe(tmp_path, "two", targets, draft_dir, prepared_dir, shard_examples=3)
    proc = subprocess.run([*TORCHRUN, "--recipe", str(r), "--json"], capture_output=True, text=True, timeout=600, env=_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    two = json.loads(proc.stdout)  # rank 0 alone prints: stdout is one JSON document
    assert two["shards_total"] == one["shards_total"] > 2 and two["run"]["ranks"] == 2
    _assert_same_payload(tmp_path / "two", tmp_path / "one")
    assert _payload_key(two) == _payload_key(one)
    # so a training run sees the same data (and resumes across the two)
    assert capture_fingerprint(tmp_path / "two") == capture_fingerprint(tmp_path / "one")
    # a rerun verifies everything and rewrites nothing
    again = subprocess.run([*warm_torchrun(), "--recipe", str(r)], capture_output=True, text=True, timeout=600, env=_env())
    assert again.returncode == 0 and "already complete" in again.stderr, again.stderr[-4000:]


def test_sigkill_of_one_rank_stops_both_and_the_rerun_resumes_by_shard(tmp_path, targets, draft_dir, prepared_dir):
    # regenerating (a few greedy tokens per example) makes each shard slow enough to kill between shards
    cap = {"shard_examples": 1, "regenerate": True, "max_new_tokens": 6}
    one = _one_rank(_recipe(tmp_path, "one", targets, draft_dir, prepared_dir, **cap))
    out = tmp_path / "two"
    r = _recipe(tmp_path, "two", targets, draft_dir, prepared_dir, **cap)
    proc = subprocess.Popen([*warm_torchrun(), "--recipe", str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env())
    deadline, victim, agent = time.monotonic() + 300, None, None
    while time.monotonic() < deadline:
        if len(list(out.glob("shard-*.json"))) >= 3:
            agent = job_pid(proc.pid)  # the launcher runs as a warm job: the ranks are its children
            victim = rank_pid(agent, 1)
            break
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        time.sleep(0.02)
    assert victim is not None, f"no rank 1 among {children(agent) if agent else []} with 3 shards committed"
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0, err[-4000:]
    assert not (out / "manifest.json").exists()
    left = len(list(out.glob("shard-*.json")))
    assert 3 <= left < one["shards_total"], (left, err[-4000:])

    again = subprocess.run([*warm_torchrun(), "--recipe", str(r), "--json"], capture_output=True, text=True, timeout=600, env=_env())
    assert again.returncode == 0, again.stderr[-4000:]
    m = json.loads(again.stdout)
    assert m["run"]["shards_reused"] >= 3 and m["run"]["shards_reused"] + m["run"]["shards_written"] == one["shards_total"]
    _assert_same_payload(out, tmp_path / "one")
    assert _payload_key(m) == _payload_key(one)


def test_token_sized_shards_are_refused_with_ranks(tmp_path, targets, draft_dir, prepared_dir):
    r = _recipe(tmp_path, "tok", targets, draft_dir, prepared_dir, shard_examples=None, shard_tokens=64)
    proc = subprocess.run([*warm_torchrun(), "--recipe", str(r)], capture_output=True, text=True, timeout=600, env=_env())
    assert proc.returncode != 0
    assert "`[capture].shard_tokens` with 2 ranks" in proc.stderr and "use `shard_examples`" in proc.stderr
    assert not (tmp_path / "tok" / "manifest.json").exists()
