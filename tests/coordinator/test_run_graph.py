"""Runs as job graphs: prepare -> capture x N -> train -> evaluate x M.

Store-level tests on a real SQLite file (leasing order, failure propagation, the v4 migration),
and the same over gRPC on a real coordinator process on loopback (CreateRun, the Lease's kind,
shard and inputs, downloading an input, `runs show`, hostile shard counts).
"""

from __future__ import annotations

import dataclasses
import hashlib
import sqlite3

import grpc
import pytest
from coordinator_helpers import registration, run_spec

from dflash_worker.coordinator.artifacts.names import Claim, check_kind
from dflash_worker.coordinator.policy import JOB_GRAPH_FEATURE
from dflash_worker.coordinator.store import MAX_SHARDS, SCHEMA_VERSION, Grant, Quotas, RunSpecData, Store
from dflash_worker.errors import InvalidRequestError, NotFoundError, QuotaError
from dflash_worker.proto.dflash.v1 import admin_pb2, admin_pb2_grpc, provider_pb2

REG = registration(features=(JOB_GRAPH_FEATURE,))


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "coordinator.db")
    yield s
    s.close()


def _provider(store: Store, name: str = "box") -> str:
    pid, _ = store.credentials.create_provider(name)
    store.providers.register(pid, REG)
    return pid


def _graph(store: Store, name: str = "g", *, n: int = 3, m: int = 0, spec_json: str = "{}"):
    run = store.runs.create_run(RunSpecData(name=name, spec_json=spec_json, required_client_version="0.1.0", capture_shards=n, eval_shards=m))
    jobs, _ = store.runs.run_jobs(run.run_id)
    return run, jobs


def _lease(store: Store, pid: str) -> Grant | None:
    g = store.leases.acquire(pid)
    assert g is None or isinstance(g, Grant), g
    return g


def _record(store: Store, pid: str, g: Grant, name: str, kind: str = "capture") -> Claim:
    data = f"{g.job_id}/{name}".encode()
    claim = Claim(name=name, kind=kind, sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data), step=0)
    store.records.record(store.leases.live_lease(pid, g.lease_id), claim)
    return claim


def test_a_graph_run_has_its_jobs_and_edges(store):
    run, jobs = _graph(store, n=3, m=2)
    assert run.spec.num_jobs == 7 and (run.spec.capture_shards, run.spec.eval_shards) == (3, 2)
    assert [(j.kind, j.shard_index, j.shard_count) for j in jobs] == [
        ("prepare", 0, 1),
        ("capture", 0, 3),
        ("capture", 1, 3),
        ("capture", 2, 3),
        ("train", 0, 1),
        ("evaluate", 0, 2),
        ("evaluate", 1, 2),
    ]
    prepare, captures, train, evals = jobs[0], jobs[1:4], jobs[4], jobs[5:]
    assert prepare.needs == ()
    assert all(c.needs == (prepare.job_id,) == c.waiting_for for c in captures)
    # Every later job needs prepare (the prepared data); train every shard; evaluate shard 0 the other shards.
    assert train.needs == (prepare.job_id, *(c.job_id for c in captures)) == train.waiting_for
    assert evals[0].needs == (prepare.job_id, train.job_id, evals[1].job_id)
    assert evals[1].needs == (prepare.job_id, train.job_id)
    assert run.job_states == {"queued": 7}


@pytest.mark.parametrize("n, m", [(1, 1), (1, 3), (4, 2), (2, 5)])
def test_graph_edges_for_every_shape(n, m):
    spec = RunSpecData(name="g", spec_json="{}", required_client_version="0.1.0", capture_shards=n, eval_shards=m)
    graph = spec.graph()
    kinds = [k for k, *_ in graph]
    assert kinds == ["prepare", *["capture"] * n, "train", *["evaluate"] * m]
    needs = {(k, i): set(d) for k, i, _, d in graph}
    assert needs[("prepare", 0)] == set()
    assert all(needs[("capture", i)] == {0} for i in range(n))
    assert needs[("train", 0)] == {0, *range(1, n + 1)}
    assert needs[("evaluate", 0)] == {0, n + 1, *range(n + 3, n + 2 + m)}
    assert all(needs[("evaluate", j)] == {0, n + 1} for j in range(1, m))
    # Every edge points at an existing job, never at itself, and the graph has no cycle (creation order is
    # not a topological order: evaluate shard 0 needs the shards created after it).
    assert all(d != i and 0 <= d < len(graph) for i, (*_, ds) in enumerate(graph) for d in ds)
    done: set[int] = set()
    while len(done) < len(graph):
        ready = {i for i, (*_, ds) in enumerate(graph) if i not in done and set(ds) <= done}
        assert ready, "cycle"
        done |= ready


