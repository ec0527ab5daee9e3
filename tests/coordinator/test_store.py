"""The coordinator's Store in-process: leasing reads no job spec it does not hand out, records per attempt."""

from __future__ import annotations

import json

from coordinator_helpers import register_provider

from dflash_worker.coordinator import store as store_mod
from dflash_worker.coordinator.store import Grant, RunSpecData, Store, Upgrade


def _register(store: Store, name: str, version: str = "0.1.0") -> str:
    return register_provider(store, name, client_version=version)


def test_acquire_parses_no_queued_runs_spec_json(tmp_path, monkeypatch):
    # 40 queued runs with 1 MiB specs that this provider cannot take (another client version):
    # AcquireLease once parsed every one of them per call, stalling the event loop for ~30 s.
    store = Store(tmp_path / "c.db")
    big = json.dumps({"stages": ["noop"], "pad": "x" * ((1 << 20) - 100)})
    for i in range(40):
        store.runs.create_run(RunSpecData(name=f"big-{i}", spec_json=big, required_client_version="9.9.9"))
    store.runs.create_run(RunSpecData(name="small", spec_json='{"stages": ["noop"]}', required_client_version="0.1.0"))
    pid = _register(store, "p")
    calls = []
    real = store_mod.spec.parse_spec_json
    monkeypatch.setattr(store_mod.spec, "parse_spec_json", lambda text: calls.append(len(text)) or real(text))
    reads = []
    store.db.set_trace_callback(lambda sql: reads.append(sql) if "spec_json" in sql and sql.lstrip().upper().startswith("SELECT") else None)
    grant = store.leases.acquire(pid)
    assert isinstance(grant, Grant) and json.loads(grant.spec_json) == {"stages": ["noop"]}
    assert calls == [], "leasing re-parsed stored job specs"
    # Only the granted run's spec_json was read.
    assert len(reads) == 1, reads
    reads.clear()
    assert isinstance(store.leases.acquire(pid), Upgrade)  # the rest need 9.9.9
    assert reads == [] and calls == []
    store.close()


def test_list_runs_and_run_jobs_page(tmp_path):
    store = Store(tmp_path / "c.db")
    for i in range(5):
        store.runs.create_run(RunSpecData(name=f"r{i}", spec_json="{}", required_client_version="0.1.0", num_jobs=3))
    runs, token = store.runs.list_runs(page_size=2)
    assert [r.spec.name for r in runs] == ["r0", "r1"] and token
    runs2, token2 = store.runs.list_runs(page_size=2, page_token=token)
    assert [r.spec.name for r in runs2] == ["r2", "r3"]
    runs3, token3 = store.runs.list_runs(page_size=2, page_token=token2)
    assert [r.spec.name for r in runs3] == ["r4"] and token3 == ""
    jobs, tok = store.runs.run_jobs(runs[0].run_id, page_size=2)
    rest, end = store.runs.run_jobs(runs[0].run_id, page_size=2, page_token=tok)
    assert len(jobs) == 2 and len(rest) == 1 and end == ""
    assert len({j.job_id for j in jobs + rest}) == 3
    store.close()


def test_wal_checkpoints_run_off_the_committing_connection(tmp_path):
    # The server's connection never checkpoints inside a commit (a checkpoint fsyncs, and a
    # heartbeat's commit on the event loop then waits behind an upload's dirty pages); the
    # background `checkpoint_wal` copies the WAL into the database instead.
    store = Store(tmp_path / "c.db")
    store.database.checkpoint_in_background()
    assert store.db.execute("PRAGMA wal_autocheckpoint").fetchone() == (0,)
    wal = tmp_path / "c.db-wal"
    for i in range(300):  # well past SQLite's default 1,000-page autocheckpoint
        store.runs.create_run(RunSpecData(name=f"r-{i}", spec_json=json.dumps({"stages": ["noop"], "pad": "x" * 8000}), required_client_version="0.1.0"))
    grown = wal.stat().st_size
    assert grown > 1000 * 4096, f"the WAL was checkpointed by a commit ({grown} bytes)"
    busy, log, done = store.database.checkpoint_wal()
    assert busy == 0 and log > 1000 and done == log, (busy, log, done)
    # Everything is in the database file now: a reader of it alone sees every run.
    store.close()
    wal.unlink(missing_ok=True)  # what a crash after the checkpoint could leave: no WAL at all
    again = Store(tmp_path / "c.db")
    assert again.db.execute("SELECT count(*) FROM runs").fetchone() == (300,)
    again.close()
