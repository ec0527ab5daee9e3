"""`train` reports through typed `worker.events`: progress per step, one checkpoint artifact per
commit (the checkpoint's manifest.json), one export artifact per exported file."""

from __future__ import annotations

import json

from dflash_worker.manifest import sha256_file
from dflash_worker.recipe import load_recipe
from dflash_worker.train import checkpoint as ckpt
from dflash_worker.train import train
from dflash_worker.worker.events import Artifact, Log, Progress, event_from_json


def test_train_emits_typed_progress_checkpoint_and_export_events(pipeline):
    recipe = load_recipe(pipeline.recipe("events", steps=4, val_every=2, checkpoint_every=3, keep_checkpoints=10))
    events = []
    result = train(recipe, on_event=events.append)
    assert result.status == "completed"
    assert all(isinstance(e, (Progress, Artifact, Log)) for e in events)
    assert all(event_from_json(e.to_json()) == e for e in events)  # every event survives the wire format

    progress = [e for e in events if isinstance(e, Progress)]
    assert [e.step for e in progress] == [1, 2, 3, 4]
    assert {e.phase for e in progress} == {"train"} and {e.total_steps for e in progress} == {4}
    assert set(progress[0].metrics) == {"loss", "lr", "grad_norm", "train_matching_proposals", "tokens_per_s"}
    # commits: step 2 (validation), 3 (cadence), 4 (last); nothing committed before step 2
    assert [e.committed_step for e in progress] == [None, 2, 3, 4]

    run = result.run_dir
    checkpoints = [e for e in events if isinstance(e, Artifact) and e.kind == "checkpoint"]
    assert [e.step for e in checkpoints] == [2, 3, 4]
    for e in checkpoints:
        manifest = run / ckpt.CHECKPOINTS / ckpt.step_name(e.step) / "manifest.json"
        assert e.artifact == f"checkpoints/{ckpt.step_name(e.step)}/manifest.json"
        assert e.path == str(manifest.absolute())
        assert e.sha256 == sha256_file(manifest) and e.size_bytes == manifest.stat().st_size
    # each checkpoint artifact comes before the progress event of its step
    order = [(type(e).__name__, getattr(e, "step", None)) for e in events]
    assert order.index(("Artifact", 2)) < order.index(("Progress", 2))

    exports = [e for e in events if isinstance(e, Artifact) and e.kind == "export"]
    files = sorted(p for p in result.export_dir.iterdir() if p.is_file())
    assert [e.artifact for e in exports] == [f"{result.export_dir.name}/{p.name}" for p in files]
    assert "export/manifest.json" in {e.artifact for e in exports}
    selected = json.loads((run / "selection.json").read_text())["step"]
    for e, p in zip(exports, files):
        assert e.path == str(p.absolute()) and e.sha256 == sha256_file(p) and e.step == selected
    assert events[-len(exports):] == exports  # reported last, once selection.json is written

    # a completed run is verified, not retrained: no events
    again = []
    assert train(recipe, resume=True, on_event=again.append).status == "verified"
    assert again == []


def test_resume_and_stop_are_logged(pipeline):
    from dflash_worker.train import Hooks

    recipe = load_recipe(pipeline.recipe("events-stop", steps=4, val_every=0, checkpoint_every=2))
    from dflash_worker.train import StopFlags

    flags = StopFlags()

    def stop_at_2(trainer, step):
        if step == 1:
            flags.request_stop("SIGTERM")

    events = []
    r = train(recipe, on_event=events.append, flags=flags, hooks=Hooks(after_step=stop_at_2))
    assert r.status == "stopped" and r.step == 2
    logs = [e for e in events if isinstance(e, Log)]
    assert len(logs) == 1 and logs[0].message.startswith("stopped by SIGTERM at step 2/4") and logs[0].level == "info"
    assert [e.step for e in events if isinstance(e, Artifact)] == [2]

    events = []
    assert train(recipe, resume=True, on_event=events.append).status == "completed"
    assert isinstance(events[0], Log) and events[0].message.startswith("resumed from `") and "at step 2" in events[0].message
    assert [e.step for e in events if isinstance(e, Progress)] == [3, 4]