def test_eval_shards_default_to_one(store):
    run, jobs = _graph(store, n=1)
    assert run.spec.eval_shards == 1 and [j.kind for j in jobs] == ["prepare", "capture", "train", "evaluate"]


def test_leasing_follows_the_graph(store):
    pid = _provider(store)
    run, jobs = _graph(store, n=2, m=2)
    g = _lease(store, pid)
    assert (g.job_id, g.kind, g.inputs) == (jobs[0].job_id, "prepare", ())
    # Nothing else is leasable while prepare runs: captures wait for it.
    assert _lease(store, _provider(store, "other")) is None
    prep = _record(store, pid, g, "data/manifest.json", kind="manifest")
    _record(store, pid, g, "ckpt/manifest.json.part", kind="checkpoint_file")  # a job's own; not an input
    assert store.leases.finish(pid, g.lease_id, "succeeded", "") == "succeeded"

    c0, c1 = _lease(store, pid), _lease(store, pid)
    assert [(c.kind, c.shard_index, c.shard_count) for c in (c0, c1)] == [("capture", 0, 2), ("capture", 1, 2)]
    assert [(a.name, a.sha256) for a in c0.inputs] == [(prep.name, prep.sha256)] == [(a.name, a.sha256) for a in c1.inputs]
    assert f"/{jobs[0].job_id}/" in c0.inputs[0].uri
    # A capture may download prepare's artifact, not another run's or a checkpoint of prepare's.
    assert store.leases.find_input(c0.job_id, prep.name, prep.sha256).sha256 == prep.sha256
    # Train waits for every capture shard.
    assert _lease(store, pid) is None
    shard0 = _record(store, pid, c0, "capture/shard-0.safetensors")
    store.leases.finish(pid, c0.lease_id, "succeeded", "")
    assert _lease(store, pid) is None
    (train,) = [j for j in store.runs.run_jobs(run.run_id)[0] if j.kind == "train"]
    assert train.waiting_for == (c1.job_id,)
    shard1 = _record(store, pid, c1, "capture/shard-1.safetensors")
    store.leases.finish(pid, c1.lease_id, "succeeded", "")

    t = _lease(store, pid)
    # Train gets the prepared data and every shard, in job order.
    assert t.kind == "train" and [a.sha256 for a in t.inputs] == [prep.sha256, shard0.sha256, shard1.sha256]
    assert store.leases.find_input(t.job_id, prep.name, prep.sha256).sha256 == prep.sha256
    with pytest.raises(NotFoundError, match="no artifact"):
        store.leases.find_input(c0.job_id, shard1.name, shard1.sha256)  # a sibling shard's output is not an input
    assert _lease(store, pid) is None
    model = _record(store, pid, t, "run/export/model.safetensors", kind="export")
    store.leases.finish(pid, t.lease_id, "succeeded", "")
    # Evaluate shard 0 merges the other shards' rows: it waits for shard 1.
    e1 = _lease(store, pid)
    assert (e1.kind, e1.shard_index) == ("evaluate", 1)
    assert [a.sha256 for a in e1.inputs] == [prep.sha256, model.sha256]
    assert _lease(store, pid) is None
    (ev0,) = [j for j in store.runs.run_jobs(run.run_id)[0] if j.kind == "evaluate" and j.shard_index == 0]
    assert ev0.waiting_for == (e1.job_id,)
    part = _record(store, pid, e1, "eval/part-1.jsonl", kind="report")
    store.leases.finish(pid, e1.lease_id, "succeeded", "")
    e0 = _lease(store, pid)
    assert (e0.kind, e0.shard_index) == ("evaluate", 0)
    assert [a.sha256 for a in e0.inputs] == [prep.sha256, model.sha256, part.sha256]
    store.leases.finish(pid, e0.lease_id, "succeeded", "")
    assert store.runs.get_run(run.run_id).job_states == {"succeeded": 6} and store.runs.get_run(run.run_id).failure == ""


