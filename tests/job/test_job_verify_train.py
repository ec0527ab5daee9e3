"""The worker side of replaying training (verification by replay of a train job): a graph's `verify` job handed the
train job's `run/selection.json` assembles the capture, replays training from the lease's resume checkpoint (the
producer's, or step 0) up to the selected step on the full run's schedule, exports that checkpoint, and reports
the checkpoint's files and the export as `verify/run/...`, whose digests the coordinator compares with the train
job's, leaving out the files that record the job directory's paths (tests/coordinator/test_verify_train.py).

On a tiny world (4 steps, a checkpoint every 2, validation at step 4): the replay from the producer's step-2
checkpoint and the replay from step 0 both give the producer's step-4 weights, optimizer and RNG state and its
export byte for byte; a producer whose step-4 checkpoint was tampered with (weights scaled by 0.5, its manifest
rewritten to hash right) is told apart by the same replay."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from test_job_graph import _run, _spec

from dflash_worker.coordinator.store.verify import PATH_BEARING
from dflash_worker.testing.world import build_world

pytestmark = pytest.mark.slow

N_CAPTURE = 2


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _job(job_dir: Path, spec: dict, kind: str, index: int, count: int, needs: list[list[dict]], resume: Path | None = None) -> list[dict]:
    """Run a graph job on its needed jobs' final artifacts as the run-manager places them; all its artifacts (checkpoints too)."""
    inputs = []
    for arts in needs:
        for a in arts:
            dest = job_dir / a["name"]
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(a["path"], dest)
            inputs.append({"name": a["name"], "kind": a["kind"], "sha256": a["sha256"], "size_bytes": a["size_bytes"],
                           "uri": f"dflash-artifact://run/{kind}/1/{a['name']}", "path": str(dest)})  # fmt: skip
    doc = {"spec": spec, "graph": {"kind": kind, "shard_index": index, "shard_count": count, "inputs": inputs}}
    if resume is not None:
        doc["resume_checkpoint"] = str(resume)
    rc, events, err = _run(job_dir, doc)
    assert rc == 0, err
    assert events[-1] == {"event": "done"}, events[-3:]
    return [e for e in events if e["event"] == "artifact"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify-train")
    spec = {**_spec(build_world(root / "world")), "verify_fraction": 1}
    prepare = _job(root / "prepare", spec, "prepare", 0, 1, [])
    captures = [a for i in range(N_CAPTURE) for a in _job(root / f"capture{i}", spec, "capture", i, N_CAPTURE, [prepare])]
    train_dir = root / "train"
    train = _job(train_dir, spec, "train", 0, 1, [prepare, captures])
    return root, spec, prepare, captures, train_dir, train


def _producer(train_dir: Path, train: list[dict]) -> tuple[int, dict[str, str]]:
    """The selected step and the digests the coordinator holds of the train job's checkpoint files and export, by name."""
    (sel,) = [a for a in train if a["name"] == "run/selection.json"]
    step = json.loads(Path(sel["path"]).read_text())["step"]
    assert sel["step"] == step  # the record's step is the selected one: the coordinator reads it
    names = {a["name"] for a in train if a["kind"] == "export"}
    ckpt = train_dir / "run" / "checkpoints" / f"step-{step:08d}"
    names |= {f"run/checkpoints/{ckpt.name}/{f.name}" for f in ckpt.iterdir()}
    return step, {n: _sha(train_dir / n) for n in sorted(names) if Path(n).name not in PATH_BEARING}


def _replay(root: Path, name: str, world, resume: Path | None) -> dict[str, str]:
    _, spec, prepare, captures, _, train = world
    selection = [a for a in train if a["name"] == "run/selection.json"]
    arts = _job(root / name, spec, "verify", 0, 1, [prepare, captures, selection], resume=resume)
    assert arts and all(a["name"].startswith("verify/run/") and a["kind"] == "manifest" for a in arts), arts
    return {a["name"].removeprefix("verify/"): a["sha256"] for a in arts if Path(a["name"]).name not in PATH_BEARING}


def test_an_honest_training_is_replayed_byte_for_byte_from_a_checkpoint_and_from_step_0(world):
    root, _, _, _, train_dir, train = world
    step, theirs = _producer(train_dir, train)
    assert step == 4 and any(n.endswith("trainable.safetensors") for n in theirs) and "run/export/model.safetensors" in theirs
    start = train_dir / "run" / "checkpoints" / "step-00000002" / "manifest.json"
    assert _replay(root, "replay-from-2", world, start) == theirs
    assert _replay(root, "replay-from-0", world, None) == theirs


def test_a_tampered_checkpoint_is_told_apart(world):
    """The producer scaled its step-4 weights by 0.5 (manifest rewritten to match): the replay's weights differ."""
    from safetensors.torch import load_file, save_file

    root, _, _, _, train_dir, train = world
    step, theirs = _producer(train_dir, train)
    tampered = root / "tampered"
    shutil.copytree(train_dir / "run" / "checkpoints", tampered)
    ckpt = tampered / f"step-{step:08d}"
    tensors = {k: v * 0.5 for k, v in load_file(str(ckpt / "trainable.safetensors")).items()}
    save_file(tensors, str(ckpt / "trainable.safetensors"), metadata={"format": "dflash-worker-train-checkpoint/1"})
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["trainable.safetensors"]["sha256"] = _sha(ckpt / "trainable.safetensors")
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    name = f"run/checkpoints/{ckpt.name}/trainable.safetensors"
    forged = {**theirs, name: _sha(ckpt / "trainable.safetensors")}
    ours = _replay(root, "replay-tampered", world, tampered / "step-00000002" / "manifest.json")
    assert sorted(n for n in forged if ours.get(n) != forged[n]) == [name]
    assert ours == theirs  # the honest bytes


def test_an_interpolated_export_is_replayed_at_the_handed_alpha(world):
    """Issue 58: a selection that exported theta(alpha) (`interpolation.alpha`) is replayed at that alpha, so the
    verify job's export equals the producer's interpolated export byte for byte (and not the checkpoint's own)."""
    from dflash_worker.train.export_run import export_run, recipe_from_state

    root, _, _, _, train_dir, train = world
    step, theirs = _producer(train_dir, train)
    (sel,) = [a for a in train if a["name"] == "run/selection.json"]
    doc = json.loads(Path(sel["path"]).read_text())
    doc["interpolation"] = {**(doc.get("interpolation") or {}), "alpha": 0.375, "checkpoint_step": step}
    handed = root / "interpolated" / "selection.json"
    handed.parent.mkdir()
    handed.write_text(json.dumps(doc))
    expected = export_run(train_dir / "run", fmt="bf16", recipe=recipe_from_state(train_dir / "run", doc), selection=doc,
                          out_dir=root / "interpolated" / "export")
    want = _sha(expected.out_dir / "model.safetensors")
    assert want != theirs["run/export/model.safetensors"]
    _, spec, prepare, captures, _, _ = world
    art = {**sel, "sha256": _sha(handed), "size_bytes": handed.stat().st_size, "path": str(handed)}
    arts = _job(root / "replay-interpolated", spec, "verify", 0, 1, [prepare, captures, [art]],
                resume=train_dir / "run" / "checkpoints" / "step-00000002" / "manifest.json")
    ours = {a["name"].removeprefix("verify/"): a["sha256"] for a in arts}
    assert ours["run/export/model.safetensors"] == want


@pytest.mark.parametrize("interp, expected", [(None, None), ({"alpha": None}, None), ({"alpha": 0.25}, {"alpha": 0.25}),
                                              ({"alpha": 1}, {"alpha": 1.0}), ({"alpha": 0}, {"alpha": 0.0})])
def test_the_handed_alpha_is_read(interp, expected):
    from dflash_worker.worker.stages import handed_interpolation

    assert handed_interpolation({"step": 4, "interpolation": interp}) == expected
    assert handed_interpolation({"step": 4}) is None


@pytest.mark.parametrize("alpha", [1.5, -0.1, True, "0.5", [0.5], float("nan")])
def test_a_handed_alpha_that_is_not_a_number_in_0_1_is_refused(alpha):
    from dflash_worker.errors import DataError
    from dflash_worker.worker.stages import handed_interpolation

    with pytest.raises(DataError, match="interpolation alpha that is not a number in \\[0, 1\\]"):
        handed_interpolation({"step": 4, "interpolation": {"alpha": alpha}})
