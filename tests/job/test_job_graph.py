"""A run's job graph on the worker side: prepare, capture shards, train and evaluate shards,
each `python -m dflash_worker.job` in its own job directory that shares no path with the
others, fed only with the artifacts the earlier jobs reported (what the run-manager
downloads: `spec.json` ``graph.inputs``). The results must equal one whole-pipeline job's:
the capture's key and shard hashes, the export bytes, and the evaluation report."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from prewarmed import run_main

from dflash_worker.testing.world import build_world, job_spec

STAGES = ["prepare", "check", "capture", "train", "evaluate"]
N_CAPTURE, M_EVAL = 3, 2


def _spec(world) -> dict:
    spec = job_spec(world, steps=4, checkpoint_every=2, stages=STAGES)
    spec["recipe"]["train"]["val_every"] = 4
    spec["recipe"]["capture"]["shard_examples"] = 3  # 24 rows -> ~14 train+val examples -> 5 shards over 3 jobs
    spec["recipe"]["evaluate"] = {"max_new_tokens": 8}
    spec["evaluate"] = {"split": "test", "max_prompts": 3}
    return spec


def _run(job_dir: Path, doc: dict) -> tuple[int, list[dict], str]:
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "spec.json").write_text(json.dumps({"schema_version": 1, **doc}))
    out = run_main("dflash_worker.job", ["--job-dir", job_dir], timeout=600, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    return out.returncode, [json.loads(line) for line in out.stdout.splitlines()], out.stderr


def _artifacts(events: list[dict]) -> list[dict]:
    return [e for e in events if e["event"] == "artifact" and e["kind"] not in ("checkpoint", "checkpoint_file")]


def _graph_job(job_dir: Path, spec: dict, kind: str, index: int, count: int, needs: list[list[dict]]) -> tuple[list[dict], str]:
    """Place the needed jobs' artifacts in `job_dir` as the run-manager does, run the job, return its artifacts."""
    inputs = []
    for arts in needs:
        for a in arts:
            dest = job_dir / a["name"]
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(a["path"], dest)
            inputs.append({"name": a["name"], "kind": a["kind"], "sha256": a["sha256"], "size_bytes": a["size_bytes"],
                           "uri": f"dflash-artifact://run/{kind}/1/{a['name']}", "path": str(dest)})
    graph = {"kind": kind, "shard_index": index, "shard_count": count, "inputs": inputs}
    rc, events, err = _run(job_dir, {"spec": spec, "graph": graph})
    assert rc == 0, err
    assert events[-1] == {"event": "done"}, events[-3:]
    return _artifacts(events), err


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _capture_identity(capture_dir: Path) -> tuple:
    m = json.loads((capture_dir / "manifest.json").read_text())
    return m["capture_key"], [(s["file"], s["sha256"], s["first"], s["end"]) for s in m["shards"]], m["totals"]


def _report_figures(report_dir: Path) -> dict:
    r = json.loads((report_dir / "report.json").read_text())
    for k in ("run", "data", "trained_draft", "device"):  # where it ran, not what it measured
        r.pop(k)
    return r


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("world"))


@pytest.fixture(scope="module")
def graph_run(world, tmp_path_factory):
    """The same spec once as one pipeline job and once as a graph of 2 + 3 + 2 jobs."""
    root = tmp_path_factory.mktemp("graph")
    spec = _spec(world)
    rc, events, err = _run(root / "pipeline", {"spec": spec})
    assert rc == 0, err
    jobs: dict[str, list[dict]] = {}
    jobs["prepare"], _ = _graph_job(root / "prepare", spec, "prepare", 0, 1, [])
    for i in range(N_CAPTURE):
        jobs[f"capture{i}"], _ = _graph_job(root / f"capture{i}", spec, "capture", i, N_CAPTURE, [jobs["prepare"]])
    captures = [jobs[f"capture{i}"] for i in range(N_CAPTURE)]
    jobs["train"], train_log = _graph_job(root / "train", spec, "train", 0, 1, [jobs["prepare"], *captures])
    for j in range(M_EVAL - 1, -1, -1):  # shard 0 runs last: it needs the others
        others = [jobs[f"evaluate{k}"] for k in range(1, M_EVAL)] if j == 0 else []
        jobs[f"evaluate{j}"], _ = _graph_job(root / f"evaluate{j}", spec, "evaluate", j, M_EVAL, [jobs["prepare"], jobs["train"], *others])
    return root, jobs, train_log


