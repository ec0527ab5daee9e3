"""The worker side of verification by replay: a graph's `verify` job (shard i of N) captures its shard
again from the prepared data alone and reports the files as `verify/capture/...`, whose digests the
coordinator compares with the capture job's (tests/coordinator/test_verify_replay.py).

On a tiny world: an honest capture job's shards are recomputed byte for byte; a capture job whose
shard was forged (features scaled by 0.5, the sidecar rewritten to hash right, so the capture itself
would accept it) is recomputed with the honest bytes, never kept from the inputs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from test_job_graph import _graph_job, _run, _spec

from dflash_worker.testing.world import build_world

N_CAPTURE = 2


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _forge(arts: list[dict], job_dir: Path) -> list[dict]:
    """The capture job's artifacts with its first shard's features scaled by 0.5 and its sidecar rewritten to match."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = []
    shard = next(a for a in arts if a["name"].endswith(".safetensors"))
    sidecar = next(a for a in arts if a["name"] == shard["name"].replace(".safetensors", ".json"))
    forged_shard, forged_sidecar = job_dir / "forged.safetensors", job_dir / "forged.json"
    with safe_open(shard["path"], "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        meta = f.metadata()
    tensors["features"] = tensors["features"] * 0.5
    save_file(tensors, str(forged_shard), metadata=meta)
    side = json.loads(Path(sidecar["path"]).read_text())
    side["sha256"] = _sha(forged_shard)
    forged_sidecar.write_text(json.dumps(side))
    for a in arts:
        if a is shard or a is sidecar:
            p = forged_shard if a is shard else forged_sidecar
            a = {**a, "path": str(p), "sha256": _sha(p), "size_bytes": p.stat().st_size}
        out.append(a)
    return out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    spec = {**_spec(build_world(root / "world")), "verify_fraction": 1}  # the coordinator's key: the worker lets it through
    prepare, _ = _graph_job(root / "prepare", spec, "prepare", 0, 1, [])
    capture, _ = _graph_job(root / "capture0", spec, "capture", 0, N_CAPTURE, [prepare])
    return root, spec, prepare, capture


def _recomputed(arts: list[dict]) -> dict[str, str]:
    assert arts and all(a["name"].startswith("verify/capture/shard-") and a["kind"] == "capture" for a in arts), arts
    return {a["name"].removeprefix("verify/"): a["sha256"] for a in arts}


@pytest.mark.slow
def test_an_honest_capture_is_recomputed_byte_for_byte(jobs):
    root, spec, prepare, capture = jobs
    arts, _ = _graph_job(root / "verify-honest", spec, "verify", 0, N_CAPTURE, [prepare, capture])
    assert _recomputed(arts) == {a["name"]: a["sha256"] for a in capture}


@pytest.mark.slow
def test_a_forged_shard_with_a_matching_sidecar_is_caught(jobs):
    root, spec, prepare, capture = jobs
    forged = _forge(capture, root)
    theirs = {a["name"]: a["sha256"] for a in forged}
    arts, log = _graph_job(root / "verify-forged", spec, "verify", 0, N_CAPTURE, [prepare, forged])
    ours = _recomputed(arts)
    assert set(ours) == set(theirs)
    differ = sorted(n for n in ours if ours[n] != theirs[n])
    assert len(differ) == 2 and differ[0].endswith(".json") and differ[1].endswith(".safetensors"), differ
    assert ours == {a["name"]: a["sha256"] for a in capture}  # the honest bytes, not the forged input kept
    assert "differs from the input" in log


def test_a_verify_job_runs_only_its_own_stage(tmp_path):
    from dflash_worker.worker.spec import GraphInfo

    g = GraphInfo(kind="verify", shard_index=0, shard_count=2)
    assert g.stages(("prepare", "check", "capture", "train", "evaluate")) == ["verify"]
    assert g.stages(("noop",)) == []
    rc, events, err = _run(tmp_path / "j", {"spec": {"stages": ["noop"]}, "graph": {"kind": "verify", "shard_index": 0, "shard_count": 1}})
    assert rc == 0 and events[-1] == {"event": "done"}, err
