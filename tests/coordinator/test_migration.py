"""Opening a database written by an older coordinator migrates it in place; a newer one is refused."""

from __future__ import annotations

import sqlite3

import pytest
from coordinator_helpers import register_provider, registration

from dflash_worker.coordinator.store import SCHEMA_VERSION, Store, hash_token
from dflash_worker.errors import AuthenticationError, ConfigError

# The layout schema version 1 had (the coordinator before token rotation and revocation), verbatim.
SCHEMA_V1 = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  run_id TEXT UNIQUE NOT NULL,
  name TEXT UNIQUE NOT NULL,
  spec_json TEXT NOT NULL,
  required_client_version TEXT NOT NULL,
  checkpoint_policy TEXT NOT NULL,
  max_local_ranks INTEGER NOT NULL,
  required_features TEXT NOT NULL,
  image TEXT NOT NULL,
  num_jobs INTEGER NOT NULL,
  created_unix REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS approved_versions (
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  version TEXT NOT NULL,
  approved_unix REAL NOT NULL,
  PRIMARY KEY (run_id, version)
);
CREATE TABLE IF NOT EXISTS providers (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  provider_id TEXT UNIQUE NOT NULL,
  name TEXT NOT NULL,
  token_sha256 TEXT UNIQUE NOT NULL,
  created_unix REAL NOT NULL,
  client_version TEXT NOT NULL DEFAULT '',
  native_client_version TEXT NOT NULL DEFAULT '',
  launch_mode INTEGER NOT NULL DEFAULT 0,
  native INTEGER NOT NULL DEFAULT 0,
  backend TEXT NOT NULL DEFAULT '',
  device_count INTEGER NOT NULL DEFAULT 0,
  features TEXT NOT NULL DEFAULT '[]',
  capabilities BLOB,
  registered_unix REAL,
  last_seen_unix REAL
);
CREATE TABLE IF NOT EXISTS jobs (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  job_id TEXT UNIQUE NOT NULL,
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  state TEXT NOT NULL,
  attempts INTEGER NOT NULL DEFAULT 0,
  current_attempt_id TEXT,
  cancel_requested INTEGER NOT NULL DEFAULT 0,
  checkpoint_requested INTEGER NOT NULL DEFAULT 0,
  updated_unix REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs(state, run_id, seq);
CREATE INDEX IF NOT EXISTS jobs_by_run ON jobs(run_id, seq);
CREATE TABLE IF NOT EXISTS attempts (
  attempt_id TEXT PRIMARY KEY,
  job_id TEXT NOT NULL REFERENCES jobs(job_id),
  number INTEGER NOT NULL,
  provider_id TEXT NOT NULL REFERENCES providers(provider_id),
  lease_id TEXT UNIQUE NOT NULL,
  state TEXT NOT NULL,
  lease_expires_unix REAL NOT NULL,
  started_unix REAL NOT NULL,
  ended_unix REAL,
  message TEXT NOT NULL DEFAULT '',
  phase INTEGER NOT NULL DEFAULT 0,
  step INTEGER NOT NULL DEFAULT 0,
  total_steps INTEGER NOT NULL DEFAULT 0,
  committed_step INTEGER NOT NULL DEFAULT 0,
  metrics_json TEXT NOT NULL DEFAULT '{}',
  last_heartbeat_unix REAL
);
CREATE INDEX IF NOT EXISTS attempts_live ON attempts(state, lease_expires_unix);
CREATE TABLE IF NOT EXISTS artifacts (
  job_id TEXT NOT NULL REFERENCES jobs(job_id),
  name TEXT NOT NULL,
  kind TEXT NOT NULL,
  sha256 TEXT NOT NULL,
  size_bytes INTEGER NOT NULL,
  uri TEXT NOT NULL,
  step INTEGER NOT NULL,
  attempt_id TEXT NOT NULL,
  created_unix REAL NOT NULL,
  seq INTEGER NOT NULL,
  PRIMARY KEY (job_id, name)
);
"""

TOKEN = "v1-provider-token-v1-provider-token-0123456"
ADMIN = "v1-admin-token-v1-admin-token-0123456789"


def _v1_database(path) -> None:
    """A version-1 database with an admin token, a registered provider (renamed by Register) and a leased job."""
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(SCHEMA_V1)
    db.execute("INSERT INTO meta(key, value) VALUES ('schema_version', '1'), ('admin_token_sha256', ?)", (hash_token(ADMIN),))
    db.execute(
        "INSERT INTO providers(provider_id, name, token_sha256, created_unix, registered_unix, backend) VALUES ('prov-old', 'rig-a', ?, 1, 2, 'cpu')",
        (hash_token(TOKEN),),
    )
    db.execute(
        "INSERT INTO runs(run_id, name, spec_json, required_client_version, checkpoint_policy, max_local_ranks, required_features, image, num_jobs, created_unix)"
        " VALUES ('run-old', 'old', '{}', '0.1.0', 'durable', 1, '[]', '', 1, 1)"
    )
    db.execute("INSERT INTO jobs(job_id, run_id, state, attempts, current_attempt_id, updated_unix) VALUES ('job-old', 'run-old', 'leased', 1, 'att-old', 1)")
    db.execute(
        "INSERT INTO attempts(attempt_id, job_id, number, provider_id, lease_id, state, lease_expires_unix, started_unix)"
        " VALUES ('att-old', 'job-old', 1, 'prov-old', 'lease-old', 'live', 1e12, 1)"
    )
    db.close()


def test_a_version_1_database_opens_and_is_migrated(tmp_path):
    path = tmp_path / "coordinator.db"
    _v1_database(path)
    store = Store(path)
    try:
        assert store.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == (str(SCHEMA_VERSION),)
        # Version 3: the old per-job `file://` artifact table is kept as `artifacts_v2`; records start empty.
        tables = {r[0] for r in store.db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert {"artifacts_v2", "records"} <= tables and "artifacts" not in tables
        # Old tokens keep working; the identity is the best guess, the current name.
        assert store.credentials.authenticate(TOKEN).provider_id == "prov-old" and store.credentials.authenticate(TOKEN).name == "rig-a"
        assert store.credentials.authenticate(ADMIN).admin
        (p,) = store.providers.list_providers()
        assert (p.identity, p.revoked_unix) == ("rig-a", None)
        # The new lifecycle works on migrated rows: rotate, then revoke ends the live v1 attempt.
        new, _ = store.credentials.rotate_token("prov-old", 60)
        assert store.credentials.authenticate(TOKEN).provider_id == store.credentials.authenticate(new).provider_id == "prov-old"
        assert store.credentials.revoke_provider("prov-old") == 1
        assert store.db.execute("SELECT state FROM jobs WHERE job_id='job-old'").fetchone() == ("queued",)
        for t in (TOKEN, new):
            with pytest.raises(AuthenticationError, match="revoked"):
                store.credentials.authenticate(t)
    finally:
        store.close()
    # Migrated once: a second open finds the current version and changes nothing.
    store = Store(path)
    try:
        with pytest.raises(AuthenticationError, match="revoked"):
            store.credentials.authenticate(TOKEN)
        store.providers.register(
            "prov-old",
            registration("x"),
        )
    finally:
        store.close()


def test_a_failed_migration_leaves_the_database_at_version_1(tmp_path, monkeypatch):
    from dflash_worker.coordinator import store as store_mod

    path = tmp_path / "coordinator.db"
    _v1_database(path)

    def broken(db):
        db.execute("ALTER TABLE providers ADD COLUMN identity TEXT NOT NULL DEFAULT ''")
        raise sqlite3.OperationalError("disk on fire")

    monkeypatch.setitem(store_mod.schema.MIGRATIONS, 1, broken)
    with pytest.raises(ConfigError, match="disk on fire"):
        Store(path)
    db = sqlite3.connect(path)
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == ("1",)
    assert "identity" not in [r[1] for r in db.execute("PRAGMA table_info(providers)")]
    db.close()


def test_a_newer_database_is_refused(tmp_path):
    path = tmp_path / "coordinator.db"
    Store(path).close()
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION + 1),))
    db.close()
    with pytest.raises(ConfigError, match=f"(?s)schema version {SCHEMA_VERSION + 1}.*newer coordinator"):
        Store(path)


def test_a_version_3_database_keeps_its_exports_published(tmp_path):
    """Schema 3 had no regression gate and served every succeeded job's export: after the migration those
    stay published (saying why), a job without an export gets no publication, and new jobs go through the gate."""
    from dflash_worker.coordinator.artifacts.names import Claim
    from dflash_worker.coordinator.store import PRE_GATE_REASON, RunSpecData

    path = tmp_path / "coordinator.db"
    store = Store(path)
    pid = register_provider(store)
    run = store.runs.create_run(RunSpecData(name="old", spec_json="{}", required_client_version="0.1.0", num_jobs=2))
    jobs = []
    for with_export in (True, False):
        g = store.leases.acquire(pid)
        lease = store.leases.live_lease(pid, g.lease_id)
        if with_export:
            store.records.record(lease, Claim(name="run/export/model.safetensors", kind="export", sha256="a" * 64, size_bytes=3, step=1))
        store.leases.finish(pid, g.lease_id, "succeeded", "")
        jobs.append(g.job_id)
    store.close()
    # What a schema-3 coordinator left: no publications table.
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("DROP TABLE publications")
    db.execute("ALTER TABLE attempts DROP COLUMN phase_started_unix")
    db.execute("ALTER TABLE attempts DROP COLUMN phase_started_step")
    # Nor what schemas 5 and 6 added (job graphs, placements).
    db.execute("DROP TABLE placements")
    db.execute("ALTER TABLE providers DROP COLUMN memory_bytes")
    db.execute("DROP TABLE job_deps")
    db.execute("DROP INDEX jobs_ready")
    db.execute("DROP INDEX jobs_by_kind")
    for table, col in [("jobs", "kind"), ("jobs", "shard_index"), ("jobs", "shard_count"), ("jobs", "reason"), ("jobs", "pending_deps"), ("runs", "capture_shards"), ("runs", "eval_shards"), ("runs", "failure")]:
        db.execute(f"ALTER TABLE {table} DROP COLUMN {col}")
    db.execute("DROP TABLE attempt_inputs")  # nor what schema 7 added (trust_inputs, provenance)
    db.execute("ALTER TABLE runs DROP COLUMN trust_inputs")
    for col in ("quarantined_unix", "quarantine_reason"):  # nor what schema 8 added (verification by replay)
        db.execute(f"ALTER TABLE providers DROP COLUMN {col}")
    db.execute("DROP TABLE audit_log")  # nor what schema 9 added
    db.execute("UPDATE meta SET value='3' WHERE key='schema_version'")
    db.close()

    store = Store(path)
    try:
        assert store.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == (str(SCHEMA_VERSION),)
        pub = store.publication(jobs[0])
        assert pub is not None and pub.published and pub.verdict == "" and pub.reason == PRE_GATE_REASON, pub
        assert store.publication(jobs[1]) is None
        assert store.publications.undecided_jobs() == []
        store.publications.check_published(run.run_id, jobs[0])
        cols = [r[1] for r in store.db.execute("PRAGMA table_info(attempts)")]
        assert "phase_started_unix" in cols and "phase_started_step" in cols
    finally:
        store.close()


def test_a_version_8_database_gets_an_empty_audit_log_and_its_quarantines_can_be_lifted(tmp_path):
    """Schema 8 quarantined providers but kept no audit log: after the migration the log starts empty, the
    quarantine (its reason on the provider's row) is lifted as any other, and the lifting is recorded."""
    path = tmp_path / "coordinator.db"
    store = Store(path)
    pid = register_provider(store)
    store.close()
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("UPDATE providers SET quarantined_unix=1000, quarantine_reason='verify job `job-x` recomputed other bytes' WHERE provider_id=?", (pid,))
    db.execute("DROP TABLE audit_log")
    db.execute("UPDATE meta SET value='8' WHERE key='schema_version'")
    db.close()

    store = Store(path)
    try:
        assert store.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == (str(SCHEMA_VERSION),)
        assert store.db.execute("SELECT COUNT(*) FROM audit_log").fetchone() == (0,)
        entry = store.providers.unquarantine(pid, reason="lifted after the upgrade", peer="ipv4:127.0.0.1:1")
        assert entry.detail == "quarantined at unix 1000: verify job `job-x` recomputed other bytes"
        (p,) = store.providers.list_providers()
        assert p.quarantined_unix is None and p.last_unquarantine == entry
        assert store.db.execute("SELECT action, provider_id, reason, peer FROM audit_log").fetchall() == [
            ("unquarantine", pid, "lifted after the upgrade", "ipv4:127.0.0.1:1")
        ]
    finally:
        store.close()
