"""Placement per job kind: a job graph's `spec_json.placement` decides which providers take each kind.

Validation at run creation (hostile shapes and numbers refused, naming the field), leasing on a real
SQLite store (memory, per-kind features, per-kind ranks, UpgradeRequired only for work the provider
fits), the v5 -> v6 migration (declared memory read from the stored capabilities), and the same over
gRPC on a real coordinator process.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3

import grpc
import pytest
from coordinator_helpers import run_spec

from dflash_worker.coordinator.policy import (
    JOB_GRAPH_FEATURE,
    Placement,
    ProviderProfile,
    RunRequirements,
    Verdict,
    check_placement,
    decide,
    format_bytes,
)
from dflash_worker.coordinator.store import SCHEMA_VERSION, Grant, Registration, RunSpecData, Store, Upgrade
from dflash_worker.errors import InvalidRequestError
from dflash_worker.proto.dflash.v1 import admin_pb2, admin_pb2_grpc, provider_pb2

GiB = 1 << 30
TiB = 1 << 40


def _reg(*, memory: int = 8 * GiB, backend: str = "cpu", count: int = 1, features=(JOB_GRAPH_FEATURE,), version: str = "0.1.0") -> Registration:
    caps = provider_pb2.DeviceCapabilities(backend=backend, device_count=count, memory_bytes=memory, features=list(features))
    return Registration(
        client_version=version, native_client_version="", launch_mode=1, native=False, backend=backend, device_count=count,
        features=tuple(features), capabilities=caps.SerializeToString(), name="box", memory_bytes=memory,
    )  # fmt: skip


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "coordinator.db")
    yield s
    s.close()


def _provider(store: Store, name: str, **kw) -> str:
    pid, _ = store.credentials.create_provider(name)
    store.providers.register(pid, dataclasses.replace(_reg(**kw), name=name))
    return pid


def _spec(placement=..., *, name="g", n=2, m=1, **kw) -> RunSpecData:
    """A graph run's spec; `placement` goes into its spec JSON (`...`: no `placement` key)."""
    doc = {"stages": ["train"]} if placement is ... else {"stages": ["train"], "placement": placement}
    return RunSpecData(name=name, spec_json=json.dumps(doc), required_client_version="0.1.0", capture_shards=n, eval_shards=m, **kw)


def _lease(store: Store, pid: str) -> Grant | None:
    g = store.leases.acquire(pid)
    assert g is None or isinstance(g, Grant), g
    return g


def _succeed(store: Store, pid: str, kind: str) -> Grant:
    g = _lease(store, pid)
    assert g is not None and g.kind == kind, g
    assert store.leases.finish(pid, g.lease_id, "succeeded", "") == "succeeded"
    return g


# --- validation ----------------------------------------------------------------------------


def test_the_accepted_shape_and_its_defaults():
    spec = _spec(
        {
            "train": {"min_memory_bytes": 80 * GiB, "required_features": ["cuda", "flash_attention_2"], "local_ranks": 4},
            "capture": {"min_memory_bytes": 0, "local_ranks": 2},
            "evaluate": {},
        },
        max_local_ranks=8,
    )
    p = dict(spec.placements)
    assert p["train"] == Placement(min_memory_bytes=80 * GiB, required_features=("cuda", "flash_attention_2"), local_ranks=4)
    assert p["capture"] == Placement(local_ranks=2)
    # Unnamed kinds and keys: no memory floor, no extra features, 1 rank (train: the run's maximum).
    assert p["prepare"] == p["evaluate"] == Placement(local_ranks=1)
    assert dict(_spec(max_local_ranks=8).placements)["train"] == Placement(local_ranks=8)
    # The largest figure SQLite holds is accepted; duplicates in a feature list are dropped.
    big = dict(_spec({"train": {"min_memory_bytes": 2**63 - 1, "required_features": ["cuda", "cuda"]}}).placements)["train"]
    assert big.min_memory_bytes == 2**63 - 1 and big.required_features == ("cuda",)