def test_prepare_s_data_files_are_inputs_of_every_later_job_and_count_against_quotas(tmp_path):
    """Artifact kind `data`: prepare's split files. Accepted, listed, counted by both quotas, and handed on."""
    store = Store(tmp_path / "c.db", quotas=Quotas(attempt_records=3, run_bytes=10_000))
    try:
        pid = _provider(store)
        run, jobs = _graph(store, n=1, m=1)
        g = _lease(store, pid)
        assert check_kind("data") == "data"
        with pytest.raises(InvalidRequestError, match="is not one of"):
            check_kind("dataset")
        files = [_record(store, pid, g, f"data/{split}.jsonl", kind="data") for split in ("train", "test", "val")]
        # The attempt quota counts `data` records like any other.
        with pytest.raises(QuotaError, match="attempt quota is 3 records"):
            _record(store, pid, g, "data/extra.jsonl", kind="data")
        listed, _ = store.records.list_artifacts(g.job_id, all_attempts=True)
        assert [(a.record.name, a.record.kind) for a in listed] == [(f.name, "data") for f in files]
        store.leases.finish(pid, g.lease_id, "succeeded", "")
        assert [a.record.kind for a in store.records.list_artifacts(g.job_id, all_attempts=False)[0]] == ["data"] * 3
        c = _lease(store, pid)
        assert [(a.name, a.kind) for a in c.inputs] == [(f.name, "data") for f in files]
        store.leases.finish(pid, c.lease_id, "succeeded", "")
        t = _lease(store, pid)
        assert [a.kind for a in t.inputs] == ["data"] * 3
        assert all(store.leases.find_input(t.job_id, f.name, f.sha256).kind == "data" for f in files)
        # The run quota counts them too: bytes already stored by prepare's `data` files are part of the sum.
        stored = sum(f.size_bytes for f in files)
        big = Claim(name="run/export/model.safetensors", kind="export", sha256="0" * 64, size_bytes=10_000 - stored + 1, step=0)
        with pytest.raises(QuotaError, match=f"run already stores {stored} bytes"):
            store.records.record(store.leases.live_lease(pid, t.lease_id), big)
    finally:
        store.close()


def test_a_retryable_capture_is_requeued_and_train_still_waits(store):
    pid = _provider(store)
    _graph(store, n=1, m=1)
    store.leases.finish(pid, _lease(store, pid).lease_id, "succeeded", "")
    c = _lease(store, pid)
    assert store.leases.finish(pid, c.lease_id, "retryable", "oom") == "queued"
    again = _lease(store, pid)
    assert (again.job_id, again.attempt, again.kind) == (c.job_id, 2, "capture")
    assert _lease(store, pid) is None


