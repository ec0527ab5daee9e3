"""`checkpoint.seed`: a run directory seeded from another run's checkpoint manifest is a byte copy,
committed by the same protocol; a damaged source or a file changed mid-copy commits nothing."""

from __future__ import annotations

import shutil

import pytest
import torch

from dflash_worker.errors import CheckpointError
from dflash_worker.train import checkpoint as ckpt


def _source(tmp_path):
    return ckpt.save(
        tmp_path / "a", 4, trainable={"w": torch.arange(6.0).reshape(2, 3)}, optimizer={"state": {}, "param_groups": []},
        rng={"seed": 1}, state={"cursor": 7},
    )  # fmt: skip


def test_seed_copies_the_checkpoint_byte_for_byte(tmp_path):
    src = _source(tmp_path)
    assert ckpt.seed(tmp_path / "b", src / "manifest.json") == 4
    dest = ckpt.latest(tmp_path / "b")
    assert dest.name == src.name
    for f in ("manifest.json", *ckpt._FILES):
        assert (dest / f).read_bytes() == (src / f).read_bytes(), f
    assert ckpt.seed(tmp_path / "b", src / "manifest.json") is None  # it has its own checkpoint now


def test_a_damaged_source_or_a_file_changed_mid_copy_commits_nothing(tmp_path, monkeypatch):
    src = _source(tmp_path)
    with pytest.raises(CheckpointError, match="not a checkpoint's `manifest.json`"):
        ckpt.seed(tmp_path / "b", src / "state.json")
    real = shutil.copyfile

    def tampering(a, b, *args, **kw):
        out = real(a, b, *args, **kw)
        if str(b).endswith("rng.json"):
            with open(b, "ab") as f:
                f.write(b" ")
        return out

    monkeypatch.setattr(shutil, "copyfile", tampering)
    with pytest.raises(CheckpointError, match="`rng.json` changed while they were copied"):
        ckpt.seed(tmp_path / "b", src / "manifest.json")
    assert ckpt.latest(tmp_path / "b") is None
    monkeypatch.setattr(shutil, "copyfile", real)
    (src / "optimizer.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="optimizer.pt"):
        ckpt.seed(tmp_path / "c", src / "manifest.json")
    assert ckpt.latest(tmp_path / "c") is None


def test_a_manifest_claiming_a_step_no_checkpoint_name_holds_commits_nothing(tmp_path):
    """Issue 34: a lying provider's manifest (step 2**62, files intact) is refused before anything is copied."""
    import json

    src = _source(tmp_path)
    doc = json.loads((src / "manifest.json").read_text())
    doc["step"] = 2**62
    (src / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"no valid `step` \(an integer in \[0, 99999999\]\), got `4611686018427387904`"):
        ckpt.seed(tmp_path / "b", src / "manifest.json")
    assert ckpt.latest(tmp_path / "b") is None and not list((tmp_path / "b").rglob("step-*"))