@pytest.mark.parametrize(
    "placement, match",
    [
        ([{"train": {}}], r"`spec.spec_json.placement` must be a JSON object"),
        ("train", r"`spec.spec_json.placement` must be a JSON object"),
        (None, r"`spec.spec_json.placement` must be a JSON object"),
        ({"pipeline": {}}, r"unknown job kind `pipeline`"),
        ({"tran": {"min_memory_bytes": 1}}, r"unknown job kind `tran`"),
        ({"train": 5}, r"`spec.spec_json.placement.train` must be a JSON object"),
        ({"train": {"memory": 1}}, r"`spec.spec_json.placement.train` has unknown key `memory`"),
        ({"train": {"min_memory_bytes": -1}}, r"`spec.spec_json.placement.train.min_memory_bytes` must be a whole number from 0 to 9223372036854775807, got `-1`"),
        ({"train": {"min_memory_bytes": 2**63}}, r"train.min_memory_bytes` must be a whole number .* got `9223372036854775808`"),
        ({"train": {"min_memory_bytes": 10**40}}, r"train.min_memory_bytes` must be a whole number"),
        ({"train": {"min_memory_bytes": 1.5e9}}, r"train.min_memory_bytes` must be a whole number"),
        ({"train": {"min_memory_bytes": "80GB"}}, r"train.min_memory_bytes` must be a whole number"),
        ({"train": {"min_memory_bytes": True}}, r"train.min_memory_bytes` must be a whole number"),
        ({"capture": {"local_ranks": 0}}, r"capture.local_ranks` must be a whole number from 1 to 1"),
        ({"capture": {"local_ranks": -2}}, r"capture.local_ranks` must be a whole number from 1 to 1"),
        ({"train": {"local_ranks": 2}}, r"(?s)train.local_ranks` must be a whole number from 1 to 1, got `2`.*hint: `spec.max_local_ranks`"),
        ({"train": {"local_ranks": 2**64}}, r"train.local_ranks` must be a whole number"),
        ({"evaluate": {"required_features": "cuda"}}, r"evaluate.required_features` must be a list of feature names"),
        ({"evaluate": {"required_features": [1]}}, r"evaluate.required_features` must be a list of feature names"),
        ({"evaluate": {"required_features": ["no spaces"]}}, r"evaluate.required_features` has an invalid feature name `no spaces`"),
        ({"evaluate": {"required_features": [f"f{i}" for i in range(65)]}}, r"evaluate.required_features` lists 65 features"),
    ],
)
def test_hostile_placements_are_refused_naming_the_field(placement, match):
    with pytest.raises(InvalidRequestError, match=match):
        _spec(placement)


def test_placement_needs_a_job_graph():
    doc = json.dumps({"stages": ["train"], "placement": {"train": {"min_memory_bytes": 1}}})
    with pytest.raises(InvalidRequestError, match=r"(?s)placement` applies to the jobs of a job graph.*hint: give `--capture-shards N`"):
        RunSpecData(name="p", spec_json=doc, required_client_version="0.1.0")