def test_a_re_leased_capture_job_gets_its_earlier_attempts_shards_as_inputs(store):
    """A capture provider lost mid-job: under `trust_inputs = "any"` the next attempt, anywhere, is handed
    the shards the lost one committed (the newest record of each name), so it captures only the rest
    (the default policy's rule: tests/coordinator/test_trust_inputs.py)."""
    pid, other = _provider(store), _provider(store, "other")
    _graph(store, n=1, m=1, spec_json='{"trust_inputs": "any"}')
    p = _lease(store, pid)
    prep = _record(store, pid, p, "data/manifest.json", kind="manifest")
    store.leases.finish(pid, p.lease_id, "succeeded", "")
    c = _lease(store, pid)
    assert [a.name for a in c.inputs] == ["data/manifest.json"]
    shard = _record(store, pid, c, "capture/shard-00000.safetensors")
    side = _record(store, pid, c, "capture/shard-00000.json")
    _record(store, pid, c, "capture/notes.txt", kind="report")  # not a capture record: not handed on
    assert store.leases.finish(pid, c.lease_id, "retryable", "provider lost") == "queued"
    again = _lease(store, other)
    assert (again.job_id, again.attempt) == (c.job_id, 2)
    assert [(a.name, a.sha256) for a in again.inputs] == [(prep.name, prep.sha256), (shard.name, shard.sha256), (side.name, side.sha256)]
    assert f"/{c.job_id}/" in again.inputs[1].uri
    # the new provider may download them (its own job's records), the last attempt's when a name repeats
    assert store.leases.find_input(again.job_id, shard.name, shard.sha256).sha256 == shard.sha256
    newer = Claim(name=shard.name, kind="capture", sha256=hashlib.sha256(b"newer").hexdigest(), size_bytes=5, step=0)
    store.records.record(store.leases.live_lease(other, again.lease_id), newer)
    assert store.leases.finish(other, again.lease_id, "retryable", "lost again") == "queued"
    third = _lease(store, pid)
    assert [(a.name, a.sha256) for a in third.inputs if a.kind == "capture"] == [(side.name, side.sha256), (shard.name, newer.sha256)]
    # train still waits for the capture job; no other job gets these records
    store.leases.finish(pid, third.lease_id, "succeeded", "")
    t = _lease(store, pid)
    assert t.kind == "train"


def test_a_success_that_makes_jobs_ready_wakes_the_long_polls(tmp_path):
    """Providers waiting in AcquireLease's long poll are woken when a job's success readies the next jobs
    (not only when a job is queued), so an idle provider takes a capture shard at once."""
    woken = []
    s = Store(tmp_path / "c.db", on_work=lambda: woken.append(1))
    try:
        pid = _provider(s)
        _graph(s, n=2, m=1)
        woken.clear()
        p = _lease(s, pid)
        assert s.leases.finish(pid, p.lease_id, "succeeded", "") == "succeeded"
        assert woken == [1], "prepare's success readies the capture jobs"
        c0 = _lease(s, pid)
        woken.clear()
        s.leases.finish(pid, c0.lease_id, "succeeded", "")
        assert woken == [], "train still waits for the other capture: nothing new to lease"
        c1 = _lease(s, pid)
        s.leases.finish(pid, c1.lease_id, "succeeded", "")
        assert woken == [1], "the last capture readies train"
        t = _lease(s, pid)
        assert t.kind == "train"
        woken.clear()
        s.leases.finish(pid, t.lease_id, "succeeded", "")
        assert woken == [1]  # train readies evaluate
        e = _lease(s, pid)
        assert e.kind == "evaluate"
        woken.clear()
        s.leases.finish(pid, e.lease_id, "succeeded", "")
        assert woken == [], "the last job readies nothing"
        # a pipeline job's success readies nothing either
        s.runs.create_run(RunSpecData(name="pipe", spec_json="{}", required_client_version="0.1.0"))
        pipe = _lease(s, pid)
        assert pipe.kind == "pipeline"
        woken.clear()
        s.leases.finish(pid, pipe.lease_id, "succeeded", "")
        assert woken == []
    finally:
        s.close()


def test_a_failed_capture_fails_its_dependents_and_the_run(store):
    pid = _provider(store)
    run, jobs = _graph(store, n=3, m=2)
    store.leases.finish(pid, _lease(store, pid).lease_id, "succeeded", "")
    c0, c1 = _lease(store, pid), _lease(store, pid)
    assert store.leases.finish(pid, c0.lease_id, "failed", "bad shard data") == "failed"
    run = store.runs.get_run(run.run_id)
    assert f"job `{c0.job_id}` (capture shard 1/3) failed: bad shard data" == run.failure
    by_id = {j.job_id: j for j in store.runs.run_jobs(run.run_id)[0]}
    # The queued shard, train and evaluates fail naming the job; the running shard goes on.
    for j in jobs[3:]:
        assert by_id[j.job_id].state == "failed" and c0.job_id in by_id[j.job_id].reason, by_id[j.job_id]
    assert by_id[c1.job_id].state == "leased"
    assert _lease(store, pid) is None
    # The running shard, requeued, fails too instead of running again for a failed run.
    assert store.leases.finish(pid, c1.lease_id, "retryable", "crash") == "failed"
    assert store.runs.get_run(run.run_id).failure == run.failure
    assert store.runs.get_run(run.run_id).job_states == {"succeeded": 1, "failed": 6}


