"""The coordinator database's layout (`SCHEMA`) and the steps that upgrade an older one (`MIGRATIONS`).

``meta.schema_version`` names the layout. `db.Database` creates the tables of a new database
and upgrades an older one in place, in one transaction, when it opens it; a newer one (written
by a newer coordinator) is refused. Each step takes a database of version N to N+1 and says
what that version lacked and what the upgrade assumes for rows written before it.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from ..policy import MAX_MEMORY_BYTES

SCHEMA_VERSION = 9

SCHEMA = """
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
  created_unix REAL NOT NULL,
  capture_shards INTEGER NOT NULL DEFAULT 0,
  eval_shards INTEGER NOT NULL DEFAULT 0,
  failure TEXT NOT NULL DEFAULT '',
  trust_inputs TEXT NOT NULL DEFAULT 'own'
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
  last_seen_unix REAL,
  identity TEXT NOT NULL DEFAULT '',
  revoked_unix REAL,
  memory_bytes INTEGER NOT NULL DEFAULT 0,
  quarantined_unix REAL,
  quarantine_reason TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS retired_tokens (
  token_sha256 TEXT PRIMARY KEY,
  provider_id TEXT NOT NULL REFERENCES providers(provider_id),
  retired_unix REAL NOT NULL,
  expires_unix REAL NOT NULL
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
  updated_unix REAL NOT NULL,
  kind TEXT NOT NULL DEFAULT 'pipeline',
  shard_index INTEGER NOT NULL DEFAULT 0,
  shard_count INTEGER NOT NULL DEFAULT 1,
  reason TEXT NOT NULL DEFAULT '',
  pending_deps INTEGER NOT NULL DEFAULT 0
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
  last_heartbeat_unix REAL,
  phase_started_unix REAL,
  phase_started_step INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS attempts_live ON attempts(state, lease_expires_unix);
CREATE INDEX IF NOT EXISTS attempts_by_provider ON attempts(provider_id, state);
CREATE TABLE IF NOT EXISTS records (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  job_id TEXT NOT NULL REFERENCES jobs(job_id),
  attempt_id TEXT NOT NULL REFERENCES attempts(attempt_id),
  attempt INTEGER NOT NULL,
  name TEXT NOT NULL,
  kind TEXT NOT NULL,
  sha256 TEXT NOT NULL,
  size_bytes INTEGER NOT NULL,
  step INTEGER NOT NULL,
  created_unix REAL NOT NULL,
  UNIQUE (attempt_id, name)
);
CREATE INDEX IF NOT EXISTS records_by_job ON records(job_id, kind, step);
CREATE INDEX IF NOT EXISTS records_by_sha ON records(sha256);
CREATE INDEX IF NOT EXISTS records_by_run ON records(run_id);
CREATE TABLE IF NOT EXISTS publications (
  job_id TEXT PRIMARY KEY REFERENCES jobs(job_id),
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  attempt_id TEXT NOT NULL REFERENCES attempts(attempt_id),
  published INTEGER NOT NULL,
  verdict TEXT NOT NULL,
  reason TEXT NOT NULL,
  evaluation_json TEXT NOT NULL DEFAULT '{}',
  decided_unix REAL NOT NULL,
  override_unix REAL,
  override_note TEXT NOT NULL DEFAULT '',
  override_peer TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS publications_by_run ON publications(run_id);
CREATE TABLE IF NOT EXISTS job_deps (
  job_id TEXT NOT NULL REFERENCES jobs(job_id),
  needs_job_id TEXT NOT NULL REFERENCES jobs(job_id),
  PRIMARY KEY (job_id, needs_job_id)
);
CREATE INDEX IF NOT EXISTS job_deps_by_needed ON job_deps(needs_job_id);
CREATE INDEX IF NOT EXISTS providers_by_seen ON providers(last_seen_unix);
CREATE TABLE IF NOT EXISTS placements (
  run_id TEXT NOT NULL REFERENCES runs(run_id),
  kind TEXT NOT NULL,
  min_memory_bytes INTEGER NOT NULL DEFAULT 0,
  required_features TEXT NOT NULL DEFAULT '[]',
  local_ranks INTEGER NOT NULL DEFAULT 1,
  PRIMARY KEY (run_id, kind)
);
-- What each attempt was handed when it was leased (its resume checkpoint, `resume`, and its
-- inputs, `input`), each with the attempt that uploaded it: the provenance of what it produced.
CREATE TABLE IF NOT EXISTS attempt_inputs (
  attempt_id TEXT NOT NULL REFERENCES attempts(attempt_id),
  role TEXT NOT NULL,
  name TEXT NOT NULL,
  kind TEXT NOT NULL,
  sha256 TEXT NOT NULL,
  producer_attempt_id TEXT NOT NULL REFERENCES attempts(attempt_id),
  PRIMARY KEY (attempt_id, role, name)
);
-- What changed a provider's standing, and why: a quarantine (the coordinator, on a verify job's
-- settled disagreement) and its lifting by an admin (`providers unquarantine`, with the admin's
-- reason and address). Rows are only ever added.
CREATE TABLE IF NOT EXISTS audit_log (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  created_unix REAL NOT NULL,
  action TEXT NOT NULL,
  provider_id TEXT NOT NULL REFERENCES providers(provider_id),
  reason TEXT NOT NULL,
  peer TEXT NOT NULL DEFAULT '',
  detail TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS audit_by_provider ON audit_log(provider_id, seq);
"""

# Indexes on columns a migration adds: created once the database has them.
SCHEMA_AFTER_MIGRATIONS = """
CREATE INDEX IF NOT EXISTS jobs_ready ON jobs(state, run_id, pending_deps, seq);
CREATE INDEX IF NOT EXISTS jobs_by_kind ON jobs(run_id, kind, shard_index);
"""


def _migrate_1_to_2(db: sqlite3.Connection) -> None:
    # Version 1 had no token lifecycle and kept only the registered name, which
    # Register overwrites: the best guess at a provider's created name is its
    # current one (re-create the provider where that is not its certificate CN).
    # `retired_tokens` is created by SCHEMA (IF NOT EXISTS) before this runs.
    db.execute("ALTER TABLE providers ADD COLUMN identity TEXT NOT NULL DEFAULT ''")
    db.execute("ALTER TABLE providers ADD COLUMN revoked_unix REAL")
    db.execute("UPDATE providers SET identity=name")


def _migrate_2_to_3(db: sqlite3.Connection) -> None:
    # Version 2 recorded artifacts per (job, name) as `file://` URIs (inline uploads
    # under the coordinator's artifact directory, other files wherever a provider
    # said). Those bytes were never in a blob store, so they are not served: the
    # table is kept, renamed, for the record. `records` is created by SCHEMA.
    if db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='artifacts'").fetchone():
        db.execute("ALTER TABLE artifacts RENAME TO artifacts_v2")


PRE_GATE_REASON = "published by a coordinator without the regression gate (database schema 3)"


def _migrate_3_to_4(db: sqlite3.Connection) -> None:
    # Version 3 had no regression gate: every succeeded job's export was served. Those
    # exports stay published (a user may already have fetched them), and say why.
    # `publications` is created by SCHEMA. Attempts learn when their current phase began
    # (the status page's ETA); a live attempt's clock starts at its next phase change.
    db.execute("ALTER TABLE attempts ADD COLUMN phase_started_unix REAL")
    db.execute("ALTER TABLE attempts ADD COLUMN phase_started_step INTEGER NOT NULL DEFAULT 0")
    db.execute(
        "INSERT OR IGNORE INTO publications(job_id, run_id, attempt_id, published, verdict, reason, decided_unix)"
        " SELECT j.job_id, j.run_id, a.attempt_id, 1, '', ?, a.ended_unix FROM jobs j JOIN attempts a ON a.job_id=j.job_id"
        " WHERE j.state='succeeded' AND a.state='succeeded'"
        " AND EXISTS (SELECT 1 FROM records r WHERE r.attempt_id=a.attempt_id AND r.kind='export')",
        (PRE_GATE_REASON,),
    )


def _migrate_4_to_5(db: sqlite3.Connection) -> None:
    # Version 4 had no job graphs: every job ran the whole pipeline, which is what the
    # defaults say (`pipeline`, shard 0 of 1, no dependencies; runs without shards).
    # `job_deps` is created by SCHEMA.
    db.execute("ALTER TABLE jobs ADD COLUMN kind TEXT NOT NULL DEFAULT 'pipeline'")
    db.execute("ALTER TABLE jobs ADD COLUMN shard_index INTEGER NOT NULL DEFAULT 0")
    db.execute("ALTER TABLE jobs ADD COLUMN shard_count INTEGER NOT NULL DEFAULT 1")
    db.execute("ALTER TABLE jobs ADD COLUMN reason TEXT NOT NULL DEFAULT ''")
    db.execute("ALTER TABLE jobs ADD COLUMN pending_deps INTEGER NOT NULL DEFAULT 0")
    db.execute("ALTER TABLE runs ADD COLUMN capture_shards INTEGER NOT NULL DEFAULT 0")
    db.execute("ALTER TABLE runs ADD COLUMN eval_shards INTEGER NOT NULL DEFAULT 0")
    db.execute("ALTER TABLE runs ADD COLUMN failure TEXT NOT NULL DEFAULT ''")


def _migrate_5_to_6(db: sqlite3.Connection) -> None:
    # Version 5 had no per-kind placement: graph runs get no `placements` rows (created by
    # SCHEMA), so their jobs lease with the defaults (`policy.default_placement`), and their
    # edges stay as created. Providers learn their declared memory from what they registered.
    from ...proto.dflash.v1 import provider_pb2

    db.execute("ALTER TABLE providers ADD COLUMN memory_bytes INTEGER NOT NULL DEFAULT 0")
    for pid, caps in db.execute("SELECT provider_id, capabilities FROM providers WHERE capabilities IS NOT NULL").fetchall():
        try:
            memory = provider_pb2.DeviceCapabilities.FromString(caps).memory_bytes
        except Exception:  # a blob this coordinator did not write: the provider declares it again at Register
            continue
        db.execute("UPDATE providers SET memory_bytes=? WHERE provider_id=?", (min(memory, MAX_MEMORY_BYTES), pid))


def _migrate_6_to_7(db: sqlite3.Connection) -> None:
    # Version 6 handed a new attempt every earlier attempt's checkpoints and capture shards,
    # whoever ran it, and recorded no provenance. Its runs get the safe default, `own` (a
    # provider resumes only its own earlier work); `attempt_inputs` (created by SCHEMA) stays
    # empty for attempts leased before the upgrade.
    db.execute("ALTER TABLE runs ADD COLUMN trust_inputs TEXT NOT NULL DEFAULT 'own'")


def _migrate_7_to_8(db: sqlite3.Connection) -> None:
    # Version 7 had no verification by replay: no provider was ever quarantined (a verify job's
    # mismatch does that), and no attempt was `discarded`.
    db.execute("ALTER TABLE providers ADD COLUMN quarantined_unix REAL")
    db.execute("ALTER TABLE providers ADD COLUMN quarantine_reason TEXT NOT NULL DEFAULT ''")


def _migrate_8_to_9(db: sqlite3.Connection) -> None:
    # Version 8 kept no audit log (`audit_log`, created by SCHEMA, starts empty: a provider quarantined
    # before the upgrade has its reason in `providers.quarantine_reason` only), no quarantine could be
    # lifted, and a verify job's mismatch quarantined the producer on the verifier's word alone (no
    # attempt is `disputed` or `overruled`).
    del db


# version -> the step that upgrades a database of that version to the next one.
MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {
    1: _migrate_1_to_2, 2: _migrate_2_to_3, 3: _migrate_3_to_4, 4: _migrate_4_to_5, 5: _migrate_5_to_6, 6: _migrate_6_to_7,
    7: _migrate_7_to_8, 8: _migrate_8_to_9,
}  # fmt: skip
