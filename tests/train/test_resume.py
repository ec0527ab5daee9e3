"""Exact resume: runs killed (SIGKILL, real subprocesses) or interrupted (SIGINT) and resumed
equal an uninterrupted run bit for bit: trained parameters, optimizer state, export hash, and
metrics steps 1..N exactly once. Also the refusals of incompatible resumes."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from prewarmed import worker_cli
from warm_worker import job_pid, module_command

from dflash_worker.errors import ResumeError
from dflash_worker.manifest import sha256_file
from dflash_worker.recipe import load_recipe
from dflash_worker.train import checkpoint as ckpt
from dflash_worker.train import train

N = 8


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # same thread count in every process, so CPU kernels reduce in the same order
    env["OMP_NUM_THREADS"] = "1"
    return env


def _steps(run: Path) -> list[int]:
    p = run / "metrics.jsonl"
    if not p.is_file():
        return []
    out = []
    for line in p.read_bytes().splitlines():
        try:
            out.append(json.loads(line)["step"])
        except ValueError:
            pass
    return out


def _run_to_end(recipe: Path, *extra: str) -> subprocess.CompletedProcess:
    res = worker_cli("train", "--recipe", recipe, *extra, env=_env(), timeout=300)  # (no signal: a pre-warmed fork)
    assert res.returncode == 0, res.stderr
    return res


def _start_and_signal(recipe: Path, run: Path, at_step: int, sig: int, *extra: str) -> subprocess.CompletedProcess:
    """Start a training process (`dflash-worker train` as a warm job: `warm_worker.module_command`) and send `sig`
    to it once `at_step` metric lines exist; its stand-in exits as it did, or dies by the same signal."""
    proc = subprocess.Popen(module_command("dflash_worker.cli", "train", "--recipe", str(recipe), *extra), env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if len(_steps(run)) >= at_step:
            os.kill(job_pid(proc.pid), sig)
            break
        time.sleep(0.02)
    out, err = proc.communicate(timeout=240)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _final(run: Path) -> dict:
    """Bytes that must agree: final checkpoint tensors, optimizer state, export."""
    path = run / ckpt.CHECKPOINTS / ckpt.step_name(N)
    loaded = ckpt.load(path)
    sel = json.loads((run / "selection.json").read_text())
    export_dir = run / sel["export"]["dir"]
    return {
        "trainable_sha": sha256_file(path / "trainable.safetensors"),
        "optimizer": loaded.optimizer,
        "export_weights_sha": sha256_file(export_dir / "model.safetensors"),
        "selected": sel["step"],
        "history": sel["history"],
    }


def _same_optimizer(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        for name, va in a["state"][k].items():
            vb = b["state"][k][name]
            if isinstance(va, torch.Tensor):
                assert va.dtype == vb.dtype and torch.equal(va, vb), (k, name)
            else:
                assert va == vb


def _assert_identical(ref: dict, got: dict, run: Path) -> None:
    assert got["trainable_sha"] == ref["trainable_sha"]
    _same_optimizer(ref["optimizer"], got["optimizer"])
    assert got["export_weights_sha"] == ref["export_weights_sha"]
    assert got["selected"] == ref["selected"] and got["history"] == ref["history"]
    assert _steps(run) == list(range(1, N + 1))


def _recipe(pipeline, name: str, **kw) -> Path:
    base = dict(steps=N, checkpoint_every=2, val_every=4, grad_accum=2, blocks_per_sequence=4, lr=5e-3)
    base.update(kw)
    return pipeline.recipe(name, **base)


@pytest.fixture(scope="module")
def reference(pipeline):
    recipe = _recipe(pipeline, "resume-ref")
    _run_to_end(recipe)
    return _final(pipeline.root / "resume-ref")


def test_sigkill_at_random_steps_then_resume_is_bit_identical(pipeline, reference):
    rng = random.Random(int(os.environ.get("DFLASH_TEST_SEED", "1234")))
    first = rng.randint(1, 3)
    second = rng.randint(first + 2, N - 1)
    recipe = _recipe(pipeline, "resume-kill")
    run = pipeline.root / "resume-kill"
    r1 = _start_and_signal(recipe, run, first, signal.SIGKILL)
    assert r1.returncode == -signal.SIGKILL, f"not killed (kill point {first}): {r1.stderr[-2000:]}"
    r2 = _start_and_signal(recipe, run, second, signal.SIGKILL, "--resume")
    assert r2.returncode == -signal.SIGKILL, f"not killed (kill point {second}): {r2.stderr[-2000:]}"
    _run_to_end(recipe, "--resume")
    _assert_identical(reference, _final(run), run)


def test_sigint_checkpoints_exits_zero_and_resumes_bit_identical(pipeline, reference):
    recipe = _recipe(pipeline, "resume-int")
    run = pipeline.root / "resume-int"
    r1 = _start_and_signal(recipe, run, 3, signal.SIGINT)
    assert r1.returncode == 0, r1.stderr
    assert "stopped by SIGINT" in r1.stderr and "--resume" in r1.stderr  # the trainer's log line
    # ...and the result, once, on stdout (the command's summary; logs stay on stderr).
    assert r1.stdout.startswith("train: stopped by SIGINT at step") and len(r1.stdout.splitlines()) == 1, r1.stdout
    stopped_at = max(_steps(run))
    assert ckpt.latest(run).name == ckpt.step_name(stopped_at)  # committed at the step boundary
    _run_to_end(recipe, "--resume")
    _assert_identical(reference, _final(run), run)


def test_resume_of_completed_run_verifies_instead_of_retraining(pipeline, reference):
    recipe = _recipe(pipeline, "resume-ref")
    run = pipeline.root / "resume-ref"
    before = (run / "metrics.jsonl").read_bytes()
    res = train(load_recipe(recipe), resume=True)
    assert res.status == "verified"
    assert (run / "metrics.jsonl").read_bytes() == before
    # a damaged export is detected, not silently accepted
    export = run / "export" / "model.safetensors"
    data = bytearray(export.read_bytes())
    data[-1] ^= 1
    os.chmod(export, 0o644)
    export.write_bytes(bytes(data))
    with pytest.raises(Exception, match="does not match its manifest"):
        train(load_recipe(recipe), resume=True)
    data[-1] ^= 1
    export.write_bytes(bytes(data))


def test_incompatible_resume_names_the_differing_fields(pipeline):
    train(load_recipe(_recipe(pipeline, "resume-bad", steps=4, val_every=2, checkpoint_every=1)),
          flags=_stop_after_first_step())
    with pytest.raises(ResumeError) as err:
        train(load_recipe(_recipe(pipeline, "resume-bad", steps=4, lr=1e-3, seed=7, checkpoint_every=1, val_every=2)), resume=True)
    assert "`train.lr`" in str(err.value) and "`train.seed`" in str(err.value)
    # other draft bytes: the draft fingerprint names the file
    run = pipeline.root / "resume-bad"
    state = json.loads((ckpt.latest(run) / "state.json").read_text())
    from dflash_worker.train.resume import compare_for_resume

    changed = dict(state, draft_fingerprint={"model.safetensors": "0" * 64, "config.json": state["draft_fingerprint"]["config.json"]})
    with pytest.raises(ResumeError, match="draft file `model.safetensors`"):
        compare_for_resume(changed, {k: state[k] for k in ("recipe_view", "data_fingerprint", "draft_fingerprint")})
    with pytest.raises(ResumeError, match="data fingerprint"):
        compare_for_resume(state, {**{k: state[k] for k in ("recipe_view", "draft_fingerprint")}, "data_fingerprint": "x"})
    # a fresh run into a directory that holds checkpoints is refused without --resume
    with pytest.raises(ResumeError, match="--resume"):
        train(load_recipe(_recipe(pipeline, "resume-bad", steps=4, val_every=2, checkpoint_every=1)))


def _stop_after_first_step():
    """Flags as a job runner sets them: stop (and commit) at the first step boundary."""
    from dflash_worker.train import StopFlags

    flags = StopFlags()
    flags.request_stop("test")
    return flags


def test_corrupt_checkpoint_is_refused(pipeline, tmp_path):
    recipe = _recipe(pipeline, "resume-corrupt", steps=2, val_every=2, checkpoint_every=1)
    train(load_recipe(recipe), flags=_stop_after_first_step())
    latest = ckpt.latest(pipeline.root / "resume-corrupt")
    opt = latest / "optimizer.pt"
    os.chmod(opt, 0o644)
    opt.write_bytes(opt.read_bytes()[:-7] + b"garbage")
    from dflash_worker.errors import CheckpointError

    with pytest.raises(CheckpointError, match="optimizer.pt"):
        train(load_recipe(recipe), resume=True)


def test_an_unusable_checkpoint_is_skipped_for_the_next_older_one(pipeline, reference):
    """Issue 34: with `skip_unusable` (the job runner's choice: a coordinator job's checkpoints may come from
    another attempt) a checkpoint that fails to load is a warning, the next older one is resumed, and the
    result is bit-identical to an uninterrupted run."""
    from dflash_worker.worker.events import Log

    recipe = _recipe(pipeline, "resume-skip")
    run = pipeline.root / "resume-skip"
    r1 = _start_and_signal(recipe, run, 5, signal.SIGINT)
    assert r1.returncode == 0, r1.stderr
    steps = [s for s, _ in ckpt.committed(run)]
    assert len(steps) >= 2, steps
    newest, older = ckpt.committed(run)[-1][1], ckpt.committed(run)[-2]
    opt = newest / "optimizer.pt"
    os.chmod(opt, 0o644)
    opt.write_bytes(opt.read_bytes()[:-7] + b"garbage")
    events = []
    train(load_recipe(recipe), resume=True, skip_unusable=True, on_event=events.append)
    logs = [(e.level, e.message) for e in events if isinstance(e, Log)]
    assert any(level == "warning" and m.startswith(f"skipped checkpoint `{newest}`") and "optimizer.pt" in m for level, m in logs), logs
    assert ("info", f"resumed from `{older[1]}` at step {older[0]}") in logs, logs
    _assert_identical(reference, _final(run), run)


def test_checkpoints_from_before_chunk_tokens_and_train_turns_resume_at_their_defaults():
    """A checkpoint written before `[capture].chunk_tokens` and `[data].train_turns` existed resumes under
    their defaults (2048, "all"), and is refused under any other value, the field named."""
    from dflash_worker.train.resume import compare_for_resume

    saved = {"recipe_view": {"train.lr": 1.0}, "data_fingerprint": "d", "draft_fingerprint": {}}
    now = {"train.lr": 1.0, "capture.chunk_tokens": 2048, "data.train_turns": "all"}
    compare_for_resume(saved, {**saved, "recipe_view": now})
    for key, other in (("capture.chunk_tokens", 512), ("data.train_turns", "last")):
        with pytest.raises(ResumeError, match=f"`{key}`"):
            compare_for_resume(saved, {**saved, "recipe_view": {**now, key: other}})