def test_decide_compares_declared_memory_and_formats_it():
    run = RunRequirements(required_client_version="0.1.0", approved_native_versions=frozenset(), checkpoint_policy="durable", max_local_ranks=1, required_features=())
    prov = ProviderProfile(client_version="0.1.0", native_client_version="", native=False, backend="cpu", device_count=1, features=frozenset(), memory_bytes=int(23.5 * GiB))
    assert decide(run, prov)[0] is Verdict.ELIGIBLE
    need = run.for_kind(Placement(min_memory_bytes=TiB))
    assert decide(need, prov) == (Verdict.INCAPABLE, "needs `min_memory_bytes` 1.0 TiB, provider declares 23.5 GiB")
    assert decide(need, dataclasses.replace(prov, memory_bytes=0))[1] == "needs `min_memory_bytes` 1.0 TiB, provider declares none"
    assert decide(need, dataclasses.replace(prov, memory_bytes=TiB))[0] is Verdict.ELIGIBLE
    assert [format_bytes(n) for n in (0, 1023, 1024, 3 * GiB // 2, 2**63 - 1)] == ["0 B", "1023 B", "1.0 KiB", "1.5 GiB", "8192.0 PiB"]
    # A kind's features come on top of the run's, once each.
    both = dataclasses.replace(run, required_features=("cuda",)).for_kind(Placement(required_features=("cuda", "liger")))
    assert both.required_features == ("cuda", "liger")


def test_check_placement_resolves_every_kind():
    assert set(check_placement({}, max_local_ranks=3)) == {"prepare", "capture", "train", "evaluate"}
    assert check_placement({}, max_local_ranks=3)["train"].local_ranks == 3


# --- leasing ---------------------------------------------------------------------------------


def test_train_goes_only_to_a_provider_with_the_memory_it_needs(store):
    small = _provider(store, "small", memory=int(23.5 * GiB))
    run = store.runs.create_run(_spec({"train": {"min_memory_bytes": TiB}}))
    _succeed(store, small, "prepare")
    _succeed(store, small, "capture")
    _succeed(store, small, "capture")
    # Train is ready, but the small provider does not fit it: nothing for it.
    assert _lease(store, small) is None
    (train,) = [j for j in store.runs.run_jobs(run.run_id)[0] if j.kind == "train"]
    assert train.state == "queued" and train.waiting_for == ()
    big = _provider(store, "big", memory=2 * TiB)
    g = _lease(store, big)
    assert (g.kind, g.job_id) == ("train", train.job_id)
    assert store.leases.finish(big, g.lease_id, "succeeded", "") == "succeeded"
    # Evaluate has no floor: the small provider takes it.
    assert _lease(store, small).kind == "evaluate"


def test_a_kind_s_features_and_ranks(store):
    run = store.runs.create_run(
        _spec({"capture": {"required_features": ["flash_attention_2"], "local_ranks": 2}}, n=1, max_local_ranks=4, required_features=("cuda",))
    )
    plain = _provider(store, "plain", backend="cuda", count=8, features=(JOB_GRAPH_FEATURE,))
    prep = _succeed(store, plain, "prepare")
    assert prep.local_ranks == 1 and prep.required_features == ("cuda", JOB_GRAPH_FEATURE)
    assert _lease(store, plain) is None  # capture needs flash_attention_2, which it does not offer
    fa = _provider(store, "fa", backend="cuda", count=8, features=(JOB_GRAPH_FEATURE, "flash_attention_2"))
    cap = _lease(store, fa)
    # The lease names the kind's features too, so the run-manager checks them before it launches.
    assert (cap.kind, cap.local_ranks, cap.required_features) == ("capture", 2, ("cuda", JOB_GRAPH_FEATURE, "flash_attention_2"))
    store.leases.finish(fa, cap.lease_id, "succeeded", "")
    train = _lease(store, plain)
    assert (train.kind, train.local_ranks) == ("train", 4)  # the run's maximum, on 8 devices
    assert run.spec.max_local_ranks == 4


def test_one_rank_kinds_go_to_providers_that_cannot_run_ranks(store):
    """A run with several ranks per job: prepare/capture/evaluate default to 1 rank, so an MPS provider takes them, never train."""
    store.runs.create_run(_spec(n=1, max_local_ranks=4))
    mps = _provider(store, "mac", backend="mps")
    _succeed(store, mps, "prepare")
    _succeed(store, mps, "capture")
    assert _lease(store, mps) is None
    cuda = _provider(store, "gpu", backend="cuda", count=2)
    t = _lease(store, cuda)
    assert (t.kind, t.local_ranks) == ("train", 2)


def test_upgrade_is_asked_only_for_work_the_provider_would_fit(store):
    small = _provider(store, "small")
    store.runs.create_run(_spec({"train": {"min_memory_bytes": TiB}}, n=1))
    _succeed(store, small, "prepare")
    _succeed(store, small, "capture")
    # Train is the only ready job. A big provider on another version is asked to upgrade; a small one is not.
    old_big = _provider(store, "old-big", memory=2 * TiB, version="0.0.9")
    up = store.leases.acquire(old_big)
    assert isinstance(up, Upgrade) and up.required_client_version == "0.1.0" and "0.0.9" in up.message
    old_small = _provider(store, "old-small", version="0.0.9")
    assert store.leases.acquire(old_small) is None


def test_an_older_run_s_job_the_provider_does_not_fit_does_not_hold_up_a_newer_run(store):
    pid = _provider(store, "box")
    big = _provider(store, "big", memory=TiB)
    older = store.runs.create_run(_spec({"capture": {"min_memory_bytes": TiB}}, name="older", n=3))
    _succeed(store, pid, "prepare")
    newer = store.runs.create_run(_spec(name="newer", n=1))
    # The older run's three ready captures need a big provider: the small one gets the newer run's prepare.
    g = _lease(store, pid)
    assert (g.run_id, g.kind) == (newer.run_id, "prepare")
    g = _lease(store, big)
    assert (g.run_id, g.kind) == (older.run_id, "capture")


# --- the v5 -> v6 migration ------------------------------------------------------------------


def test_a_version_5_database_learns_declared_memory_and_keeps_its_graphs(tmp_path):
    path = tmp_path / "coordinator.db"
    store = Store(path)
    pid = _provider(store, "box", memory=48 * GiB)
    bare, _ = store.credentials.create_provider("bare")  # never registered: no capabilities
    run = store.runs.create_run(_spec(n=1, max_local_ranks=2))
    store.close()
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("DROP TABLE placements")
    db.execute("ALTER TABLE providers DROP COLUMN memory_bytes")
    db.execute("DROP TABLE attempt_inputs")  # nor what schema 7 added (trust_inputs, provenance)
    db.execute("ALTER TABLE runs DROP COLUMN trust_inputs")
    for col in ("quarantined_unix", "quarantine_reason"):  # nor what schema 8 added (verification by replay)
        db.execute(f"ALTER TABLE providers DROP COLUMN {col}")
    db.execute("DROP TABLE audit_log")  # nor what schema 9 added
    db.execute("UPDATE meta SET value='5' WHERE key='schema_version'")
    db.close()

    store = Store(path)
    try:
        assert store.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == (str(SCHEMA_VERSION),)
        assert dict(store.db.execute("SELECT provider_id, memory_bytes FROM providers")) == {pid: 48 * GiB, bare: 0}
        assert store.db.execute("SELECT COUNT(*) FROM placements").fetchone() == (0,)
        # The graph leases with the default placement: prepare 1 rank, train the run's maximum.
        reqs = store.runs.kind_requirements(store.runs.get_run(run.run_id))
        assert {k: (r.max_local_ranks, r.min_memory_bytes) for k, r in reqs.items()} == {
            "prepare": (1, 0), "capture": (1, 0), "train": (2, 0), "evaluate": (1, 0), "verify": (1, 0),
        }  # fmt: skip
        assert _lease(store, pid).kind == "prepare"
    finally:
        store.close()


# --- over gRPC -------------------------------------------------------------------------------


def test_placement_over_grpc(coordinator, provider_factory):
    channel = grpc.insecure_channel(coordinator.address)
    stub = admin_pb2_grpc.AdminServiceStub(channel)
    md = (("authorization", f"Bearer {coordinator.admin_token}"),)
    try:
        for placement, field in (
            ({"train": {"min_memory_bytes": -5}}, "placement.train.min_memory_bytes"),
            ({"train": {"min_memory_bytes": 2**63}}, "placement.train.min_memory_bytes"),
            ({"evaluate": []}, "placement.evaluate"),
            ({"export": {}}, "unknown job kind `export`"),
            ("big", "placement` must be a JSON object"),
        ):
            spec = run_spec("bad", capture_shards=1, spec_json=json.dumps({"stages": ["train"], "placement": placement}))
            with pytest.raises(grpc.RpcError) as e:
                stub.CreateRun(admin_pb2.CreateRunRequest(spec=spec), metadata=md, timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), e.value.details()
        assert list(stub.ListRuns(admin_pb2.ListRunsRequest(), metadata=md, timeout=10).runs) == []
        spec = run_spec("ok", capture_shards=1, spec_json=json.dumps({"stages": ["train"], "placement": {"prepare": {"min_memory_bytes": 16 * GiB}}}))
        stub.CreateRun(admin_pb2.CreateRunRequest(spec=spec), metadata=md, timeout=10)
    finally:
        channel.close()
    small = provider_factory("small")
    small.register(features=(JOB_GRAPH_FEATURE,), memory_bytes=8 * GiB)
    assert small.acquire().WhichOneof("result") == "no_work"
    big = provider_factory("big")
    big.register(features=(JOB_GRAPH_FEATURE,), memory_bytes=16 * GiB)
    assert big.acquire().lease.kind == "prepare"
    # A declared memory SQLite cannot hold is refused at Register.
    bad = provider_factory("bad")
    with pytest.raises(grpc.RpcError) as e:
        bad.register(memory_bytes=2**64 - 1)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "capabilities.memory_bytes" in e.value.details()


# --- why a ready job waits (`runs show`) ------------------------------------------------------


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clocked(tmp_path):
    clock = Clock()
    s = Store(tmp_path / "clocked.db", clock=clock, lease_ttl=30.0)
    s.test_clock = clock
    yield s
    s.close()


def _jobs(store: Store, run_id: str) -> dict[tuple[str, int], object]:
    return {(j.kind, j.shard_index): j for j in store.runs.run_jobs(run_id)[0]}


def test_a_train_job_too_big_for_every_provider_says_why_it_waits(clocked):
    store = clocked
    small = _provider(store, "prov-a", memory=int(23.5 * GiB))
    run = store.runs.create_run(_spec({"train": {"min_memory_bytes": TiB}}, n=2))
    _succeed(store, small, "prepare")
    _succeed(store, small, "capture")
    _succeed(store, small, "capture")
    assert _lease(store, small) is None  # never leased to the provider that does not fit
    jobs = _jobs(store, run.run_id)
    train = jobs[("train", 0)]
    assert train.state == "queued" and train.waiting_for == ()
    assert train.waiting_reason == (
        "waiting for a provider: none of 1 live provider fits this train job: "
        "prov-a (cpu, 23.5 GiB): needs `min_memory_bytes` 1.0 TiB, provider declares 23.5 GiB"
    )
    # A job that waits for another job says that instead (`waiting_for`), not a provider reason.
    assert jobs[("evaluate", 0)].waiting_for and jobs[("evaluate", 0)].waiting_reason == ""
    assert all(j.waiting_reason == "" for k, j in jobs.items() if k != ("train", 0))


def test_waiting_reasons_name_what_each_provider_misses_and_who_fits(clocked):
    store = clocked
    older = store.runs.create_run(RunSpecData(name="older", spec_json="{}", required_client_version="0.1.0"))
    run = store.runs.create_run(_spec({"prepare": {"required_features": ["liger"], "min_memory_bytes": 16 * GiB}}, n=1))
    # No provider at all.
    assert _jobs(store, run.run_id)[("prepare", 0)].waiting_reason == (
        "waiting for a provider: no live provider is registered (none asked for work in the last 60 s)"
    )
    _provider(store, "no-graph", features=("liger",), memory=32 * GiB)
    _provider(store, "no-liger", memory=32 * GiB)
    _provider(store, "old", features=(JOB_GRAPH_FEATURE, "liger"), memory=32 * GiB, version="0.0.1")
    why = _jobs(store, run.run_id)[("prepare", 0)].waiting_reason
    assert why.startswith("waiting for a provider: none of 3 live providers fits this prepare job: ")
    assert "no-graph (cpu, 32.0 GiB): missing required features ['job_graph']" in why
    assert "no-liger (cpu, 32.0 GiB): missing required features ['liger']" in why
    assert "old (cpu, 32.0 GiB): run requires client version `0.1.0`, provider runs `0.0.1`" in why
    # The one that fits is busy with the older run's job: it says so.
    fits = _provider(store, "fits", features=(JOB_GRAPH_FEATURE, "liger"), memory=16 * GiB)
    g = _lease(store, fits)
    assert g.run_id == older.run_id
    why = _jobs(store, run.run_id)[("prepare", 0)].waiting_reason
    assert why == "waiting for a provider: the live providers that fit this prepare job are busy with other jobs: fits (cpu, 16.0 GiB)"
    # Idle again: it takes the job when it next asks.
    store.leases.finish(fits, g.lease_id, "succeeded", "")
    why = _jobs(store, run.run_id)[("prepare", 0)].waiting_reason
    assert why == "waiting for a provider: fits (cpu, 16.0 GiB) fit this prepare job; it is leased when one asks for work (older runs' jobs first)"
    assert _lease(store, fits).kind == "prepare"
    assert _jobs(store, run.run_id)[("prepare", 0)].waiting_reason == ""


def test_with_one_fitting_provider_busy_and_one_idle_the_idle_one_is_named(clocked):
    store = clocked
    store.runs.create_run(RunSpecData(name="older", spec_json="{}", required_client_version="0.1.0"))
    run = store.runs.create_run(_spec(n=1))
    busy = _provider(store, "busy-one")
    assert _lease(store, busy).kind == "pipeline"
    _provider(store, "idle-one")
    why = _jobs(store, run.run_id)[("prepare", 0)].waiting_reason
    assert why == "waiting for a provider: idle-one (cpu, 8.0 GiB) fit this prepare job; it is leased when one asks for work (older runs' jobs first)"


def test_only_live_unrevoked_providers_count_and_at_most_200(clocked):
    store = clocked
    run = store.runs.create_run(RunSpecData(name="p", spec_json="{}", required_client_version="0.1.0", required_features=("cuda",)))
    gone = _provider(store, "gone")
    store.test_clock.t += 61  # not seen for longer than `live_seconds`
    revoked = _provider(store, "revoked")
    store.credentials.revoke_provider(revoked)
    (job,) = store.runs.run_jobs(run.run_id)[0]
    assert "no live provider is registered" in job.waiting_reason
    store.leases.acquire(gone)  # asking for work makes it live again
    (job,) = store.runs.run_jobs(run.run_id)[0]
    assert job.waiting_reason == "waiting for a provider: none of 1 live provider fits this job: gone (cpu, 8.0 GiB): missing required features ['cuda']"
    for i in range(205):
        _provider(store, f"p{i:03d}\x7f")
    (job,) = store.runs.run_jobs(run.run_id)[0]
    assert job.waiting_reason.startswith("waiting for a provider: none of the 200 most recently seen live providers fits this job: ")
    assert job.waiting_reason.endswith("; and 195 more") and "\x7f" not in job.waiting_reason and "p204? (cpu" in job.waiting_reason


def test_a_failed_graph_run_s_jobs_say_no_waiting_reason(clocked):
    store = clocked
    pid = _provider(store, "box")
    run = store.runs.create_run(_spec(n=1))
    g = _lease(store, pid)
    store.leases.finish(pid, g.lease_id, "failed", "broken")
    assert all(j.waiting_reason == "" for j in store.runs.run_jobs(run.run_id)[0])


def test_waiting_reason_over_grpc_and_in_runs_show(coordinator, provider_factory, capsys):
    from dflash_worker.coordinator.cli import main as cli_main

    p = provider_factory("prov-a")
    p.register(backend="cpu", features=(JOB_GRAPH_FEATURE,), memory_bytes=int(23.5 * GiB))
    with coordinator.admin() as admin:
        spec = run_spec("big-train", capture_shards=1, spec_json=json.dumps({"stages": ["train"], "placement": {"train": {"min_memory_bytes": TiB}}}))
        run = admin.create_run(spec)
        for kind in ("prepare", "capture"):
            lease = p.acquire().lease
            assert lease.kind == kind
            assert p.finish(lease.lease_id) == "succeeded"
        assert p.acquire().WhichOneof("result") == "no_work"
        train = [j for j in admin.get_run(run.run_id).jobs if j.kind == "train"][0]
        assert train.state == "queued" and "needs `min_memory_bytes` 1.0 TiB" in train.waiting_reason
    env = ["--server", coordinator.address, f"--admin-token={coordinator.admin_token}"]
    assert cli_main(["runs", "show", run.run_id, *env]) == 0
    out = capsys.readouterr().out
    assert (
        "    waiting for a provider: none of 1 live provider fits this train job: prov-a (cpu, 23.5 GiB): needs `min_memory_bytes` 1.0 TiB" in out
    ), out
    assert cli_main(["runs", "show", run.run_id, "--json", *env]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [j["waiting_reason"] != "" for j in doc["jobs"]] == [False, False, True, False]