@pytest.mark.slow
def test_graph_jobs_equal_one_pipeline_job(graph_run):
    root, jobs, train_log = graph_run
    # prepare hands every split file on, the manifest as `manifest`
    kinds = {a["name"]: a["kind"] for a in jobs["prepare"]}
    assert kinds["data/manifest.json"] == "manifest" and {"data/train.jsonl", "data/val.jsonl", "data/test.jsonl"} <= {
        n for n, k in kinds.items() if k == "data"}
    # each capture job wrote exactly its shards (k % 3 == i), no manifest; together every shard once
    owned = []
    for i in range(N_CAPTURE):
        names = sorted(a["name"] for a in jobs[f"capture{i}"])
        assert names and all(n.startswith("capture/shard-") for n in names), names
        shards = sorted({int(Path(n).name[6:11]) for n in names})
        assert all(k % N_CAPTURE == i for k in shards)
        assert not (root / f"capture{i}" / "capture" / "manifest.json").exists()
        owned += shards
    assert sorted(owned) == list(range(len(owned))) and len(owned) >= N_CAPTURE + 1
    assert "assembled" in train_log
    # the capture the train job assembled is the one-job capture: key, shard bytes, totals
    assert _capture_identity(root / "train" / "capture") == _capture_identity(root / "pipeline" / "capture")
    # the export is the same bytes (its manifest differs in the job directory's paths only)
    exports = {a["name"]: a["sha256"] for a in jobs["train"] if a["kind"] == "export"}
    assert set(exports) == {"run/export/model.safetensors", "run/export/config.json", "run/export/manifest.json"}
    for name in ("run/export/model.safetensors", "run/export/config.json"):
        assert exports[name] == _sha(root / "pipeline" / name), name
    assert "run/selection.json" in {a["name"] for a in jobs["train"]}
    # evaluate shard 1 reported only its part; shard 0 the merged report, equal to the one-job report
    assert [a["name"] for a in jobs["evaluate1"]] == ["eval/part-1.json"]
    assert {a["name"] for a in jobs["evaluate0"]} == {"eval/report.json", "eval/report.md", "eval/acceptance.png"}
    merged, whole = _report_figures(root / "evaluate0" / "eval"), _report_figures(root / "pipeline" / "eval")
    assert merged == whole
    assert merged["prompts"] == 3


@pytest.mark.slow
def test_train_job_without_every_capture_shard_fails_naming_them(graph_run, world, tmp_path):
    root, jobs, _ = graph_run
    spec = _spec(world)
    some = [a for a in jobs["capture0"] + jobs["capture2"]]  # capture job 1's shards are missing
    job = tmp_path / "train"
    inputs = []
    for a in jobs["prepare"] + some:
        dest = job / a["name"]
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(a["path"], dest)
        inputs.append({"name": a["name"], "kind": a["kind"], "sha256": a["sha256"], "size_bytes": a["size_bytes"], "uri": "x", "path": str(dest)})
    rc, events, err = _run(job, {"spec": spec, "graph": {"kind": "train", "shard_index": 0, "shard_count": 1, "inputs": inputs}})
    assert rc != 0
    msg = events[-1]["message"]
    assert events[-1]["event"] == "error" and "capture shards are missing" in msg and "shard 1" in msg, msg
    assert not (job / "run").exists() or not any((job / "run").iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("tamper", ["other-prompts", "bad-row", "not-json", "missing"])
def test_evaluate_merge_refuses_a_lying_part(graph_run, world, tmp_path, tamper):
    """Shard 0 merges another provider's rows: a part that does not cover exactly its prompts, or whose rows are
    malformed, fails the job naming the file, and no report is written."""
    root, jobs, _ = graph_run
    spec = _spec(world)
    job = tmp_path / "evaluate0"
    inputs = []
    for a in jobs["prepare"] + jobs["train"] + jobs["evaluate1"]:
        dest = job / a["name"]
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(a["path"], dest)
        inputs.append({"name": a["name"], "kind": a["kind"], "sha256": a["sha256"], "size_bytes": a["size_bytes"], "uri": "x", "path": str(dest)})
    part = job / "eval" / "part-1.json"
    doc = json.loads(part.read_text())
    if tamper == "other-prompts":
        doc["rows"] = doc["rows"] + [[0, doc["rows"][0][1]]]
        part.write_text(json.dumps(doc))
    elif tamper == "bad-row":
        doc["rows"][0][1]["trained"]["acceptance_lengths"] = ["x"]
        part.write_text(json.dumps(doc))
    elif tamper == "not-json":
        part.write_bytes(b"\x00" * 10)
    else:
        part.unlink()
    rc, events, err = _run(job, {"spec": spec, "graph": {"kind": "evaluate", "shard_index": 0, "shard_count": M_EVAL, "inputs": inputs}})
    assert rc != 0
    msg = events[-1]["message"]
    assert events[-1]["event"] == "error" and "evaluate part" in msg and "part-1.json" in msg, msg
    assert not (job / "eval" / "report.json").exists()


@pytest.mark.slow
def test_a_re_leased_capture_job_keeps_the_shards_its_lost_attempt_committed(graph_run, world, tmp_path):
    """The coordinator hands a capture job's next attempt the shards an earlier one uploaded (as inputs, on
    another machine): they are verified and kept, only the rest is captured, and the bytes are the same."""
    root, jobs, _ = graph_run
    spec = _spec(world)
    first = sorted(jobs["capture0"], key=lambda a: a["name"])
    shard = min(int(Path(a["name"]).name[6:11]) for a in first)
    earlier = [a for a in first if int(Path(a["name"]).name[6:11]) == shard]  # the lost attempt committed one shard
    assert len(earlier) == 2 and len(first) > 2, first
    again, log = _graph_job(tmp_path / "capture0", spec, "capture", 0, N_CAPTURE, [jobs["prepare"], earlier])
    assert "(1 shards reused)" in log, log
    assert sorted((a["name"], a["sha256"]) for a in again) == [(a["name"], a["sha256"]) for a in first]
