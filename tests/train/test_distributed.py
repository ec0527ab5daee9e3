"""Two gloo training ranks on CPU under `torchrun` (`dflash_worker.dist`): the same parameters as one rank, the
same sample sequence at any world size, and a SIGKILL of one rank stops both and resumes exactly."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from pipeline import _toml
from prewarmed import worker_cli
from safetensors.torch import load_file
from warm_worker import serving_pid
from warm_worker import torchrun as warm_torchrun

from dflash_worker.testing.procs import alive, children, rank_pid

# `torchrun` with python ranks (the reference run, `undisturbed`), and `torchrun` whose ranks are forks of a
# pre-warmed interpreter (tests/warm_worker.py: `--no-python` and a stand-in per rank that holds the rank's
# environment and forwards signals); every other two-rank run, compared with the reference.
REAL_TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
TORCHRUN = ["warm torchrun"]
TRAIN = ["-m", "dflash_worker.cli", "train"]
ONE_RANK = [sys.executable, *TRAIN]


def _env(**extra):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", DFLASH_CPU_RANKS="1", **extra)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _recipe(pipeline, run, **over):
    raw = copy.deepcopy(pipeline.recipe_base)
    raw["train"] = {"scope": "full", "steps": 3, "lr": 3e-3, "blocks_per_sequence": 4, "val_every": 3,
                    "checkpoint_every": 1, "keep_checkpoints": 50, "val_examples": 4, "device": "cpu", "warmup_steps": 1, "grad_accum": 2,
                    "output": str(pipeline.root / run), **over}
    path = pipeline.root / f"{run}.toml"
    path.write_text(_toml(raw))
    return path


def _argv(cmd, recipe, *extra):
    if cmd is TORCHRUN:
        return [*warm_torchrun(), *TRAIN, "--recipe", str(recipe), *extra]
    return [*cmd, *(TRAIN if cmd is REAL_TORCHRUN else []), "--recipe", str(recipe), *extra]


def _run(cmd, recipe, *extra, env=None):
    if cmd is ONE_RANK:  # one plain process: forked from the pre-warmed interpreter (tests/prewarmed.py)
        proc = worker_cli("train", "--recipe", recipe, *extra, timeout=600, env=env or _env())
    else:
        proc = subprocess.run(_argv(cmd, recipe, *extra), capture_output=True, text=True, timeout=600, env=env or _env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _trainable(run, step):
    return load_file(str(Path(run) / "checkpoints" / f"step-{step:08d}" / "trainable.safetensors"))


def _samples(run):
    lines = [json.loads(raw) for raw in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, len(lines) + 1))
    return [x["samples"] for x in lines]


def _export_sha(run):
    return hashlib.sha256((Path(run) / "export" / "model.safetensors").read_bytes()).hexdigest()


def test_one_micro_batch_per_rank_is_bit_identical_to_one_rank(pipeline):
    one, two = pipeline.root / "dist-e1", pipeline.root / "dist-e2"
    _run(ONE_RANK, _recipe(pipeline, "dist-e1"))
    proc = _run(TORCHRUN, _recipe(pipeline, "dist-e2"))
    assert f"train: trained 3 steps; selected step 3; exported `{two / 'export'}`" in proc.stdout
    assert "rank 1/2: trained 3 steps; rank 0 selects and exports" in proc.stderr
    # each sum over ranks has one addition, the same one a single rank does: no rounding differs
    for step in (1, 2, 3):
        a, b = _trainable(one, step), _trainable(two, step)
        assert all(torch.equal(a[k], b[k]) for k in a), step
    assert _export_sha(one) == _export_sha(two)
    assert _samples(one) == _samples(two)
    lines = [json.loads(raw) for raw in (two / "metrics.jsonl").read_text().splitlines()]
    assert {x["world_size"] for x in lines} == {2} and all(len(x["samples"]) == 2 for x in lines)


def test_two_micro_batches_per_rank_agree_within_fp32_reduction_order(pipeline):
    # grad_accum 4 on 2 ranks: (g0 + g2) + (g1 + g3) instead of ((g0 + g1) + g2) + g3
    one, two = pipeline.root / "dist-f1", pipeline.root / "dist-f2"
    _run(ONE_RANK, _recipe(pipeline, "dist-f1", steps=1, grad_accum=4, val_every=1))
    _run(TORCHRUN, _recipe(pipeline, "dist-f2", steps=1, grad_accum=4, val_every=1))
    a, b = _trainable(one, 1), _trainable(two, 1)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst > 0 or all(torch.equal(a[k], b[k]) for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    assert _samples(one) == _samples(two)


def test_cpu_ranks_need_the_development_switch(pipeline):
    # rank 0 of 2 as torchrun describes it (no torchrun: the refusal comes before any rendezvous, so one
    # process shows it; the ranks above show the switched-on mode under the real launcher)
    env = _env()
    env.pop("DFLASH_CPU_RANKS")
    env.update(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    proc = worker_cli("train", "--recipe", _recipe(pipeline, "dist-noswitch"), timeout=600, env=env)
    assert proc.returncode != 0
    assert "2 ranks on CPU: a test and development mode" in proc.stderr and "DFLASH_CPU_RANKS=1" in proc.stderr
    assert not (pipeline.root / "dist-noswitch" / "checkpoints").exists()


# --------------------------------------------------------------------------- SIGKILL and resume


def _kill_after_checkpoint(cmd, recipe, run, *, rank):
    """Start a run, SIGKILL one of its ranks (or the only process) once step 4 is committed."""
    proc = subprocess.Popen(_argv(cmd, recipe), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    deadline = time.monotonic() + 300
    target = agent = None
    while time.monotonic() < deadline:
        if (run / "checkpoints" / "step-00000004" / "manifest.json").exists():
            agent = serving_pid(proc.pid, proc.args)  # the one process, or the warm torchrun's agent (its job)
            target = agent if cmd is ONE_RANK else rank_pid(agent, rank)
            break
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        time.sleep(0.02)
    assert target is not None, "no checkpoint at step 4"
    others = [p for p in children(agent) if p != target]
    os.kill(target, signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0, err[-4000:]
    assert not (run / "selection.json").exists(), "the run finished before the kill"
    for pid in others:  # every other rank stopped with it
        assert not alive(pid), pid
    return err


@pytest.fixture(scope="module")
def undisturbed(pipeline):
    run = pipeline.root / "dist-ref"
    _run(REAL_TORCHRUN, _recipe(pipeline, "dist-ref", steps=16, checkpoint_every=2, val_every=8))
    return run


@pytest.mark.parametrize(
    "first, then",
    [("two", "two"), ("two", "one"), ("one", "two")],
    ids=["2-to-2", "2-to-1", "1-to-2"],
)
def test_sigkill_stops_every_rank_and_the_resume_continues_exactly(pipeline, undisturbed, first, then):
    name = f"dist-kill-{first}-{then}"
    run = pipeline.root / name
    recipe = _recipe(pipeline, name, steps=16, checkpoint_every=2, val_every=8)
    _kill_after_checkpoint(TORCHRUN if first == "two" else ONE_RANK, recipe, run, rank=1)
    proc = _run(TORCHRUN if then == "two" else ONE_RANK, recipe, "--resume")
    assert "resumed from" in proc.stderr
    # the same sample ids step by step, and (one micro-batch per rank: no rounding differs) the same export
    assert _samples(run) == _samples(undisturbed)
    assert _export_sha(run) == _export_sha(undisturbed)
    assert json.loads((run / "selection.json").read_text())["step"] == json.loads(
        (undisturbed / "selection.json").read_text())["step"]


def test_evaluate_split_over_two_ranks_writes_the_one_rank_report(pipeline, undisturbed):
    # 5 prompts (of the train split: the held-out ones are 4): rank 0 generates prompts 0, 2, 4 and rank 1
    # prompts 1, 3; the rows go back in prompt order
    def evaluate(cmd, out):
        argv = ["evaluate", "--run-dir", str(undisturbed), "--split", "train", "--max-prompts", "5", "--output", str(out)]
        if cmd is None:
            proc = worker_cli(*argv, timeout=600, env=_env())
        else:
            proc = subprocess.run([*warm_torchrun(), "-m", "dflash_worker.cli", *argv], capture_output=True, text=True, timeout=600, env=_env())
        assert proc.returncode == 0, proc.stderr[-4000:]
        return {f.name: f.read_bytes() for f in sorted(out.iterdir())}

    one = evaluate(None, pipeline.root / "dist-eval-1")
    two = evaluate(TORCHRUN, pipeline.root / "dist-eval-2")
    assert sorted(one) == ["acceptance.png", "report.json", "report.md"]
    report = json.loads(one["report.json"])
    assert report["prompts"] == 5 and report["lossless"] is True
    for name in one:  # byte for byte: report.json, report.md and the plot
        assert hashlib.sha256(two[name]).hexdigest() == hashlib.sha256(one[name]).hexdigest(), name


@pytest.mark.parametrize("command", ["export", "preflight"])
def test_commands_that_run_one_rank_refuse_a_world_size(command, capsys, monkeypatch, tmp_path):
    from dflash_worker.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    flag = "--run" if command == "export" else "--recipe"
    assert main([command, flag, str(tmp_path / "absent")]) == 1
    err = capsys.readouterr().err
    assert f"`{command}` runs on one rank, but `WORLD_SIZE` is `2`" in err
    assert "`capture`, `train`, `evaluate` run as several ranks" in err
    monkeypatch.setenv("WORLD_SIZE", "1")  # one rank: the command itself runs (and here fails on the missing path)
    assert main([command, flag, str(tmp_path / "absent")]) == 1
    assert "runs on one rank" not in capsys.readouterr().err
