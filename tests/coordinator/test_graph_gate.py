"""The regression gate in a job graph, through a real coordinator on loopback.

The train job uploads the export, evaluate shard 0 the report (`eval/report.json`): the decision on the
train job's export waits for evaluate shard 0 and is taken from its report; until then the export is not
served (`artifacts get RUN --export` says what it waits for); a run that fails first holds it back for
want of a report. `artifacts get RUN --export` and `runs publish RUN` find the export in the train job;
the status page lists the train job (and evaluate shard 0) however many capture shards come first.
"""

from __future__ import annotations

import hashlib
import json

from coordinator_helpers import Provider, run_spec
from launchers import wait_until
from test_publish import BETTER, MODEL, WORSE, cli, report, spec_json
from test_status_page import get

from dflash_worker.coordinator.artifacts.publish import REPORT_NAME
from dflash_worker.coordinator.policy import JOB_GRAPH_FEATURE
from dflash_worker.proto.dflash.v1 import provider_pb2


def _provider(coord) -> Provider:
    with coord.admin() as admin:
        p = Provider(coord.address, admin.create_provider("box"))
    p.register(features=("flash_attention_2", JOB_GRAPH_FEATURE))
    return p


def _step(p: Provider, kind: str, *, shard: int | None = None, uploads=(), outcome=provider_pb2.ATTEMPT_OUTCOME_SUCCEEDED, message="") -> provider_pb2.Lease:
    lease = p.acquire().lease
    assert lease.kind == kind, lease
    if shard is not None:
        assert lease.shard_index == shard, lease
    for name, data, art_kind in uploads:
        p.upload(lease.lease_id, name, data, kind=art_kind)
    assert p.finish(lease.lease_id, outcome, message) in ("succeeded", "failed")
    return lease


def _through_train(coord, p: Provider, name: str, *, captures: int = 1, evals: int = 2) -> tuple[str, provider_pb2.Lease]:
    with coord.admin() as admin:
        run = admin.create_run(run_spec(name, spec_json=spec_json(), capture_shards=captures, eval_shards=evals))
    _step(p, "prepare", uploads=[("data/test.jsonl", b'{"prompt": "x"}\n', "data")])
    for _ in range(captures):
        _step(p, "capture", uploads=[(f"capture/shard-{_}.safetensors", b"h" * 64, "capture")])
    train = _step(p, "train", uploads=[("run/export/model.safetensors", MODEL, "export"), ("run/export/config.json", b"{}", "export")])
    return run.run_id, train


def _train_job(coord, run_id: str) -> dict:
    shown = json.loads(cli(coord, "runs", "show", run_id, "--json").stdout)
    (train,) = [j for j in shown["jobs"] if j["kind"] == "train"]
    return train


def test_the_train_job_s_export_is_decided_from_evaluate_shard_0_s_report(start_coordinator, tmp_path):
    coord = start_coordinator(warm=True)
    p = _provider(coord)
    run_id, train = _through_train(coord, p, "graph-better")

    # Train succeeded with an export and no report of its own: undecided, not "no evaluation report".
    job = _train_job(coord, run_id)
    assert job["state"] == "succeeded" and job["export"]["name"] == "run/export/model.safetensors" and "publication" not in job, job
    assert "export not decided yet: the regression gate decides on it when the run's evaluate job (shard 0) succeeds" in cli(coord, "runs", "show", run_id).stdout
    got = cli(coord, "artifacts", "get", run_id, "--export", "-o", str(tmp_path / "early"), check=False)
    assert got.returncode == 1 and "is not published yet: it waits for the run's evaluate job" in got.stderr and "runs show" in got.stderr, got.stderr
    refused = cli(coord, "runs", "publish", run_id, "--override", check=False)
    assert refused.returncode == 1 and "has not decided on job" in refused.stderr and "evaluate job" in refused.stderr, refused.stderr

    # Evaluate shard 1 first (shard 0 needs it); its success decides nothing.
    _step(p, "evaluate", shard=1, uploads=[("eval/part-1.json", b"{}", "report")])
    assert "publication" not in _train_job(coord, run_id)
    # Evaluate shard 0 reports an improvement: the train job's export is published from that report.
    ev0 = _step(p, "evaluate", shard=0, uploads=[(REPORT_NAME, report(BETTER), "report")])
    assert ev0.job_id != train.job_id
    pub = _train_job(coord, run_id)["publication"]
    assert pub["published"] is True and pub["verdict"] == "improved" and pub["reason"].startswith("improved: acceptance length"), pub
    assert "export published: improved" in cli(coord, "runs", "show", run_id).stdout

    # `artifacts get RUN --export` finds the export in the train job, without `--job`.
    out = json.loads(cli(coord, "artifacts", "get", run_id, "--export", "-o", str(tmp_path / "export"), "--json").stdout)
    assert sorted(d["name"] for d in out) == ["run/export/config.json", "run/export/model.safetensors"]
    assert hashlib.sha256((tmp_path / "export" / "model.safetensors").read_bytes()).hexdigest() == hashlib.sha256(MODEL).hexdigest()
    # The report is evaluate shard 0's; named with `--job` it is served.
    cli(coord, "artifacts", "get", run_id, REPORT_NAME, "--job", ev0.job_id, "-o", str(tmp_path / "report.json"))
    p.close()