def test_a_job_needing_more_inputs_than_a_lease_names_fails(store, monkeypatch):
    from dflash_worker.coordinator import store as store_mod

    monkeypatch.setattr(store_mod.leases, "MAX_LEASE_INPUTS", 1)
    pid = _provider(store)
    run, jobs = _graph(store, n=2, m=1)
    store.leases.finish(pid, _lease(store, pid).lease_id, "succeeded", "")
    for _ in range(2):
        c = _lease(store, pid)
        _record(store, pid, c, f"capture/shard-{c.shard_index}.safetensors")
        store.leases.finish(pid, c.lease_id, "succeeded", "")
    # Train needs 2 input artifacts, more than a lease may name: it fails instead of being leased short.
    assert _lease(store, pid) is None
    by_kind = {j.kind: j for j in store.runs.run_jobs(run.run_id)[0]}
    assert by_kind["train"].state == "failed" and "more than 1 final artifacts" in by_kind["train"].reason
    assert by_kind["evaluate"].state == "failed" and "train" in store.runs.get_run(run.run_id).failure


def test_a_provider_s_message_reaches_the_failure_without_control_characters(store):
    pid = _provider(store)
    run, _ = _graph(store, n=1)
    g = _lease(store, pid)
    store.leases.finish(pid, g.lease_id, "failed", "bad\x1b[31m red\x07 " + "x" * 2000)
    failure = store.runs.get_run(run.run_id).failure
    assert "\x1b" not in failure and "\x07" not in failure and "bad?[31m red? " in failure and len(failure) < 700


def test_a_train_out_of_attempts_fails_the_evaluations(tmp_path):
    store = Store(tmp_path / "c.db", max_attempts=1)
    try:
        pid = _provider(store)
        run, jobs = _graph(store, n=1, m=1)
        for _ in range(2):
            store.leases.finish(pid, _lease(store, pid).lease_id, "succeeded", "")
        t = _lease(store, pid)
        assert store.leases.finish(pid, t.lease_id, "retryable", "crashed") == "failed"
        ev = store.runs.run_jobs(run.run_id)[0][-1]
        assert ev.state == "failed" and f"job `{t.job_id}` (train) failed: crashed" in ev.reason
    finally:
        store.close()


def test_cancelling_a_queued_job_fails_the_graph_run(store):
    run, jobs = _graph(store, n=2)
    assert store.jobs.cancel_job(jobs[0].job_id) == "cancelled"
    r = store.runs.get_run(run.run_id)
    assert r.failure.startswith(f"job `{jobs[0].job_id}` (prepare) cancelled")
    assert r.job_states == {"cancelled": 1, "failed": 4}


def test_graph_jobs_go_only_to_providers_that_run_graph_jobs(store):
    """A run-manager that does not offer `job_graph` (an older one) is never leased a graph job (it would run the whole pipeline)."""
    old = dataclasses.replace(REG, features=("flash_attention_2",))
    pid, _ = store.credentials.create_provider("old")
    store.providers.register(pid, old)
    run, jobs = _graph(store, n=2)
    assert JOB_GRAPH_FEATURE in store.runs.get_run(run.run_id).spec.required_features
    assert _lease(store, pid) is None
    # The same provider still gets pipeline jobs; one that offers the feature gets the graph's first job.
    store.runs.create_run(RunSpecData(name="plain", spec_json="{}", required_client_version="0.1.0"))
    assert _lease(store, pid).kind == "pipeline"
    assert _lease(store, _provider(store, "new")).job_id == jobs[0].job_id


def test_pipeline_runs_are_unchanged(store):
    pid = _provider(store)
    run = store.runs.create_run(RunSpecData(name="p", spec_json="{}", required_client_version="0.1.0", num_jobs=3))
    jobs, _ = store.runs.run_jobs(run.run_id)
    assert [(j.kind, j.shard_index, j.shard_count, j.needs) for j in jobs] == [("pipeline", 0, 1, ())] * 3
    assert (run.spec.num_jobs, run.spec.capture_shards, run.spec.eval_shards) == (3, 0, 0)
    grants = [_lease(store, pid) for _ in range(3)]
    assert [g.job_id for g in grants] == [j.job_id for j in jobs]
    assert all((g.kind, g.shard_index, g.shard_count, g.inputs) == ("pipeline", 0, 1, ()) for g in grants)
    # One job failing fails nothing else, as before job graphs.
    assert store.leases.finish(pid, grants[0].lease_id, "failed", "x") == "failed"
    assert store.runs.get_run(run.run_id).failure == "" and store.runs.get_run(run.run_id).job_states == {"failed": 1, "leased": 2}
    assert store.jobs.cancel_job(jobs[1].job_id) == "cancelling"


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(capture_shards=-1), "capture_shards` must be 0-1024"),
        (dict(capture_shards=MAX_SHARDS + 1), "capture_shards` must be 0-1024"),
        (dict(capture_shards=2**32), "capture_shards` must be 0-1024"),
        (dict(capture_shards=1, eval_shards=-3), "eval_shards` must be 0-1024"),
        (dict(capture_shards=1, eval_shards=10**9), "eval_shards` must be 0-1024"),
        (dict(eval_shards=2), "eval_shards` needs `spec.capture_shards"),
        (dict(capture_shards=2, num_jobs=3), "does not apply to a job graph"),
    ],
)
def test_bad_shard_counts_are_refused(store, kw, match):
    with pytest.raises(InvalidRequestError, match=match):
        RunSpecData(name="bad", spec_json="{}", required_client_version="0.1.0", **kw)


def test_the_largest_graph_is_created(store):
    run, _ = _graph(store, n=MAX_SHARDS, m=MAX_SHARDS)
    assert run.spec.num_jobs == 2 + 2 * MAX_SHARDS
    jobs, token = store.runs.run_jobs(run.run_id, page_size=1000)
    assert len(jobs) == 1000 and token
    train = store.db.execute(
        "SELECT COUNT(*) FROM job_deps d JOIN jobs j ON j.job_id=d.job_id WHERE j.kind='train' AND j.run_id=?", (run.run_id,)
    )
    assert train.fetchone() == (MAX_SHARDS + 1,)  # prepare and every shard
    ev0 = store.db.execute(
        "SELECT COUNT(*) FROM job_deps d JOIN jobs j ON j.job_id=d.job_id WHERE j.kind='evaluate' AND j.shard_index=0 AND j.run_id=?", (run.run_id,)
    )
    assert ev0.fetchone() == (MAX_SHARDS + 1,)  # prepare, train and the other 1,023 shards
    # Exactly as many shards as given; an exact graph's `num_jobs` is accepted too.
    RunSpecData(name="ok", spec_json="{}", required_client_version="0.1.0", capture_shards=2, eval_shards=1, num_jobs=5)


# --- migration from schema 4 ----------------------------------------------------------