def test_a_regressed_graph_export_is_held_back_and_published_only_by_override(start_coordinator, tmp_path):
    coord = start_coordinator(warm=True)
    p = _provider(coord)
    run_id, _ = _through_train(coord, p, "graph-worse", evals=1)
    _step(p, "evaluate", shard=0, uploads=[(REPORT_NAME, report(WORSE), "report")])
    pub = _train_job(coord, run_id)["publication"]
    assert pub["published"] is False and pub["verdict"] == "regressed", pub
    got = cli(coord, "artifacts", "get", run_id, "--export", "-o", str(tmp_path / "export"), check=False)
    assert got.returncode == 1 and "is not published: regressed" in got.stderr, got.stderr
    # `runs publish RUN` names the train job by itself.
    out = json.loads(cli(coord, "runs", "publish", run_id, "--override", "--note", "demo", "--json").stdout)
    assert out["job_id"] == _train_job(coord, run_id)["job_id"] and out["publication"]["published"] is True
    cli(coord, "artifacts", "get", run_id, "--export", "-o", str(tmp_path / "export"))
    assert (tmp_path / "export" / "model.safetensors").read_bytes() == MODEL
    p.close()


def test_a_graph_run_that_fails_after_train_holds_the_export_back_for_want_of_a_report(start_coordinator, tmp_path):
    coord = start_coordinator(warm=True)
    p = _provider(coord)
    run_id, _ = _through_train(coord, p, "graph-failed", evals=2)
    bad = _step(p, "evaluate", shard=1, outcome=provider_pb2.ATTEMPT_OUTCOME_FAILED, message="out of memory")
    pub = _train_job(coord, run_id)["publication"]
    assert pub["published"] is False and pub["verdict"] == "", pub
    assert pub["reason"] == f"no evaluation report: job `{bad.job_id}` (evaluate shard 2/2) failed: out of memory", pub
    got = cli(coord, "artifacts", "get", run_id, "--export", "-o", str(tmp_path / "export"), check=False)
    assert got.returncode == 1 and "no evaluation report" in got.stderr and "--override" in got.stderr, got.stderr
    cli(coord, "runs", "publish", run_id, "--override", "--note", "evaluation broke; weights are fine")
    cli(coord, "artifacts", "get", run_id, "--export", "-o", str(tmp_path / "export"))
    p.close()


def test_an_evaluate_shard_0_without_a_report_holds_the_export_back_saying_so(start_coordinator):
    coord = start_coordinator(warm=True)
    p = _provider(coord)
    run_id, _ = _through_train(coord, p, "graph-noreport", evals=1)
    ev0 = _step(p, "evaluate", shard=0)
    pub = _train_job(coord, run_id)["publication"]
    assert pub["published"] is False
    assert pub["reason"] == f"the run's evaluate job `{ev0.job_id}` (shard 0) succeeded without an evaluation report (`{REPORT_NAME}`)", pub
    p.close()


def test_a_graph_left_undecided_by_a_stopped_coordinator_is_decided_at_start(start_coordinator):
    import sqlite3

    coord = start_coordinator(warm=True)
    p = _provider(coord)
    run_id, _ = _through_train(coord, p, "graph-interrupted", evals=1)
    _step(p, "evaluate", shard=0, uploads=[(REPORT_NAME, report(BETTER), "report")])
    p.close()
    coord.stop()
    db = sqlite3.connect(coord.db, isolation_level=None)
    db.execute("DELETE FROM publications")
    db.close()
    coord.start()
    pub = _train_job(coord, run_id)["publication"]
    assert pub["published"] is True and pub["verdict"] == "improved", pub


def test_the_status_page_finds_the_export_in_the_train_job_past_many_capture_shards(start_coordinator):
    coord = start_coordinator("--http-listen", "127.0.0.1:0", warm=True)
    p = _provider(coord)
    run_id, train = _through_train(coord, p, "wide", captures=60, evals=1)

    def snap_job(kind: str, want) -> dict:
        def look():
            snap = json.loads(get(coord, "/api/status", token=coord.admin_token)[2])
            (run,) = [r for r in snap["runs"] if r["run_id"] == run_id]
            jobs = [j for j in run["jobs"] if j["kind"] == kind]
            return jobs[0] if jobs and want(jobs[0]) else None

        return wait_until(look, timeout=10, interval=0.2)

    # 1 + 60 jobs come before train: the page lists it anyway, with its export held until evaluate reports.
    job = snap_job("train", lambda j: j["state"] == "succeeded")
    assert job["job_id"] == train.job_id and job["pending_gate"] is True and job["publication"] is None
    assert {a["name"]: a["downloadable"] for a in job["artifacts"]} == {"run/export/config.json": False, "run/export/model.safetensors": False}
    frag = get(coord, "/status.html", token=coord.admin_token)[2].decode()
    assert f'data-job-id="{train.job_id}" data-state="succeeded" data-kind="train"' in frag and "export not decided yet" in frag
    href = f"/artifacts/{run_id}/{train.job_id}/run/export/model.safetensors"
    assert get(coord, href, token=coord.admin_token)[0] == 409

    _step(p, "evaluate", shard=0, uploads=[(REPORT_NAME, report(BETTER), "report")])
    job = snap_job("train", lambda j: j["publication"] is not None)
    assert job["publication"]["published"] is True and job["pending_gate"] is False
    assert {a["name"]: a["downloadable"] for a in job["artifacts"]} == {"run/export/config.json": True, "run/export/model.safetensors": True}
    ev = snap_job("evaluate", lambda j: j["state"] == "succeeded")
    assert ev["has_report"] is True
    frag = get(coord, "/status.html", token=coord.admin_token)[2].decode()
    assert f'href="{href}"' in frag and "export published" in frag
    status, _, body = get(coord, href, token=coord.admin_token)
    assert status == 200 and body == MODEL
    p.close()