def test_a_version_4_database_is_migrated(tmp_path):
    """A v4 database (no job kinds, no graph) opens as v5: its jobs are pipeline jobs and lease as before."""
    path = tmp_path / "coordinator.db"
    store = Store(path)
    pid = _provider(store)
    run = store.runs.create_run(RunSpecData(name="old", spec_json="{}", required_client_version="0.1.0", num_jobs=2))
    leased = _lease(store, pid)
    store.close()
    # What a schema-4 coordinator left: no job_deps, no kind/shard/reason columns, no run shard columns.
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("DROP TABLE job_deps")
    db.execute("DROP TABLE placements")
    db.execute("ALTER TABLE providers DROP COLUMN memory_bytes")
    db.execute("DROP INDEX jobs_ready")
    db.execute("DROP INDEX jobs_by_kind")
    for col in ("kind", "shard_index", "shard_count", "reason", "pending_deps"):
        db.execute(f"ALTER TABLE jobs DROP COLUMN {col}")
    for col in ("capture_shards", "eval_shards", "failure"):
        db.execute(f"ALTER TABLE runs DROP COLUMN {col}")
    db.execute("DROP TABLE attempt_inputs")  # nor what schema 7 added (trust_inputs, provenance)
    db.execute("ALTER TABLE runs DROP COLUMN trust_inputs")
    for col in ("quarantined_unix", "quarantine_reason"):  # nor what schema 8 added (verification by replay)
        db.execute(f"ALTER TABLE providers DROP COLUMN {col}")
    db.execute("DROP TABLE audit_log")  # nor what schema 9 added
    db.execute("UPDATE meta SET value='4' WHERE key='schema_version'")
    db.close()

    store = Store(path)
    try:
        assert store.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == (str(SCHEMA_VERSION),)
        jobs, _ = store.runs.run_jobs(run.run_id)
        assert [(j.kind, j.shard_count, j.needs, j.state) for j in jobs] == [("pipeline", 1, (), "leased"), ("pipeline", 1, (), "queued")]
        r = store.runs.get_run(run.run_id)
        assert (r.spec.capture_shards, r.spec.eval_shards, r.failure) == (0, 0, "")
        assert store.db.execute("SELECT COUNT(*) FROM jobs WHERE pending_deps != 0").fetchone() == (0,)
        assert store.db.execute("SELECT 1 FROM sqlite_master WHERE type='index' AND name='jobs_ready'").fetchone() == (1,)
        # The old lease is still live; the other job leases as a pipeline job; failing it fails nothing else.
        assert store.leases.finish(pid, leased.lease_id, "succeeded", "") == "succeeded"
        g = _lease(store, pid)
        assert g.kind == "pipeline" and g.inputs == ()
        assert store.leases.finish(pid, g.lease_id, "failed", "x") == "failed" and store.runs.get_run(run.run_id).failure == ""
        # New graph runs work on the migrated database.
        _, gjobs = _graph(store, n=2)
        assert [j.kind for j in gjobs] == ["prepare", "capture", "capture", "train", "evaluate"]
    finally:
        store.close()


# --- over gRPC --------------------------------------------------------------------------


def test_graph_run_over_grpc(coordinator, provider_factory, capsys):
    from dflash_worker.coordinator.cli import main as cli_main

    p = provider_factory()
    p.register(features=("flash_attention_2", JOB_GRAPH_FEATURE))
    with coordinator.admin() as admin:
        run = admin.create_run(run_spec("graph", capture_shards=2, eval_shards=1))
        assert JOB_GRAPH_FEATURE in run.spec.required_features
        assert (run.spec.num_jobs, run.spec.capture_shards, run.spec.eval_shards) == (5, 2, 1)
        prep = p.acquire().lease
        assert (prep.kind, prep.shard_index, prep.shard_count, list(prep.inputs)) == ("prepare", 0, 1, [])
        assert p.acquire().WhichOneof("result") == "no_work"
        data = b'{"examples": 10}'
        p.upload(prep.lease_id, "data/manifest.json", data, kind="manifest")
        p.upload(prep.lease_id, "data/test.jsonl", b'{"prompt": "hi"}\n', kind="data")
        assert p.finish(prep.lease_id) == "succeeded"
        listed = admin.list_artifacts(run.run_id, prep.job_id)
        assert [(a.artifact.name, a.artifact.kind) for a in listed] == [("data/manifest.json", "manifest"), ("data/test.jsonl", "data")]
        cap = p.acquire().lease
        assert (cap.kind, cap.shard_index, cap.shard_count) == ("capture", 0, 2)
        inp, split = cap.inputs
        assert (split.name, split.kind) == ("data/test.jsonl", "data")
        assert (inp.name, inp.sha256, inp.size_bytes) == ("data/manifest.json", hashlib.sha256(data).hexdigest(), len(data))
        # The capture's lease may download its input, though it is another job's.
        header, body = p.download(cap.lease_id, inp.name, inp.sha256)
        assert body == data and header.sha256 == inp.sha256
        assert p.finish(cap.lease_id, provider_pb2.ATTEMPT_OUTCOME_FAILED, "shard 0 broke") == "failed"

        resp = admin.get_run(run.run_id)
        assert f"job `{cap.job_id}` (capture shard 1/2) failed: shard 0 broke" == resp.run.failure
        jobs = list(resp.jobs)
        assert [(j.kind, j.shard_index, j.shard_count, j.state) for j in jobs] == [
            ("prepare", 0, 1, "succeeded"),
            ("capture", 0, 2, "failed"),
            ("capture", 1, 2, "failed"),
            ("train", 0, 1, "failed"),
            ("evaluate", 0, 1, "failed"),
        ]
        assert list(jobs[3].needs) == [jobs[0].job_id, jobs[1].job_id, jobs[2].job_id]
        assert list(jobs[3].waiting_for) == [jobs[1].job_id, jobs[2].job_id]
        assert cap.job_id in jobs[4].reason
        assert p.acquire().WhichOneof("result") == "no_work"

        # A second graph run, for `runs show` of a queued graph.
        run2 = admin.create_run(run_spec("graph2", capture_shards=3))
    env = ["--server", coordinator.address, f"--admin-token={coordinator.admin_token}"]
    assert cli_main(["runs", "show", run2.run_id, *env]) == 0
    out = capsys.readouterr().out
    assert (
        "prepare  queued" in out and "capture 2/3  queued" in out and "waits for 4 of 4 jobs it needs" in out and "evaluate  queued" in out
    )
    assert cli_main(["runs", "show", run.run_id, *env]) == 0
    out = capsys.readouterr().out
    assert f"run failed: job `{cap.job_id}`" in out and "capture 1/2  failed" in out
    assert (
        cli_main(
            [
                "runs",
                "create",
                "--name",
                "g3",
                "--spec-json",
                "{}",
                "--client-version",
                "0.1.0",
                "--capture-shards",
                "4",
                "--eval-shards",
                "2",
                "--json",
                *env,
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert '"capture_shards": 4' in out and '"eval_shards": 2' in out and '"num_jobs": 8' in out
    with pytest.raises(SystemExit):
        cli_main(["runs", "create", "--name", "g4", "--spec-json", "{}", "--client-version", "0.1.0", "--capture-shards", "-1", *env])
    assert "must be a whole number from 0 to 1024" in capsys.readouterr().err


def test_hostile_shard_counts_over_grpc(coordinator):
    channel = grpc.insecure_channel(coordinator.address)
    stub = admin_pb2_grpc.AdminServiceStub(channel)
    md = (("authorization", f"Bearer {coordinator.admin_token}"),)
    try:
        for kw in (
            dict(capture_shards=2**32 - 1),
            dict(capture_shards=1025),
            dict(capture_shards=1, eval_shards=5000),
            dict(eval_shards=1),
            dict(capture_shards=2, num_jobs=9),
        ):
            with pytest.raises(grpc.RpcError) as e:
                stub.CreateRun(admin_pb2.CreateRunRequest(spec=run_spec("bad", **kw)), metadata=md, timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kw
            assert "shards" in e.value.details() or "job graph" in e.value.details(), e.value.details()
        assert list(stub.ListRuns(admin_pb2.ListRunsRequest(), metadata=md, timeout=10).runs) == []
        # The cap itself is accepted.
        run = stub.CreateRun(
            admin_pb2.CreateRunRequest(spec=run_spec("cap", capture_shards=1024, eval_shards=1024)), metadata=md, timeout=30
        ).run
        assert run.spec.num_jobs == 2050 and run.job_states == {"queued": 2050}
    finally:
        channel.close()
