"""Coordinator state in SQLite: runs, providers, jobs, attempts (leases), artifacts.

One process owns the database and uses one connection from its event-loop
thread, so every state change is a short serial transaction and no SQLite
locking is needed beyond what protects against a second process. The
database runs in WAL mode with ``synchronous=NORMAL``: a committed transaction
survives the coordinator process being killed (only an OS crash or power loss
can drop the last few), which is the failure the restart test exercises.

Leases live on the ``attempts`` table: each attempt of a job holds exactly one
lease (``lease_id``, ``lease_expires_unix``), valid while the attempt's state
is ``live``, it is its job's ``current_attempt_id`` and it has not expired.

Job states: ``queued`` -> ``leased`` (-> ``cancelling``) -> ``succeeded`` |
``failed`` | ``cancelled``, or back to ``queued`` when an attempt expires or
ends retryable (at most ``max_attempts`` attempts, then ``failed``).

Job graphs: a job has a ``kind``. A run created as today has ``num_jobs``
independent ``pipeline`` jobs (the worker runs every stage). A graph run
(``capture_shards`` N > 0) has ``prepare`` -> ``capture`` x N (shard i of N)
-> ``train`` -> ``evaluate`` x M, with the edges in ``job_deps``
(`RunSpecData.graph`). A queued job is leasable only once every job it needs
has succeeded, and only by a provider that fits its kind's placement
(``placements``, written at creation); its lease names the needed jobs' final
artifacts (``Grant.inputs``), which the provider may download. When a job of a
graph run ends ``failed`` or ``cancelled`` the run fails: ``runs.failure``
names that job, and every queued job of the run (its dependents among them)
is failed with that reason, so no more of the run's work is leased; attempts
already running finish, but a job whose attempt is requeued after that fails
instead.
Attempt states: ``live``, ``succeeded``, ``failed``, ``cancelled``,
``retryable``, ``expired``, ``revoked`` (its provider was revoked; the job is
requeued like an expired one).

Provider tokens and the admin token are stored only as sha256 digests; the
tokens are 256-bit random strings, so a fast hash is enough (no password
stretching is needed against a brute force of 2**256). Tokens are found by
their digest in an in-memory table (no database read per call) and the stored
digest is then compared with `hmac.compare_digest`; the lookup's timing can
only tell a caller about the digest of its own guess.

Token lifecycle: `rotate_token` gives a provider a new token and keeps the old
digest in ``retired_tokens`` until the grace period ends (then it is refused,
with a message saying so); `revoke_provider` refuses every token of the
provider at once and ends its live attempts as ``revoked``, so the next
heartbeat on a stream the provider already has open is ABORTED (a new call
with its token is refused before it gets that far). A provider's
``identity`` is the name it was created with (an mTLS client certificate's CN
must equal it); ``name`` is what it last registered as.

Artifacts: ``records`` maps (attempt, name) to a blob's sha256; the bytes
live in the blob store (`blobs`), each blob once. Records belong to the
attempt that uploaded them, so a failed or retried attempt's records never
shadow another's: a job's final artifacts are its SUCCEEDED attempt's, and
its resume checkpoint is the newest checkpoint any attempt committed. Quotas
(`Quotas`) bound each attempt's and each run's records and bytes. Only the
newest `keep_checkpoints` checkpoints of a job are kept; older ones lose
their records first and their blobs after (`take_garbage`), so no record
points at deleted bytes.

Publications (the regression gate, `publish`): one row per succeeded job with an export
says whether the export is served by default, the verdict and why, the evaluation figures
the status page shows, and an admin's override (time, note, address) when there was one.

Schema migrations: ``meta.schema_version`` names the layout; an older database
is upgraded in place, in one transaction, when it is opened (`_MIGRATIONS`).
At open the database also passes SQLite's ``quick_check`` or is refused.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import hmac
import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import (
    AuthenticationError,
    ConfigError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    PolicyError,
    QuotaError,
    StaleLeaseError,
)
from ..strict_json import no_duplicate_keys
from .artifacts import ArtifactRecord, Claim, artifact_uri, checkpoint_dir, name_conflict
from .policy import (
    CHECKPOINT_POLICIES,
    GRAPH_KINDS,
    JOB_GRAPH_FEATURE,
    MAX_LOCAL_RANKS,
    MAX_MEMORY_BYTES,
    Placement,
    ProviderProfile,
    RunRequirements,
    Verdict,
    check_features,
    check_placement,
    check_version,
    decide,
    default_placement,
    format_bytes,
    local_ranks,
)

SCHEMA_VERSION = 6
# Job kinds: `pipeline` (every stage in one job: runs without a graph) and the graph's stages.
JOB_KINDS = ("pipeline", "prepare", "capture", "train", "evaluate")
# Capture / evaluate shards per graph run (each one job).
MAX_SHARDS = 1024
# Input artifacts one lease names at most (a train job's: every capture shard's final records),
# and their size in the Lease message, so a lease stays well inside the 16 MiB message limit
# that server and run-manager share. A job needing more fails (never a lease missing inputs).
MAX_LEASE_INPUTS = 20_000
MAX_LEASE_INPUT_BYTES = 8 << 20
MAX_JOBS_PER_RUN = 10_000
# Providers `runs show` weighs when it says why a ready job waits (the most recently seen first),
# and how many of them one reason names.
MAX_WAITING_PROVIDERS = 200
WAITING_NAMED = 5
MAX_SPEC_JSON_BYTES = 1 << 20
FINAL_JOB_STATES = ("succeeded", "failed", "cancelled")
DEFAULT_ROTATE_GRACE_SECONDS = 3600
MAX_ROTATE_GRACE_SECONDS = 30 * 24 * 3600

_SCHEMA = """
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
  failure TEXT NOT NULL DEFAULT ''
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
  memory_bytes INTEGER NOT NULL DEFAULT 0
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
"""

# Indexes on columns a migration adds: created once the database has them.
_SCHEMA_AFTER_MIGRATIONS = """
CREATE INDEX IF NOT EXISTS jobs_ready ON jobs(state, run_id, pending_deps, seq);
CREATE INDEX IF NOT EXISTS jobs_by_kind ON jobs(run_id, kind, shard_index);
"""


def _migrate_1_to_2(db: sqlite3.Connection) -> None:
    # Version 1 had no token lifecycle and kept only the registered name, which
    # Register overwrites: the best guess at a provider's created name is its
    # current one (re-create the provider where that is not its certificate CN).
    # `retired_tokens` is created by _SCHEMA (IF NOT EXISTS) before this runs.
    db.execute("ALTER TABLE providers ADD COLUMN identity TEXT NOT NULL DEFAULT ''")
    db.execute("ALTER TABLE providers ADD COLUMN revoked_unix REAL")
    db.execute("UPDATE providers SET identity=name")


def _migrate_2_to_3(db: sqlite3.Connection) -> None:
    # Version 2 recorded artifacts per (job, name) as `file://` URIs (inline uploads
    # under the coordinator's artifact directory, other files wherever a provider
    # said). Those bytes were never in a blob store, so they are not served: the
    # table is kept, renamed, for the record. `records` is created by _SCHEMA.
    if db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='artifacts'").fetchone():
        db.execute("ALTER TABLE artifacts RENAME TO artifacts_v2")


PRE_GATE_REASON = "published by a coordinator without the regression gate (database schema 3)"


def _migrate_3_to_4(db: sqlite3.Connection) -> None:
    # Version 3 had no regression gate: every succeeded job's export was served. Those
    # exports stay published (a user may already have fetched them), and say why.
    # `publications` is created by _SCHEMA. Attempts learn when their current phase began
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
    # `job_deps` is created by _SCHEMA.
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
    # _SCHEMA), so their jobs lease with the defaults (`policy.default_placement`), and their
    # edges stay as created. Providers learn their declared memory from what they registered.
    from ..proto.dflash.v1 import provider_pb2

    db.execute("ALTER TABLE providers ADD COLUMN memory_bytes INTEGER NOT NULL DEFAULT 0")
    for pid, caps in db.execute("SELECT provider_id, capabilities FROM providers WHERE capabilities IS NOT NULL").fetchall():
        try:
            memory = provider_pb2.DeviceCapabilities.FromString(caps).memory_bytes
        except Exception:  # a blob this coordinator did not write: the provider declares it again at Register
            continue
        db.execute("UPDATE providers SET memory_bytes=? WHERE provider_id=?", (min(memory, MAX_MEMORY_BYTES), pid))


# version -> the step that upgrades a database of that version to the next one.
_MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {
    1: _migrate_1_to_2, 2: _migrate_2_to_3, 3: _migrate_3_to_4, 4: _migrate_4_to_5, 5: _migrate_5_to_6,
}  # fmt: skip

UNKNOWN_TOKEN = "unknown bearer token\nhint: ask the coordinator's admin for a provider token"
REVOKED_TOKEN = "this provider's token was revoked\nhint: ask the coordinator's admin for a new provider token"
GRACE_ENDED = "this token was replaced by `providers rotate` and its grace period has ended\nhint: use the provider's new token"


DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1_000
_REC_COLS = "name, kind, sha256, size_bytes, step, run_id, job_id, attempt"
# A queued job `j` is leasable when every job it needs has SUCCEEDED (pipeline jobs need none):
# `pending_deps` counts those that have not (a succeeded job never changes state again), so
# finding a leasable job is an index lookup (`jobs_ready`), however many jobs wait.
_READY = "j.pending_deps=0"


def page(page_size: int, page_token: str) -> tuple[int, int]:
    """`(size, after_seq)` of a page request; INVALID_ARGUMENT on a token this server did not hand out."""
    size = DEFAULT_PAGE_SIZE if page_size == 0 else min(page_size, MAX_PAGE_SIZE)
    if not page_token:
        return size, 0
    if len(page_token) > 24 or not page_token.startswith("s") or not page_token[1:].isdigit():
        raise InvalidRequestError(f"`page_token` `{page_token[:40]}` is not one this coordinator handed out")
    return size, int(page_token[1:])


def next_token(rows: list, size: int) -> str:
    """The next page's token when `rows` (fetched with LIMIT size+1, `seq` first) has more."""
    return f"s{rows[size - 1][0]}" if len(rows) > size else ""


def hash_token(token: str) -> str:
    """Hex sha256 of a bearer token (what the database keeps instead of the token)."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def new_token() -> str:
    """A fresh bearer token: 256 random bits, URL-safe."""
    return secrets.token_urlsafe(32)


def printable(text: str) -> str:
    """`text` with control characters replaced by `?` (newlines kept): it reaches an admin's terminal."""
    return "".join(c if c == "\n" or not (ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0) else "?" for c in text)


def _new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(8)}"


def _no_constant(name):
    raise ValueError(f"`{name}` is not valid JSON")


def parse_spec_json(text: str) -> dict:
    """Parse a run's job-spec JSON strictly: one object, no duplicate keys, no NaN/Infinity."""
    if len(text.encode("utf-8")) > MAX_SPEC_JSON_BYTES:
        raise ConfigError(f"`spec.spec_json` is larger than {MAX_SPEC_JSON_BYTES} bytes")
    try:
        value = json.loads(text, object_pairs_hook=no_duplicate_keys, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        where = f" (line {exc.lineno}, column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise ConfigError(
            f"`spec.spec_json` is not valid JSON{where}: {exc}\n"
            "hint: the job spec must be a JSON object with the recipe, data and model references"
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(f"`spec.spec_json` must be a JSON object, got {type(value).__name__}")
    return value


@dataclass(frozen=True, kw_only=True)
class RunSpecData:
    """A validated run specification (what `runs create` submits)."""

    name: str
    spec_json: str
    required_client_version: str
    checkpoint_policy: str = "durable"
    max_local_ranks: int = 1
    required_features: tuple[str, ...] = ()
    image: str = ""
    num_jobs: int = 1
    # A job graph instead of `num_jobs` pipeline jobs when > 0: prepare -> capture x
    # `capture_shards` -> train -> evaluate x `eval_shards` (0: 1). `num_jobs` is then
    # the graph's job count (1 or that count may be given).
    capture_shards: int = 0
    eval_shards: int = 0
    # Each graph kind's placement, from the spec JSON's `placement` object (validated here,
    # stored in `placements` at creation so leasing never parses `spec_json`); () for pipeline runs.
    placements: tuple[tuple[str, Placement], ...] = field(default=(), init=False, compare=False)

    def __post_init__(self):
        if not self.name or len(self.name) > 200 or any(ord(c) < 0x20 for c in self.name):
            raise InvalidRequestError("`spec.name` must be 1-200 printable characters")
        doc = parse_spec_json(self.spec_json)
        check_version(self.required_client_version, "spec.required_client_version")
        if self.checkpoint_policy not in CHECKPOINT_POLICIES:
            raise InvalidRequestError(
                f"`spec.checkpoint_policy` `{self.checkpoint_policy[:40]}` is not one of {list(CHECKPOINT_POLICIES)}"
            )
        if not 1 <= self.max_local_ranks <= MAX_LOCAL_RANKS:
            raise InvalidRequestError(f"`spec.max_local_ranks` must be 1-1024, got {self.max_local_ranks}")
        check_features(self.required_features, "spec.required_features")
        if len(self.image) > 512:
            raise InvalidRequestError("`spec.image` is longer than 512 characters")
        for k in ("capture_shards", "eval_shards"):
            if not 0 <= getattr(self, k) <= MAX_SHARDS:
                raise InvalidRequestError(f"`spec.{k}` must be 0-{MAX_SHARDS}, got {getattr(self, k)}")
        if self.capture_shards == 0:
            if self.eval_shards:
                raise InvalidRequestError(
                    "`spec.eval_shards` needs `spec.capture_shards`: evaluate jobs exist only in a job graph\n"
                    "hint: give `--capture-shards N` too, or leave `--eval-shards` out"
                )
        else:
            object.__setattr__(self, "eval_shards", self.eval_shards or 1)
            total = 2 + self.capture_shards + self.eval_shards
            if self.num_jobs not in (1, total):
                raise InvalidRequestError(
                    f"`spec.num_jobs` {self.num_jobs} does not apply to a job graph ({total} jobs: prepare, "
                    f"{self.capture_shards} capture, train, {self.eval_shards} evaluate)\nhint: leave `--jobs` out with `--capture-shards`"
                )
            object.__setattr__(self, "num_jobs", total)
            if JOB_GRAPH_FEATURE not in self.required_features:
                object.__setattr__(self, "required_features", (*self.required_features, JOB_GRAPH_FEATURE))
        if not 1 <= self.num_jobs <= MAX_JOBS_PER_RUN:
            raise InvalidRequestError(f"`spec.num_jobs` must be 1-{MAX_JOBS_PER_RUN}, got {self.num_jobs}")
        if "placement" in doc and not self.capture_shards:
            raise InvalidRequestError(
                "`spec.spec_json.placement` applies to the jobs of a job graph; this run has none\n"
                "hint: give `--capture-shards N`, or use `--feature` and `--max-local-ranks` for the run's pipeline jobs"
            )
        if self.capture_shards:
            placements = check_placement(doc.get("placement", {}), max_local_ranks=self.max_local_ranks)
            object.__setattr__(self, "placements", tuple(placements.items()))

    def graph(self) -> list[tuple[str, int, int, tuple[int, ...]]]:
        """The run's jobs in creation order: `(kind, shard_index, shard_count, needs)`, `needs` indexing this list.

        Every later job needs prepare (the worker reads the prepared data in each); train needs
        every capture shard; evaluate shard j needs train, and shard 0 also needs shards 1..M-1
        (it merges their rows into the run's one report). Runs created before these edges keep
        the edges they were created with (`job_deps` is not migrated): a job's inputs are always
        what its own rows say.
        """
        if not self.capture_shards:
            return [("pipeline", 0, 1, ())] * self.num_jobs
        n, m = self.capture_shards, self.eval_shards
        train = n + 1
        jobs = [("prepare", 0, 1, ())]
        jobs += [("capture", i, n, (0,)) for i in range(n)]
        jobs.append(("train", 0, 1, (0, *range(1, n + 1))))
        jobs.append(("evaluate", 0, m, (0, train, *range(train + 2, train + 1 + m))))
        jobs += [("evaluate", i, m, (0, train)) for i in range(1, m)]
        return jobs

    @classmethod
    def stored(cls, **fields) -> RunSpecData:
        """A spec read back from the database: checked when it was created, not parsed again
        (re-parsing a 1 MiB `spec_json` per queued run on every AcquireLease stalled the loop)."""
        self = object.__new__(cls)
        for k, v in fields.items():
            object.__setattr__(self, k, v)
        return self


@dataclass(frozen=True, kw_only=True)
class RunRow:
    run_id: str
    spec: RunSpecData
    approved_native_versions: tuple[str, ...]
    created_unix: float
    job_states: dict[str, int]
    # Why a graph run failed (names the job), "" while it has not.
    failure: str = ""

    def requirements(self) -> RunRequirements:
        return RunRequirements(
            required_client_version=self.spec.required_client_version,
            approved_native_versions=frozenset(self.approved_native_versions),
            checkpoint_policy=self.spec.checkpoint_policy,
            max_local_ranks=self.spec.max_local_ranks,
            required_features=self.spec.required_features,
        )


@dataclass(frozen=True, kw_only=True)
class JobRow:
    job_id: str
    run_id: str
    state: str
    attempts: int
    # The SUCCEEDED attempt's records: how many, and its export model (if any).
    artifact_count: int = 0
    export: ArtifactRecord | None = None
    # The regression gate's decision on the export (None: no export, or not decided yet).
    publication: PublicationRow | None = None
    kind: str = "pipeline"
    shard_index: int = 0
    shard_count: int = 1
    # The jobs this one needs, and those of them that have not succeeded yet.
    needs: tuple[str, ...] = ()
    waiting_for: tuple[str, ...] = ()
    # Why the job failed without an attempt of its own failing ("" otherwise).
    reason: str = ""
    # Why a queued job whose needs all succeeded is not leased yet ("" otherwise): computed when asked.
    waiting_reason: str = ""


@dataclass(frozen=True, kw_only=True)
class PublicationRow:
    """Whether a job's export is published (served by default), and why."""

    job_id: str
    run_id: str
    attempt_id: str
    published: bool
    verdict: str  # improved / tied / regressed, or "" (no usable evaluation)
    reason: str
    evaluation: dict
    decided_unix: float
    override_unix: float | None = None
    override_note: str = ""
    override_peer: str = ""


@dataclass(frozen=True, kw_only=True)
class GateInputs:
    """What the regression gate reads for a succeeded job: its run's spec and its evaluation report."""

    job_id: str
    run_id: str
    attempt_id: str
    spec_json: str
    report: ArtifactRecord | None
    # Why there is no report, where the gate's generic reason would mislead (a graph run's); "" otherwise.
    no_report: str = ""


@dataclass(frozen=True, kw_only=True)
class Quotas:
    """Artifact limits: records and bytes per attempt and per run (all attempts of all its jobs)."""

    attempt_records: int = 2_000
    attempt_bytes: int = 64 << 30
    run_records: int = 20_000
    run_bytes: int = 512 << 30

    def __post_init__(self):
        for k in ("attempt_records", "attempt_bytes", "run_records", "run_bytes"):
            if getattr(self, k) < 1:
                raise ConfigError(f"artifact quota `{k}` must be at least 1, got {getattr(self, k)}")


@dataclass(frozen=True, kw_only=True)
class StoredArtifact:
    """A record with where it came from (for listings and downloads)."""

    job_id: str
    attempt: int
    attempt_state: str
    record: ArtifactRecord
    created_unix: float


@dataclass(frozen=True, kw_only=True)
class Principal:
    """Who a bearer token belongs to."""

    admin: bool
    provider_id: str = ""
    # The name the provider was created with (what an mTLS certificate's CN must be).
    name: str = ""


@dataclass(frozen=True)
class _Token:
    """One accepted token digest: whose it is and until when (None: until rotated or revoked)."""

    digest: str
    principal: Principal
    expires_unix: float | None = None


@dataclass(frozen=True, kw_only=True)
class Registration:
    client_version: str
    native_client_version: str
    launch_mode: int
    native: bool
    backend: str
    device_count: int
    features: tuple[str, ...]
    capabilities: bytes
    name: str
    # `capabilities.memory_bytes` (per device), what placement's `min_memory_bytes` is compared with.
    memory_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class ProviderRow:
    provider_id: str
    name: str
    client_version: str
    launch_mode: int
    capabilities: bytes | None
    last_seen_unix: float | None
    identity: str = ""
    revoked_unix: float | None = None


@dataclass(frozen=True, kw_only=True)
class Grant:
    """A lease handed to a provider."""

    lease_id: str
    run_id: str
    job_id: str
    attempt: int
    spec_json: str
    ttl_seconds: float
    resume_checkpoint: ArtifactRecord | None
    checkpoint_policy: str
    local_ranks: int
    required_features: tuple[str, ...]
    required_client_version: str
    image: str
    kind: str = "pipeline"
    shard_index: int = 0
    shard_count: int = 1
    # The final (SUCCEEDED attempt's) artifacts of the jobs this one needs, to download before it starts.
    inputs: tuple[ArtifactRecord, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Upgrade:
    required_client_version: str
    message: str


@dataclass(frozen=True, kw_only=True)
class LiveLease:
    """The attempt behind a live lease, as a write sees it."""

    attempt_id: str
    job_id: str
    run_id: str


@dataclass(kw_only=True)
class Progress:
    phase: int = 0
    step: int = 0
    total_steps: int = 0
    committed_step: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


class StoreReader:
    """The queries the status page makes (`snapshot`), over `db`. `Store` is one; so is a
    read-only connection of another process (`StoreReader.open`, `snapshot_proc`)."""

    db: sqlite3.Connection

    @classmethod
    def open(cls, path: Path) -> StoreReader:
        """A read-only connection to the coordinator database at `path` (SQLite `mode=ro`: it writes nothing)."""
        from urllib.parse import quote

        reader = cls.__new__(cls)
        try:
            reader.db = sqlite3.connect(f"file:{quote(str(path))}?mode=ro", uri=True, isolation_level=None)
            reader.db.execute("PRAGMA busy_timeout=5000")
            reader.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"cannot open coordinator database `{path}` to read: {exc}") from None
        return reader

    _PUB_COLS = "job_id, run_id, attempt_id, published, verdict, reason, evaluation_json, decided_unix, override_unix, override_note, override_peer"

    @staticmethod
    def _publication_row(r) -> PublicationRow:
        return PublicationRow(
            job_id=r[0], run_id=r[1], attempt_id=r[2], published=bool(r[3]), verdict=r[4], reason=r[5], evaluation=json.loads(r[6]),
            decided_unix=r[7], override_unix=r[8], override_note=r[9], override_peer=r[10],
        )  # fmt: skip

    def publication(self, job_id: str) -> PublicationRow | None:
        """The gate's decision on the job's export; None when it has none (no export, or not decided yet)."""
        r = self.db.execute(f"SELECT {self._PUB_COLS} FROM publications WHERE job_id=?", (job_id,)).fetchone()
        return None if r is None else self._publication_row(r)


class Store(StoreReader):
    """SQLite-backed coordinator state. Not thread-safe: use it from one thread."""

    def __init__(
        self,
        path: Path,
        *,
        lease_ttl: float = 30.0,
        max_attempts: int = 5,
        clock: Callable[[], float] = time.time,
        on_work: Callable[[], None] | None = None,
        quotas: Quotas | None = None,
        keep_checkpoints: int = 2,
        live_seconds: float | None = None,
    ):
        if lease_ttl <= 0:
            raise ConfigError(f"`--lease-ttl` must be positive, got {lease_ttl}")
        # A provider counts as live for `runs show`'s waiting reasons when it asked for work this
        # recently (a long poll refreshes it) or holds a live lease.
        self.live_seconds = float(live_seconds) if live_seconds is not None else max(2 * lease_ttl, 60.0)
        if max_attempts < 1:
            raise ConfigError(f"`--max-attempts` must be at least 1, got {max_attempts}")
        self.path = Path(path)
        self.lease_ttl = float(lease_ttl)
        self.max_attempts = int(max_attempts)
        self.clock = clock
        self.on_work = on_work or (lambda: None)
        self.quotas = quotas or Quotas()
        if keep_checkpoints < 1:
            raise ConfigError(f"`--keep-checkpoints` must be at least 1, got {keep_checkpoints}")
        self.keep_checkpoints = int(keep_checkpoints)
        # Blobs whose last record went away (checkpoint rotation, ended attempts): the
        # server deletes them from the blob store unless a record refers to them again.
        self.garbage: set[str] = set()
        # Attempts that ended since the server last looked (their staged uploads go).
        self.ended_attempts: set[str] = set()
        # Event counts since this process started (`metrics` exposes them): leases_granted,
        # heartbeats, attempt_<state> for each attempt that ended.
        self.counts: collections.Counter[str] = collections.Counter()
        self._ckpt_lock = threading.Lock()
        self._ckpt_db: sqlite3.Connection | None = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(str(self.path), isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute("PRAGMA foreign_keys=ON")
            self.db.execute("PRAGMA busy_timeout=5000")
            problems = [r[0] for r in self.db.execute("PRAGMA quick_check(5)")]
            if problems != ["ok"]:
                raise ConfigError(
                    f"coordinator database `{self.path}` is damaged (SQLite quick_check: {'; '.join(problems)[:400]})\n"
                    "hint: restore it from a backup; the coordinator will not run on a damaged database"
                )
            self.db.executescript(_SCHEMA)
            row = self.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                self.db.execute("INSERT INTO meta(key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            else:
                try:
                    version = int(str(row[0]).strip())
                except ValueError:
                    raise ConfigError(
                        f"coordinator database `{self.path}` has a malformed schema version `{str(row[0])[:40]}`\n"
                        "hint: this is not a database this coordinator wrote, or it was edited by hand"
                    ) from None
                self._migrate(version)
            self.db.executescript(_SCHEMA_AFTER_MIGRATIONS)
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"cannot open coordinator database `{self.path}`: {exc}") from None
        self._tokens: dict[str, _Token] = {}
        # The status page's viewer token digest ("" when there is none; None until first read).
        self._viewer_digest: str | None = None
        # Digests refused with a specific reason (revoked, grace ended) instead of "unknown".
        self._refused: dict[str, str] = {}
        self._load_tokens()

    def _migrate(self, version: int) -> None:
        """Upgrade a database at schema `version` to SCHEMA_VERSION in one transaction."""
        if version > SCHEMA_VERSION or (version < SCHEMA_VERSION and version not in _MIGRATIONS):
            raise ConfigError(
                f"coordinator database `{self.path}` has schema version {version}, this coordinator uses {SCHEMA_VERSION}"
                + ("\nhint: it was written by a newer coordinator; run that one" if version > SCHEMA_VERSION else "")
            )
        if version == SCHEMA_VERSION:
            return
        with self._tx() as db:
            while version < SCHEMA_VERSION:
                _MIGRATIONS[version](db)
                version += 1
            db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(version),))

    def close(self) -> None:
        with self._ckpt_lock:
            if self._ckpt_db is not None:
                self._ckpt_db.close()
                self._ckpt_db = None
        self.db.close()

    def checkpoint_in_background(self) -> None:
        """Stop this connection's automatic WAL checkpoints: the caller runs `checkpoint_wal` off the loop.

        In WAL mode with ``synchronous=NORMAL`` a commit does not fsync; the checkpoint
        that copies the WAL into the database does, and by default it runs inside whichever
        commit crosses 1,000 pages: a heartbeat's, on the event loop, behind every dirty page
        an upload left for the disk. The server calls `checkpoint_wal` from a thread instead.
        """
        self.db.execute("PRAGMA wal_autocheckpoint=0")

    def checkpoint_wal(self) -> tuple[int, int, int]:
        """One PASSIVE WAL checkpoint on a connection of its own (never waits for writers); SQLite's
        `(busy, wal pages, pages checkpointed)`. Safe from any one thread at a time."""
        with self._ckpt_lock:
            if self._ckpt_db is None:
                self._ckpt_db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
                self._ckpt_db.execute("PRAGMA busy_timeout=5000")
            busy, log, done = self._ckpt_db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            return int(busy), int(log), int(done)

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # --- tokens ---------------------------------------------------------

    def _load_tokens(self) -> None:
        """Rebuild the in-memory token table from the database (startup and admin-token changes)."""
        now = self.clock()
        tokens: dict[str, _Token] = {}
        refused: dict[str, str] = {}
        for pid, identity, digest, revoked in self.db.execute("SELECT provider_id, identity, token_sha256, revoked_unix FROM providers"):
            if revoked is not None:
                refused[digest] = REVOKED_TOKEN
            else:
                tokens[digest] = _Token(digest, Principal(admin=False, provider_id=pid, name=identity))
        for digest, pid, expires, identity, revoked in self.db.execute(
            "SELECT t.token_sha256, t.provider_id, t.expires_unix, p.identity, p.revoked_unix FROM retired_tokens t JOIN providers p USING (provider_id)"
        ):
            if revoked is not None:
                refused[digest] = REVOKED_TOKEN
            elif expires <= now:
                refused[digest] = GRACE_ENDED
            else:
                tokens[digest] = _Token(digest, Principal(admin=False, provider_id=pid, name=identity), expires)
        row = self.db.execute("SELECT value FROM meta WHERE key='admin_token_sha256'").fetchone()
        if row:
            tokens[row[0]] = _Token(row[0], Principal(admin=True))
        self._tokens, self._refused = tokens, refused

    def has_admin_token(self) -> bool:
        return self.db.execute("SELECT 1 FROM meta WHERE key='admin_token_sha256'").fetchone() is not None

    def set_admin_token(self, token: str) -> None:
        """Replace the admin token (only its hash is kept)."""
        if len(token) < 16:
            raise ConfigError("the admin token must be at least 16 characters\nhint: leave it unset and one is generated")
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('admin_token_sha256', ?)", (hash_token(token),))
        self._load_tokens()

    def has_viewer_token(self) -> bool:
        return self.db.execute("SELECT 1 FROM meta WHERE key='viewer_token_sha256'").fetchone() is not None

    def set_viewer_token(self, token: str) -> None:
        """Replace the status page's read-only viewer token (only its hash is kept). It is never a gRPC credential."""
        if len(token) < 16:
            raise ConfigError("the viewer token must be at least 16 characters\nhint: leave it unset and one is generated")
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('viewer_token_sha256', ?)", (hash_token(token),))
        self._viewer_digest = hash_token(token)

    def web_role(self, token: str) -> str | None:
        """`"admin"` or `"viewer"` for a token the status page accepts, else None (provider tokens are refused)."""
        if not token or len(token) > 512:
            return None
        digest = hash_token(token)
        viewer = self._viewer_digest
        if viewer is None:
            row = self.db.execute("SELECT value FROM meta WHERE key='viewer_token_sha256'").fetchone()
            viewer = self._viewer_digest = row[0] if row else ""
        if viewer and hmac.compare_digest(viewer, digest):
            return "viewer"
        p = self.principal(token)
        return "admin" if p is not None and p.admin else None

    def authenticate(self, token: str) -> Principal:
        """Who `token` belongs to; raises `AuthenticationError` (saying why) for a token that is not valid now."""
        digest = hash_token(token)
        entry = self._tokens.get(digest)
        if entry is None or not hmac.compare_digest(entry.digest, digest):
            raise AuthenticationError(self._refused.get(digest, UNKNOWN_TOKEN))
        if entry.expires_unix is not None and entry.expires_unix <= self.clock():
            del self._tokens[digest]
            self._refused[digest] = GRACE_ENDED
            raise AuthenticationError(GRACE_ENDED)
        return entry.principal

    def principal(self, token: str) -> Principal | None:
        """Who `token` belongs to, or None for a token that is not valid now."""
        try:
            return self.authenticate(token)
        except AuthenticationError:
            return None

    # --- runs -----------------------------------------------------------

    def create_run(self, spec: RunSpecData) -> RunRow:
        now = self.clock()
        run_id = _new_id("run")
        try:
            with self._tx() as db:
                db.execute(
                    "INSERT INTO runs(run_id, name, spec_json, required_client_version, checkpoint_policy,"
                    " max_local_ranks, required_features, image, num_jobs, created_unix, capture_shards, eval_shards)"
                    " VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        run_id,
                        spec.name,
                        spec.spec_json,
                        spec.required_client_version,
                        spec.checkpoint_policy,
                        spec.max_local_ranks,
                        json.dumps(list(spec.required_features)),
                        spec.image,
                        spec.num_jobs,
                        now,
                        spec.capture_shards,
                        spec.eval_shards,
                    ),
                )
                graph = spec.graph()
                ids = [_new_id("job") for _ in graph]
                db.executemany(
                    "INSERT INTO jobs(job_id, run_id, state, updated_unix, kind, shard_index, shard_count, pending_deps) VALUES (?, ?, 'queued', ?, ?, ?, ?, ?)",
                    [(ids[i], run_id, now, kind, index, count, len(needs)) for i, (kind, index, count, needs) in enumerate(graph)],
                )
                db.executemany(
                    "INSERT INTO job_deps(job_id, needs_job_id) VALUES (?, ?)",
                    [(ids[i], ids[n]) for i, (_, _, _, needs) in enumerate(graph) for n in needs],
                )
                db.executemany(
                    "INSERT INTO placements(run_id, kind, min_memory_bytes, required_features, local_ranks) VALUES (?,?,?,?,?)",
                    [(run_id, k, p.min_memory_bytes, json.dumps(list(p.required_features)), p.local_ranks) for k, p in spec.placements],
                )
        except sqlite3.IntegrityError:
            raise ConflictError(f"a run named `{spec.name}` already exists\nhint: pick another `--name`") from None
        self.on_work()
        return self.get_run(run_id)

    def _run_from_row(self, r, *, count_states: bool = True) -> RunRow:
        run_id = r[0]
        approved = tuple(v for (v,) in self.db.execute("SELECT version FROM approved_versions WHERE run_id=? ORDER BY approved_unix, version", (run_id,)))
        states = dict(self.db.execute("SELECT state, COUNT(*) FROM jobs WHERE run_id=? GROUP BY state", (run_id,)).fetchall()) if count_states else {}
        spec = RunSpecData.stored(
            name=r[1],
            spec_json=r[2],
            required_client_version=r[3],
            checkpoint_policy=r[4],
            max_local_ranks=r[5],
            required_features=tuple(json.loads(r[6])),
            image=r[7],
            num_jobs=r[8],
            capture_shards=r[10],
            eval_shards=r[11],
        )
        return RunRow(run_id=run_id, spec=spec, approved_native_versions=approved, created_unix=r[9], job_states=states, failure=r[12])

    _RUN_COLS = (
        "run_id, name, spec_json, required_client_version, checkpoint_policy, max_local_ranks, required_features, image, num_jobs, created_unix,"
        " capture_shards, eval_shards, failure"
    )

    def _run_for_lease(self, run_id: str) -> RunRow:
        # Like get_run without counting job states (O(jobs) per AcquireLease otherwise) and
        # without `spec_json` (up to 1 MiB per run; read only for the run a lease is granted in).
        r = self.db.execute(f"SELECT {self._RUN_COLS.replace('spec_json', chr(39) * 2)} FROM runs WHERE run_id=?", (run_id,)).fetchone()
        return self._run_from_row(r, count_states=False)

    def kind_requirements(self, run: RunRow) -> dict[str, RunRequirements]:
        """What a job of each kind of `run` needs of a provider: the run's requirements with the kind's
        stored placement on top (`pipeline` alone for a run without a graph). A few small rows, no `spec_json`."""
        req = run.requirements()
        if not run.spec.capture_shards:
            return {"pipeline": req.for_kind(default_placement("pipeline", req.max_local_ranks))}
        # A graph run created before placements (schema 5) has no rows: the defaults apply.
        stored = {
            kind: Placement(min_memory_bytes=memory, required_features=tuple(json.loads(features)), local_ranks=ranks)
            for kind, memory, features, ranks in self.db.execute(
                "SELECT kind, min_memory_bytes, required_features, local_ranks FROM placements WHERE run_id=?", (run.run_id,)
            )
        }
        return {kind: req.for_kind(stored.get(kind) or default_placement(kind, req.max_local_ranks)) for kind in GRAPH_KINDS}

    def _spec_json(self, run_id: str) -> str:
        return self.db.execute("SELECT spec_json FROM runs WHERE run_id=?", (run_id,)).fetchone()[0]

    def get_run(self, run_id: str) -> RunRow:
        r = self.db.execute(f"SELECT {self._RUN_COLS} FROM runs WHERE run_id=?", (run_id,)).fetchone()
        if r is None:
            raise NotFoundError(f"no run `{run_id}`\nhint: `dflash-coordinator runs list` shows the runs")
        return self._run_from_row(r)

    def list_runs(self, page_size: int = 0, page_token: str = "") -> tuple[list[RunRow], str]:
        """One page of runs (oldest first) and the token of the next page ("" on the last)."""
        size, after = page(page_size, page_token)
        rows = self.db.execute(f"SELECT seq, {self._RUN_COLS} FROM runs WHERE seq > ? ORDER BY seq LIMIT ?", (after, size + 1)).fetchall()
        return [self._run_from_row(r[1:]) for r in rows[:size]], next_token(rows, size)

    def run_jobs(self, run_id: str, page_size: int = 0, page_token: str = "") -> tuple[list[JobRow], str]:
        """One page of a run's jobs, each with its final artifacts' count and export, and the next page's token;
        a ready queued job also says why it waits (`waiting_reasons`)."""
        run = self.get_run(run_id)
        size, after = page(page_size, page_token)
        rows = self.db.execute(
            "SELECT seq, job_id, state, attempts, kind, shard_index, shard_count, reason FROM jobs WHERE run_id=? AND seq > ? ORDER BY seq LIMIT ?",
            (run_id, after, size + 1),
        ).fetchall()
        out = []
        for _, job_id, state, attempts, kind, shard_index, shard_count, reason in rows[:size]:
            deps = self.db.execute(
                "SELECT d.needs_job_id, n.state FROM job_deps d JOIN jobs n ON n.job_id=d.needs_job_id WHERE d.job_id=? ORDER BY n.seq", (job_id,)
            ).fetchall()
            final = self._succeeded_attempt(job_id)
            count, export = 0, None
            if final is not None:
                count = self.db.execute("SELECT COUNT(*) FROM records WHERE attempt_id=?", (final[0],)).fetchone()[0]
                r = self.db.execute(
                    f"SELECT {_REC_COLS} FROM records WHERE attempt_id=? AND kind='export' ORDER BY (name LIKE '%model.safetensors') DESC, seq LIMIT 1",
                    (final[0],),
                ).fetchone()
                export = None if r is None else self._record(r)
            pub = self.publication(job_id) if export is not None else None
            out.append(
                JobRow(
                    job_id=job_id, run_id=run_id, state=state, attempts=attempts, artifact_count=count, export=export, publication=pub,
                    kind=kind, shard_index=shard_index, shard_count=shard_count, reason=reason,
                    needs=tuple(d for d, _ in deps), waiting_for=tuple(d for d, st in deps if st != "succeeded"),
                )  # fmt: skip
            )
        waiting = [j for j in out if j.state == "queued" and not j.waiting_for] if not run.failure else []
        if waiting:
            why = self.waiting_reasons(run, {j.kind for j in waiting})
            ids = {j.job_id for j in waiting}
            out = [dataclasses.replace(j, waiting_reason=why[j.kind]) if j.job_id in ids else j for j in out]
        return out, next_token(rows, size)

    def _live_providers(self) -> tuple[list[tuple[str, ProviderProfile, bool]], int]:
        """Up to MAX_WAITING_PROVIDERS live providers (seen within `live_seconds`, or holding a live
        lease), the most recently seen first: `(label, profile, busy)`; and how many were found
        (one more than the cap when there are more). Two index range reads, bounded."""
        now = self.clock()
        cols = "provider_id, identity, name, client_version, native_client_version, native, backend, device_count, features, memory_bytes"
        rows = self.db.execute(
            f"SELECT {cols} FROM providers WHERE last_seen_unix >= ? AND revoked_unix IS NULL AND registered_unix IS NOT NULL"
            " ORDER BY last_seen_unix DESC LIMIT ?",
            (now - self.live_seconds, MAX_WAITING_PROVIDERS + 1),
        ).fetchall()
        busy = {
            p
            for (p,) in self.db.execute(
                "SELECT DISTINCT provider_id FROM attempts WHERE state='live' AND lease_expires_unix >= ? LIMIT ?", (now, MAX_WAITING_PROVIDERS + 1)
            )
        }
        seen = {r[0] for r in rows}
        for pid in sorted(busy - seen):
            if len(rows) > MAX_WAITING_PROVIDERS:
                break
            r = self.db.execute(f"SELECT {cols} FROM providers WHERE provider_id=? AND revoked_unix IS NULL AND registered_unix IS NOT NULL", (pid,)).fetchone()
            if r is not None:
                rows.append(r)
        out = []
        for pid, identity, name, version, native_version, native, backend, count, features, memory in rows[:MAX_WAITING_PROVIDERS]:
            profile = ProviderProfile(
                client_version=version, native_client_version=native_version, native=bool(native), backend=backend, device_count=count,
                features=frozenset(json.loads(features)), memory_bytes=memory,
            )  # fmt: skip
            label = f"{printable(identity or name)[:80]} ({backend}, {format_bytes(memory) if memory else 'memory not declared'})"
            out.append((label, profile, pid in busy))
        return out, len(rows)

    def waiting_reasons(self, run: RunRow, kinds: set[str]) -> dict[str, str]:
        """Why a ready queued job of each of `kinds` in `run` is not leased: no live provider, none that
        fits (each named with the first requirement it misses, `policy.decide`, placement included), or
        the ones that fit are busy or have not asked for work since it became ready."""
        providers, found = self._live_providers()
        if not providers:
            return dict.fromkeys(kinds, f"waiting for a provider: no live provider is registered (none asked for work in the last {self.live_seconds:.0f} s)")
        reqs = self.kind_requirements(run)
        total = f"the {len(providers)} most recently seen live providers" if found > len(providers) else f"{len(providers)} live provider" + ("s" if len(providers) > 1 else "")
        out = {}
        for kind in kinds:
            fit, unfit = [], []
            for label, profile, busy in providers:
                verdict, reason = decide(reqs[kind], profile)
                (fit if verdict is Verdict.ELIGIBLE else unfit).append((label, busy, reason))
            what = f"{kind} job" if kind != "pipeline" else "job"
            if not fit:
                named = "; ".join(f"{label}: {reason}" for label, _, reason in unfit[:WAITING_NAMED])
                more = f"; and {len(unfit) - WAITING_NAMED} more" if len(unfit) > WAITING_NAMED else ""
                out[kind] = f"waiting for a provider: none of {total} fits this {what}: {named}{more}"
                continue
            idle = [label for label, busy, _ in fit if not busy]
            listed = idle or [label for label, _, _ in fit]
            names = ", ".join(listed[:WAITING_NAMED]) + (f" and {len(listed) - WAITING_NAMED} more" if len(listed) > WAITING_NAMED else "")
            if not idle:
                out[kind] = f"waiting for a provider: the live providers that fit this {what} are busy with other jobs: {names}"
            else:
                out[kind] = f"waiting for a provider: {names} fit this {what}; it is leased when one asks for work (older runs' jobs first)"
        return out

    def approve_version(self, run_id: str, version: str) -> RunRow:
        check_version(version, "version")
        self.get_run(run_id)
        with self._tx() as db:
            db.execute("INSERT OR IGNORE INTO approved_versions(run_id, version, approved_unix) VALUES (?,?,?)", (run_id, version, self.clock()))
        self.on_work()
        return self.get_run(run_id)

    # --- providers ------------------------------------------------------

    def create_provider(self, name: str) -> tuple[str, str]:
        """Create a provider; return `(provider_id, token)`. The token is not stored."""
        if not name or len(name) > 200 or any(ord(c) < 0x20 for c in name):
            raise InvalidRequestError("`name` must be 1-200 printable characters")
        token = new_token()
        provider_id = _new_id("prov")
        digest = hash_token(token)
        with self._tx() as db:
            db.execute(
                "INSERT INTO providers(provider_id, name, identity, token_sha256, created_unix) VALUES (?,?,?,?,?)",
                (provider_id, name, name, digest, self.clock()),
            )
        self._tokens[digest] = _Token(digest, Principal(admin=False, provider_id=provider_id, name=name))
        return provider_id, token

    def _provider_state(self, provider_id: str) -> tuple[str, str, float | None]:
        """`(identity, token_sha256, revoked_unix)` of a provider; NOT_FOUND if there is none."""
        r = self.db.execute("SELECT identity, token_sha256, revoked_unix FROM providers WHERE provider_id=?", (provider_id[:200],)).fetchone()
        if r is None:
            raise NotFoundError(f"no provider `{provider_id[:80]}`\nhint: `dflash-coordinator providers list` shows the provider ids")
        return r

    def rotate_token(self, provider_id: str, grace_seconds: float) -> tuple[str, float]:
        """Give a provider a new token; the old one keeps working for `grace_seconds`.

        Returns `(new_token, old_token_expires_unix)`. A grace of 0 refuses the
        old token at once. Tokens still in an earlier rotation's grace period
        keep their own end.
        """
        if not 0 <= grace_seconds <= MAX_ROTATE_GRACE_SECONDS:
            raise InvalidRequestError(f"`grace_seconds` must be 0-{MAX_ROTATE_GRACE_SECONDS}, got {grace_seconds}")
        identity, old, revoked = self._provider_state(provider_id)
        if revoked is not None:
            raise PolicyError(f"provider `{provider_id}` is revoked; its token cannot be rotated\nhint: create a new provider")
        token = new_token()
        digest = hash_token(token)
        now = self.clock()
        expires = now + grace_seconds
        with self._tx() as db:
            db.execute("UPDATE providers SET token_sha256=? WHERE provider_id=?", (digest, provider_id))
            db.execute(
                "INSERT INTO retired_tokens(token_sha256, provider_id, retired_unix, expires_unix) VALUES (?,?,?,?)",
                (old, provider_id, now, expires),
            )
        principal = Principal(admin=False, provider_id=provider_id, name=identity)
        if grace_seconds > 0:
            self._tokens[old] = _Token(old, principal, expires)
        else:
            self._tokens.pop(old, None)
            self._refused[old] = GRACE_ENDED
        self._tokens[digest] = _Token(digest, principal)
        return token, expires

    def revoke_provider(self, provider_id: str) -> int:
        """Refuse every token of a provider from now on and end its live attempts; returns how many were ended.

        Their jobs go back to the queue (or fail at `max_attempts`, or end
        cancelled if a cancel was pending), so another provider takes them up;
        a write on those leases through a call authenticated before now (an
        open Heartbeat stream) is ABORTED. Revoking twice changes nothing.
        """
        self._provider_state(provider_id)
        now = self.clock()
        with self._tx() as db:
            db.execute("UPDATE providers SET revoked_unix=? WHERE provider_id=? AND revoked_unix IS NULL", (now, provider_id))
            live = db.execute("SELECT attempt_id, job_id FROM attempts WHERE provider_id=? AND state='live'", (provider_id,)).fetchall()
            states = [self._end_attempt(db, a, j, "revoked", f"provider `{provider_id}` was revoked", now) for a, j in live]
        digests = [d for d, t in self._tokens.items() if t.principal.provider_id == provider_id and not t.principal.admin]
        for d in digests:
            del self._tokens[d]
            self._refused[d] = REVOKED_TOKEN
        if "queued" in states:
            self.on_work()
        return len(live)

    def register(self, provider_id: str, reg: Registration) -> None:
        now = self.clock()
        with self._tx() as db:
            cur = db.execute(
                "UPDATE providers SET client_version=?, native_client_version=?, launch_mode=?, native=?, backend=?, device_count=?,"
                " features=?, capabilities=?, name=?, registered_unix=?, last_seen_unix=?, memory_bytes=? WHERE provider_id=?",
                (
                    reg.client_version,
                    reg.native_client_version,
                    reg.launch_mode,
                    int(reg.native),
                    reg.backend,
                    reg.device_count,
                    json.dumps(list(reg.features)),
                    reg.capabilities,
                    reg.name,
                    now,
                    now,
                    min(max(reg.memory_bytes, 0), MAX_MEMORY_BYTES),
                    provider_id,
                ),
            )
            if cur.rowcount != 1:
                raise NotFoundError(f"no provider `{provider_id}`")

    _PROVIDER_COLS = "provider_id, name, client_version, launch_mode, capabilities, last_seen_unix, identity, revoked_unix"

    @staticmethod
    def _provider_row(r) -> ProviderRow:
        return ProviderRow(
            provider_id=r[0], name=r[1], client_version=r[2], launch_mode=r[3], capabilities=r[4], last_seen_unix=r[5], identity=r[6], revoked_unix=r[7]
        )

    def list_providers(self) -> list[ProviderRow]:
        return [self._provider_row(r) for r in self.db.execute(f"SELECT {self._PROVIDER_COLS} FROM providers ORDER BY seq")]

    def get_provider(self, provider_id: str) -> ProviderRow:
        self._provider_state(provider_id)
        return self._provider_row(self.db.execute(f"SELECT {self._PROVIDER_COLS} FROM providers WHERE provider_id=?", (provider_id,)).fetchone())

    def _profile(self, provider_id: str) -> ProviderProfile:
        r = self.db.execute(
            "SELECT client_version, native_client_version, native, backend, device_count, features, registered_unix, memory_bytes"
            " FROM providers WHERE provider_id=?",
            (provider_id,),
        ).fetchone()
        if r is None:
            raise NotFoundError(f"no provider `{provider_id}`")
        if r[6] is None:
            raise PolicyError(f"provider `{provider_id}` has not registered\nhint: call `Register` before `AcquireLease`")
        return ProviderProfile(
            client_version=r[0],
            native_client_version=r[1],
            native=bool(r[2]),
            backend=r[3],
            device_count=r[4],
            features=frozenset(json.loads(r[5])),
            memory_bytes=r[7],
        )

    # --- leases ---------------------------------------------------------

    def acquire(self, provider_id: str) -> Grant | Upgrade | None:
        """Lease the oldest eligible queued job to `provider_id`.

        Returns a `Grant`, an `Upgrade` when queued work exists that only a
        different client version could take, or None when there is nothing
        this provider can run.
        """
        self.expire_due()
        profile = self._profile(provider_id)
        now = self.clock()
        self.db.execute("UPDATE providers SET last_seen_unix=? WHERE provider_id=?", (now, provider_id))
        upgrade: Upgrade | None = None
        # EXISTS over the (state, run_id) index: O(runs), not O(queued jobs). A run whose queued
        # jobs all wait for others has nothing to lease (and so asks no provider to upgrade).
        run_ids = [
            r
            for (r,) in self.db.execute(
                f"SELECT r.run_id FROM runs r WHERE EXISTS (SELECT 1 FROM jobs j WHERE j.state='queued' AND j.run_id=r.run_id AND {_READY}) ORDER BY r.seq"
            )
        ]
        for run_id in run_ids:
            run = self._run_for_lease(run_id)
            # Decided per job kind (placement): the oldest ready job of a kind this provider fits.
            reqs = self.kind_requirements(run)
            fits, behind, why = [], [], ""
            for kind, req in reqs.items():
                verdict, reason = decide(req, profile)
                if verdict is Verdict.ELIGIBLE:
                    fits.append(kind)
                elif verdict is Verdict.UPGRADE:
                    behind.append(kind)
                    why = reason
            if behind and upgrade is None and self._ready_job(run_id, behind) is not None:
                upgrade = Upgrade(required_client_version=run.spec.required_client_version, message=f"run `{run.spec.name}`: {why}")
            if not fits:
                continue
            with self._tx() as db:
                row = self._ready_job(run_id, fits)
                if row is None:
                    continue
                job_id, attempts, kind, shard_index, shard_count = row
                req = reqs[kind]
                inputs = self.inputs(job_id)
                too_many = self._too_many_inputs(inputs)
                if too_many:
                    db.execute("UPDATE jobs SET state='failed', reason=?, updated_unix=? WHERE job_id=?", (too_many, now, job_id))
                    self._fail_graph_run(db, job_id, "failed", too_many, now)
                    continue
                attempt_id, lease_id = _new_id("att"), _new_id("lease")
                db.execute(
                    "INSERT INTO attempts(attempt_id, job_id, number, provider_id, lease_id, state, lease_expires_unix, started_unix)"
                    " VALUES (?,?,?,?,?,'live',?,?)",
                    (attempt_id, job_id, attempts + 1, provider_id, lease_id, now + self.lease_ttl, now),
                )
                db.execute(
                    "UPDATE jobs SET state='leased', attempts=?, current_attempt_id=?, checkpoint_requested=0, updated_unix=? WHERE job_id=?",
                    (attempts + 1, attempt_id, now, job_id),
                )
            self.counts["leases_granted"] += 1
            return Grant(
                lease_id=lease_id,
                run_id=run_id,
                job_id=job_id,
                attempt=attempts + 1,
                spec_json=self._spec_json(run_id),
                ttl_seconds=self.lease_ttl,
                resume_checkpoint=self.last_checkpoint(job_id),
                checkpoint_policy=run.spec.checkpoint_policy,
                local_ranks=local_ranks(req, profile),
                required_features=req.required_features,
                required_client_version=run.spec.required_client_version,
                image=run.spec.image,
                kind=kind,
                shard_index=shard_index,
                shard_count=shard_count,
                inputs=inputs,
            )
        return upgrade

    def _ready_job(self, run_id: str, kinds: list[str]) -> tuple | None:
        """`(job_id, attempts, kind, shard_index, shard_count)` of the run's oldest leasable job of one of `kinds`."""
        return self.db.execute(
            f"SELECT job_id, attempts, kind, shard_index, shard_count FROM jobs j WHERE run_id=? AND state='queued' AND {_READY}"
            f" AND kind IN ({','.join('?' * len(kinds))}) ORDER BY seq LIMIT 1",
            (run_id, *kinds),
        ).fetchone()

    @staticmethod
    def _too_many_inputs(inputs: tuple[ArtifactRecord, ...]) -> str:
        """Why a lease cannot name `inputs` (too many, or too large a message), or ""."""
        size = sum(len(a.name) + len(a.uri) + len(a.kind) + 100 for a in inputs)
        if len(inputs) <= MAX_LEASE_INPUTS and size <= MAX_LEASE_INPUT_BYTES:
            return ""
        return (
            f"the jobs this one needs have {'more than ' if len(inputs) > MAX_LEASE_INPUTS else ''}{min(len(inputs), MAX_LEASE_INPUTS)} final artifacts"
            f" (about {size} bytes of names); a lease names at most {MAX_LEASE_INPUTS} ({MAX_LEASE_INPUT_BYTES} bytes)\n"
            "hint: have each capture shard commit fewer, larger files"
        )

    def inputs(self, job_id: str) -> tuple[ArtifactRecord, ...]:
        """The final artifacts of the jobs `job_id` needs (their SUCCEEDED attempts' records, checkpoints
        aside: those are a job's own), in the needed jobs' order; at most MAX_LEASE_INPUTS + 1 (one more says "too many").

        A capture job's earlier attempts (a provider lost mid-job) hand on their `capture` records too,
        the newest of each name: the shards they committed, which the next attempt verifies and keeps
        instead of capturing them again (`capture.run.scan_shards`), on whichever provider it runs."""
        cols = ", ".join("r." + c.strip() for c in _REC_COLS.split(","))
        rows = self.db.execute(
            f"SELECT {cols} FROM job_deps d JOIN jobs n ON n.job_id=d.needs_job_id"
            " JOIN attempts a ON a.job_id=n.job_id AND a.state='succeeded' JOIN records r ON r.attempt_id=a.attempt_id"
            " WHERE d.job_id=? AND r.kind NOT IN ('checkpoint', 'checkpoint_file') ORDER BY n.seq, r.seq LIMIT ?",
            (job_id, MAX_LEASE_INPUTS + 1),
        ).fetchall()
        if len(rows) <= MAX_LEASE_INPUTS and self.db.execute("SELECT kind FROM jobs WHERE job_id=?", (job_id,)).fetchone() == ("capture",):
            rows += self.db.execute(
                f"SELECT {cols} FROM records r WHERE r.seq IN (SELECT MAX(seq) FROM records WHERE job_id=? AND kind='capture' GROUP BY name)"
                " ORDER BY r.seq LIMIT ?",
                (job_id, MAX_LEASE_INPUTS + 1 - len(rows)),
            ).fetchall()
        return tuple(self._record(r) for r in rows)

    def find_input(self, job_id: str, name: str, sha256: str) -> ArtifactRecord:
        """A record a lease of `job_id` may download: its own job's (`find_record`), or one of its `inputs`."""
        try:
            return self.find_record(job_id, name, sha256)
        except NotFoundError:
            r = self.db.execute(
                f"SELECT {', '.join('r.' + c.strip() for c in _REC_COLS.split(','))} FROM job_deps d"
                " JOIN attempts a ON a.job_id=d.needs_job_id AND a.state='succeeded' JOIN records r ON r.attempt_id=a.attempt_id"
                " WHERE d.job_id=? AND r.name=? AND r.sha256=? AND r.kind NOT IN ('checkpoint', 'checkpoint_file') LIMIT 1",
                (job_id, name, sha256),
            ).fetchone()
            if r is None:
                raise
            return self._record(r)

    def last_checkpoint(self, job_id: str) -> ArtifactRecord | None:
        """The job's newest committed checkpoint, by any attempt (highest step, then latest recorded)."""
        r = self.db.execute(
            f"SELECT {_REC_COLS} FROM records WHERE job_id=? AND kind='checkpoint' ORDER BY step DESC, seq DESC LIMIT 1", (job_id,)
        ).fetchone()
        return None if r is None else self._record(r)

    def _end_attempt(self, db, attempt_id: str, job_id: str, attempt_state: str, message: str, now: float) -> str:
        """Close an attempt and move its job on; returns the job's new state."""
        cancel, attempts = db.execute("SELECT cancel_requested, attempts FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        if attempt_state == "succeeded":
            job_state = "succeeded"
        elif attempt_state == "failed":
            job_state = "failed"
        elif attempt_state == "cancelled" or cancel:
            job_state = "cancelled"
        elif attempts >= self.max_attempts:
            job_state = "failed"
        else:
            job_state = "queued"
        failure = ""
        if job_state == "queued":
            # A graph run that failed meanwhile leases nothing more.
            failure = db.execute("SELECT r.failure FROM runs r JOIN jobs j ON j.run_id=r.run_id WHERE j.job_id=?", (job_id,)).fetchone()[0]
            if failure:
                job_state = "failed"
        db.execute("UPDATE attempts SET state=?, ended_unix=?, message=? WHERE attempt_id=?", (attempt_state, now, message[:4000], attempt_id))
        self.counts[f"attempt_{attempt_state}"] += 1
        self._drop_loose_checkpoint_files(db, attempt_id)
        self.ended_attempts.add(attempt_id)
        db.execute(
            "UPDATE jobs SET state=?, current_attempt_id=NULL, checkpoint_requested=0, reason=?, updated_unix=? WHERE job_id=?",
            (job_state, f"run failed: {failure}" if failure else "", now, job_id),
        )
        if job_state == "succeeded":
            db.execute("UPDATE jobs SET pending_deps=pending_deps-1 WHERE job_id IN (SELECT job_id FROM job_deps WHERE needs_job_id=?)", (job_id,))
        if job_state in ("failed", "cancelled") and not failure:
            self._fail_graph_run(db, job_id, job_state, message, now)
        return job_state

    def _fail_graph_run(self, db, job_id: str, job_state: str, message: str, now: float) -> None:
        """A job of a graph run ended `job_state` (failed or cancelled): the run fails, naming it, and
        its queued jobs (the job's dependents among them) fail with that reason. Pipeline runs: nothing."""
        run_id, kind, index, count = db.execute("SELECT run_id, kind, shard_index, shard_count FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        if kind == "pipeline":
            return
        what = f"{kind} shard {index + 1}/{count}" if count > 1 else kind
        # The message is a provider's text and reaches the admin's terminal (`runs show`): no control characters.
        message = printable(message[:500])
        why = f"job `{job_id}` ({what}) {job_state}" + (f": {message}" if message else "")
        db.execute("UPDATE runs SET failure=? WHERE run_id=? AND failure=''", (why, run_id))
        why = db.execute("SELECT failure FROM runs WHERE run_id=?", (run_id,)).fetchone()[0]
        db.execute("UPDATE jobs SET state='failed', reason=?, updated_unix=? WHERE run_id=? AND state='queued'", (f"run failed: {why}", now, run_id))

    def expire_due(self) -> int:
        """Expire every live lease past its TTL; their jobs are requeued (or failed/cancelled). Returns the count."""
        now = self.clock()
        due = self.db.execute("SELECT attempt_id, job_id FROM attempts WHERE state='live' AND lease_expires_unix < ?", (now,)).fetchall()
        if not due:
            return 0
        requeued = False
        with self._tx() as db:
            for attempt_id, job_id in due:
                state = self._end_attempt(db, attempt_id, job_id, "expired", "lease expired without a heartbeat", now)
                requeued |= state == "queued"
        if requeued:
            self.on_work()
        return len(due)

    def _live(self, provider_id: str, lease_id: str) -> tuple:
        """Return (attempt_id, job_id, run_id, cancel, checkpoint) for a live lease, or raise ABORTED."""
        if not lease_id:
            raise InvalidRequestError("`lease_id` is empty")
        r = self.db.execute(
            "SELECT a.attempt_id, a.job_id, j.run_id, a.provider_id, a.state, a.lease_expires_unix, j.current_attempt_id,"
            " j.cancel_requested, j.checkpoint_requested FROM attempts a JOIN jobs j ON j.job_id=a.job_id WHERE a.lease_id=?",
            (lease_id[:200],),
        ).fetchone()
        if r is None:
            raise StaleLeaseError(f"lease `{lease_id[:80]}` is unknown; stop this attempt")
        attempt_id, job_id, run_id, owner, state, expires, current, cancel, checkpoint = r
        if owner != provider_id:
            raise PermissionDeniedError(f"lease `{lease_id}` belongs to another provider")
        if state == "live" and expires < self.clock():
            self.expire_due()
            state = "expired"
        if state != "live" or current != attempt_id:
            raise StaleLeaseError(f"lease `{lease_id}` is no longer live (attempt {state}); stop this attempt")
        return attempt_id, job_id, run_id, cancel, checkpoint

    def live_lease(self, provider_id: str, lease_id: str) -> LiveLease:
        attempt_id, job_id, run_id, _, _ = self._live(provider_id, lease_id)
        return LiveLease(attempt_id=attempt_id, job_id=job_id, run_id=run_id)

    def heartbeat(self, provider_id: str, lease_id: str, progress: Progress) -> tuple[str, float]:
        """Renew a live lease and record progress; return `(directive, lease_expires_unix)`.

        Directive is "cancel" while a cancel is pending, "checkpoint" once
        after a checkpoint request, else "continue".
        """
        attempt_id, job_id, _, cancel, checkpoint = self._live(provider_id, lease_id)
        now = self.clock()
        expires = now + self.lease_ttl
        # The hot path (every heartbeat of every provider): one statement in
        # autocommit mode is its own transaction; no BEGIN/COMMIT round trips.
        self.counts["heartbeats"] += 1
        # SET sees the row's old values: the phase clock restarts when the phase changes
        # (the first heartbeat of an attempt starts it too), without a read first.
        self.db.execute(
            "UPDATE attempts SET lease_expires_unix=?,"
            " phase_started_unix=CASE WHEN phase_started_unix IS NULL OR phase!=? THEN ? ELSE phase_started_unix END,"
            " phase_started_step=CASE WHEN phase_started_unix IS NULL OR phase!=? THEN ? ELSE phase_started_step END,"
            " phase=?, step=?, total_steps=?, committed_step=?, metrics_json=?, last_heartbeat_unix=? WHERE attempt_id=?",
            (
                expires,
                progress.phase,
                now,
                progress.phase,
                progress.step,
                progress.phase,
                progress.step,
                progress.total_steps,
                progress.committed_step,
                json.dumps(progress.metrics),
                now,
                attempt_id,
            ),
        )
        if checkpoint and not cancel:
            self.db.execute("UPDATE jobs SET checkpoint_requested=0 WHERE job_id=?", (job_id,))
        if cancel:
            return "cancel", expires
        return ("checkpoint" if checkpoint else "continue"), expires

    def finish(self, provider_id: str, lease_id: str, outcome: str, message: str) -> str:
        """End the attempt behind a live lease with `outcome`; return the job's new state."""
        attempt_id, job_id, _, _, _ = self._live(provider_id, lease_id)
        with self._tx() as db:
            state = self._end_attempt(db, attempt_id, job_id, outcome, message, self.clock())
        if state == "queued" or (state == "succeeded" and self._readied_by(job_id)):
            self.on_work()  # long-polling providers wake for the requeued job, or the jobs this success made ready
        return state

    def _readied_by(self, job_id: str) -> bool:
        """Whether a queued job needing `job_id` has no unmet need left (a graph's next jobs, once it succeeded)."""
        return (
            self.db.execute(
                "SELECT 1 FROM job_deps d JOIN jobs j ON j.job_id=d.job_id WHERE d.needs_job_id=? AND j.state='queued' AND j.pending_deps=0 LIMIT 1",
                (job_id,),
            ).fetchone()
            is not None
        )

    # --- artifacts ------------------------------------------------------

    @staticmethod
    def _record(r) -> ArtifactRecord:
        name, kind, sha, size, step, run_id, job_id, attempt = r
        return ArtifactRecord(name=name, kind=kind, sha256=sha, size_bytes=size, uri=artifact_uri(run_id, job_id, attempt, name), step=step)

    def recorded(self, attempt_id: str, claim: Claim) -> ArtifactRecord | None:
        """This attempt's record of `claim.name` if it has the same sha256; ALREADY_EXISTS if it differs; None if absent."""
        r = self.db.execute(f"SELECT {_REC_COLS} FROM records WHERE attempt_id=? AND name=?", (attempt_id, claim.name)).fetchone()
        if r is None:
            return None
        if r[2] != claim.sha256:
            raise ConflictError(
                f"artifact `{claim.name}` was already uploaded by this attempt with sha256 `{r[2]}`; this upload has `{claim.sha256}`\n"
                "hint: artifacts are immutable; upload new bytes under a new name"
            )
        return self._record(r)

    def check_quota(self, lease: LiveLease, claim: Claim, *, pending_bytes: int = 0, pending_records: int = 0) -> None:
        """RESOURCE_EXHAUSTED, naming the limit, if recording `claim` (plus uploads in flight) would pass a quota."""
        q = self.quotas
        for scope, column, key, max_records, max_bytes in (
            ("attempt", "attempt_id", lease.attempt_id, q.attempt_records, q.attempt_bytes),
            ("run", "run_id", lease.run_id, q.run_records, q.run_bytes),
        ):
            n, b = self.db.execute(f"SELECT COUNT(*), COALESCE(SUM(size_bytes), 0) FROM records WHERE {column}=?", (key,)).fetchone()
            if n + pending_records + 1 > max_records:
                raise QuotaError(
                    f"artifact `{claim.name}`: this {scope} already has {n} artifact records (+{pending_records} uploading); "
                    f"the {scope} quota is {max_records} records\nhint: the run admin sets it with `serve --quota-{scope}-records`"
                )
            if b + pending_bytes + claim.size_bytes > max_bytes:
                raise QuotaError(
                    f"artifact `{claim.name}` ({claim.size_bytes} bytes): this {scope} already stores {b} bytes (+{pending_bytes} uploading); "
                    f"the {scope} quota is {max_bytes} bytes\nhint: the run admin sets it with `serve --quota-{scope}-bytes`"
                )

    def check_name_free(self, attempt_id: str, name: str) -> None:
        """INVALID_ARGUMENT if `name` and one of this attempt's names cannot both be paths (`a` and `a/b`)."""
        parts = name.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts))]
        r = self.db.execute(
            f"SELECT name FROM records WHERE attempt_id=? AND (substr(name, 1, ?) = ? OR name IN ({','.join('?' * len(prefixes)) or 'NULL'})) LIMIT 1",
            (attempt_id, len(name) + 1, name + "/", *prefixes),
        ).fetchone()
        if r is not None and name_conflict(name, r[0]):
            raise InvalidRequestError(
                f"artifact `{name}` and this attempt's artifact `{r[0]}` cannot both be files: one names the other's directory"
            )

    def missing_checkpoint_file(self, attempt_id: str, manifest_name: str, files: dict[str, tuple[str, int]]) -> str | None:
        """The first file a checkpoint manifest lists that this attempt has not uploaded with that sha256 and size."""
        base = checkpoint_dir(manifest_name)
        for fname, (sha, size) in sorted(files.items()):
            name = f"{base}/{fname}" if base else fname
            r = self.db.execute("SELECT sha256, size_bytes FROM records WHERE attempt_id=? AND name=?", (attempt_id, name)).fetchone()
            if r is None or tuple(r) != (sha, size):
                return name
        return None

    def record(self, lease: LiveLease, claim: Claim) -> ArtifactRecord:
        """Record an uploaded (verified, stored) blob for the lease's attempt; idempotent on name + sha256."""
        existing = self.recorded(lease.attempt_id, claim)
        if existing is not None:
            return existing
        self.check_name_free(lease.attempt_id, claim.name)
        self.check_quota(lease, claim)
        now = self.clock()
        with self._tx() as db:
            number = db.execute("SELECT number FROM attempts WHERE attempt_id=?", (lease.attempt_id,)).fetchone()[0]
            db.execute(
                "INSERT INTO records(run_id, job_id, attempt_id, attempt, name, kind, sha256, size_bytes, step, created_unix)"
                " VALUES (?,?,?,?,?,?,?,?,?,?)",
                (lease.run_id, lease.job_id, lease.attempt_id, number, claim.name, claim.kind, claim.sha256, claim.size_bytes, claim.step, now),
            )
            self.garbage.discard(claim.sha256)
            if claim.kind == "checkpoint":
                self._rotate_checkpoints(db, lease.job_id)
        return ArtifactRecord(
            name=claim.name,
            kind=claim.kind,
            sha256=claim.sha256,
            size_bytes=claim.size_bytes,
            uri=artifact_uri(lease.run_id, lease.job_id, number, claim.name),
            step=claim.step,
        )

    def _forget(self, db, rows: list[tuple[int, str]]) -> None:
        """Delete records by seq; their blobs become garbage unless another record keeps them."""
        for seq, _ in rows:
            db.execute("DELETE FROM records WHERE seq=?", (seq,))
        for _, sha in rows:
            if db.execute("SELECT 1 FROM records WHERE sha256=? LIMIT 1", (sha,)).fetchone() is None:
                self.garbage.add(sha)

    def _rotate_checkpoints(self, db, job_id: str) -> None:
        """Keep the job's newest `keep_checkpoints` checkpoints; drop older manifests and the files they list."""
        old = db.execute(
            "SELECT seq, attempt_id, name FROM records WHERE job_id=? AND kind='checkpoint' ORDER BY step DESC, seq DESC LIMIT -1 OFFSET ?",
            (job_id, self.keep_checkpoints),
        ).fetchall()
        for seq, attempt_id, name in old:
            base = checkpoint_dir(name)
            rows = db.execute(
                "SELECT seq, sha256 FROM records WHERE attempt_id=? AND (seq=? OR (kind='checkpoint_file' AND substr(name, 1, ?) = ?))",
                (attempt_id, seq, len(base) + 1, base + "/"),
            ).fetchall()
            self._forget(db, rows)

    def _drop_loose_checkpoint_files(self, db, attempt_id: str) -> None:
        """At an attempt's end: its checkpoint files that no committed manifest of it lists go."""
        rows = db.execute(
            "SELECT f.seq, f.sha256 FROM records f WHERE f.attempt_id=? AND f.kind='checkpoint_file' AND NOT EXISTS ("
            " SELECT 1 FROM records m WHERE m.attempt_id=f.attempt_id AND m.kind='checkpoint'"
            " AND substr(f.name, 1, length(m.name) - length('manifest.json')) = substr(m.name, 1, length(m.name) - length('manifest.json')))",
            (attempt_id,),
        ).fetchall()
        self._forget(db, rows)

    def referenced(self, sha256: str) -> bool:
        return self.db.execute("SELECT 1 FROM records WHERE sha256=? LIMIT 1", (sha256,)).fetchone() is not None

    def take_garbage(self) -> list[str]:
        """Blobs no record refers to now (the caller deletes them); the set is emptied."""
        out = [sha for sha in self.garbage if not self.referenced(sha)]
        self.garbage.clear()
        return out

    def live_attempt_ids(self) -> set[str]:
        return {a for (a,) in self.db.execute("SELECT attempt_id FROM attempts WHERE state='live'")}

    def _succeeded_attempt(self, job_id: str) -> tuple[str, int] | None:
        r = self.db.execute("SELECT attempt_id, number FROM attempts WHERE job_id=? AND state='succeeded' ORDER BY number DESC LIMIT 1", (job_id,)).fetchone()
        return None if r is None else (r[0], r[1])

    def job_of(self, run_id: str, job_id: str) -> str:
        """The job an admin names: `job_id` in `run_id`; when `job_id` is empty, the run's only job, or a job
        graph's train job (whose export is the run's result)."""
        self.get_run(run_id)
        if job_id:
            if self.db.execute("SELECT 1 FROM jobs WHERE job_id=? AND run_id=?", (job_id, run_id)).fetchone() is None:
                raise NotFoundError(f"run `{run_id}` has no job `{job_id[:80]}`\nhint: `dflash-coordinator runs show {run_id}` lists its jobs")
            return job_id
        jobs = [j for (j,) in self.db.execute("SELECT job_id FROM jobs WHERE run_id=? ORDER BY seq LIMIT 2", (run_id,))]
        # A job graph's export (the run's result) is its train job's: that is the job a run names.
        train = self._graph_job(run_id, "train") if len(jobs) > 1 else None
        if train is not None:
            return train
        if len(jobs) != 1:
            raise InvalidRequestError(f"run `{run_id}` has several jobs; name one with `--job`\nhint: `dflash-coordinator runs show {run_id}` lists them")
        return jobs[0]

    def list_artifacts(self, job_id: str, *, all_attempts: bool, page_size: int = 0, page_token: str = "") -> tuple[list[StoredArtifact], str]:
        """A job's final artifacts (its SUCCEEDED attempt's) or every attempt's (newest attempt first); one page."""
        size, after = page(page_size, page_token)
        where, params = "r.job_id=?", [job_id]
        if not all_attempts:
            final = self._succeeded_attempt(job_id)
            if final is None:
                return [], ""
            where, params = "r.attempt_id=?", [final[0]]
        # Paged by seq; newest attempt first means ordering by (attempt DESC, seq), so the token holds a rank.
        rows = self.db.execute(
            f"SELECT r.seq, {', '.join('r.' + c.strip() for c in _REC_COLS.split(','))}, a.state, r.created_unix FROM records r"
            f" JOIN attempts a ON a.attempt_id=r.attempt_id WHERE {where} ORDER BY r.attempt DESC, r.seq LIMIT ? OFFSET ?",
            (*params, size + 1, after),
        ).fetchall()
        out = [StoredArtifact(job_id=job_id, attempt=r[8], attempt_state=r[9], record=self._record(r[1:9]), created_unix=r[10]) for r in rows[:size]]
        return out, (f"s{after + size}" if len(rows) > size else "")

    def find_record(self, job_id: str, name: str, sha256: str = "", *, final_only: bool = False) -> ArtifactRecord:
        """A job's record of `name` (with `sha256`, any attempt's; else the SUCCEEDED attempt's); NOT_FOUND otherwise.

        The message is the same whether the name, the digest or the attempt is
        what is missing, so a caller learns nothing about records it cannot fetch.
        """
        if sha256 and not final_only:
            r = self.db.execute(
                f"SELECT {_REC_COLS} FROM records WHERE job_id=? AND name=? AND sha256=? ORDER BY seq DESC LIMIT 1", (job_id, name, sha256)
            ).fetchone()
        else:
            final = self._succeeded_attempt(job_id)
            r = None
            if final is not None:
                r = self.db.execute(
                    f"SELECT {_REC_COLS} FROM records WHERE attempt_id=? AND name=?" + (" AND sha256=?" if sha256 else ""),
                    (final[0], name, *((sha256,) if sha256 else ())),
                ).fetchone()
        if r is None:
            raise NotFoundError(f"job `{job_id}` has no artifact `{name[:200]}`" + (f" with sha256 `{sha256}`" if sha256 else " from a succeeded attempt"))
        return self._record(r)

    # --- the regression gate (publication of exports) --------------------

    def has_final_export(self, job_id: str) -> bool:
        final = self._succeeded_attempt(job_id)
        return final is not None and self.db.execute("SELECT 1 FROM records WHERE attempt_id=? AND kind='export' LIMIT 1", (final[0],)).fetchone() is not None

    def _graph_job(self, run_id: str, kind: str, shard_index: int = 0) -> str | None:
        r = self.db.execute("SELECT job_id FROM jobs WHERE run_id=? AND kind=? AND shard_index=? ORDER BY seq LIMIT 1", (run_id, kind, shard_index)).fetchone()
        return None if r is None else r[0]

    def gated_job(self, job_id: str) -> str:
        """The job whose export a success of `job_id` lets the gate decide on: in a job graph, evaluate
        shard 0's success decides on the train job's export (shard 0 uploads the run's one report)."""
        r = self.db.execute("SELECT run_id, kind, shard_index FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        if r is not None and r[1] == "evaluate" and r[2] == 0:
            return self._graph_job(r[0], "train") or job_id
        return job_id

    def pending_gate(self, job_id: str) -> str:
        """Why the gate has not decided on `job_id`'s export yet, when it waits for its run's evaluate job; "" otherwise."""
        r = self.db.execute("SELECT j.run_id, j.kind, r.failure FROM jobs j JOIN runs r ON r.run_id=j.run_id WHERE j.job_id=?", (job_id,)).fetchone()
        if r is None or r[1] != "train" or r[2]:
            return ""
        ev = self._graph_job(r[0], "evaluate")
        if ev is None or self._succeeded_attempt(ev) is not None:
            return ""
        return f"it waits for the run's evaluate job `{ev}` (shard 0), whose report the regression gate decides on"

    def gate_inputs(self, job_id: str, report_name: str) -> GateInputs | None:
        """What the gate needs to decide on a succeeded job with an export; None when there is nothing to decide yet.

        A pipeline job's report is its own attempt's. A job graph's export comes from its train job
        and its report from evaluate shard 0: the decision waits (None) until that job succeeds, and
        is taken without a report once the run has failed instead.
        """
        final = self._succeeded_attempt(job_id)
        if final is None or not self.has_final_export(job_id):
            return None
        run_id, kind, failure = self.db.execute(
            "SELECT j.run_id, j.kind, r.failure FROM jobs j JOIN runs r ON r.run_id=j.run_id WHERE j.job_id=?", (job_id,)
        ).fetchone()
        report_attempt, no_report = final[0], ""
        ev = self._graph_job(run_id, "evaluate") if kind == "train" else None
        if ev is not None:
            ev_final = self._succeeded_attempt(ev)
            if ev_final is not None:
                report_attempt = ev_final[0]
                no_report = f"the run's evaluate job `{ev}` (shard 0) succeeded without an evaluation report (`{report_name}`)"
            elif failure:
                report_attempt, no_report = None, f"no evaluation report: {printable(failure)}"
            else:
                return None
        r = None
        if report_attempt is not None:
            r = self.db.execute(f"SELECT {_REC_COLS} FROM records WHERE attempt_id=? AND name=? AND kind='report'", (report_attempt, report_name)).fetchone()
        return GateInputs(
            job_id=job_id, run_id=run_id, attempt_id=final[0], spec_json=self._spec_json(run_id), report=None if r is None else self._record(r), no_report=no_report
        )  # fmt: skip

    def undecided_jobs(self) -> list[str]:
        """Succeeded jobs whose export the gate has not decided on (a coordinator stopped between the two)."""
        return [
            j
            for (j,) in self.db.execute(
                "SELECT j.job_id FROM jobs j JOIN attempts a ON a.job_id=j.job_id AND a.state='succeeded'"
                " WHERE j.state='succeeded' AND NOT EXISTS (SELECT 1 FROM publications p WHERE p.job_id=j.job_id)"
                " AND EXISTS (SELECT 1 FROM records r WHERE r.attempt_id=a.attempt_id AND r.kind='export') ORDER BY j.seq"
            )
        ]

    def record_publication(self, inputs: GateInputs, *, published: bool, verdict: str, reason: str, evaluation: dict) -> PublicationRow:
        """Store the gate's decision (once per job: a later call keeps the first, and any override)."""
        with self._tx() as db:
            db.execute(
                "INSERT OR IGNORE INTO publications(job_id, run_id, attempt_id, published, verdict, reason, evaluation_json, decided_unix)"
                " VALUES (?,?,?,?,?,?,?,?)",
                (inputs.job_id, inputs.run_id, inputs.attempt_id, int(published), verdict, reason[:4000], json.dumps(evaluation), self.clock()),
            )
        return self.publication(inputs.job_id)

    def publish_override(self, job_id: str, *, override: bool, note: str, peer: str) -> PublicationRow:
        """Publish a job's export the gate held back; recorded with when, the admin's note and address.

        FAILED_PRECONDITION without `override`, for a job without an export, or before the gate decided.
        Publishing a published export changes nothing.
        """
        pub = self.publication(job_id)
        if pub is None:
            if not self.has_final_export(job_id):
                raise PolicyError(f"job `{job_id}` has no export from a succeeded attempt; there is nothing to publish")
            pending = self.pending_gate(job_id)
            if pending:
                raise PolicyError(
                    f"the regression gate has not decided on job `{job_id}`'s export: {pending}\n"
                    "hint: `dflash-coordinator runs show RUN_ID` shows what that job waits for; publish once it has succeeded (or the run failed)"
                )
            raise PolicyError(f"the regression gate has not decided on job `{job_id}` yet\nhint: retry in a few seconds")
        if pub.published:
            return pub
        if not override:
            raise PolicyError(
                f"job `{job_id}`'s export was held back by the regression gate: {pub.reason}\n"
                "hint: `--override` publishes it anyway; the override is recorded"
            )
        if len(note) > 1000:
            raise InvalidRequestError("`note` is longer than 1000 characters")
        with self._tx() as db:
            db.execute(
                "UPDATE publications SET published=1, override_unix=?, override_note=?, override_peer=? WHERE job_id=?",
                (self.clock(), note, peer[:200], job_id),
            )
        return self.publication(job_id)

    def check_published(self, run_id: str, job_id: str) -> None:
        """FAILED_PRECONDITION unless the job's export is published (the default download of an export)."""
        pub = self.publication(job_id)
        if pub is not None and pub.published:
            return
        pending = self.pending_gate(job_id) if pub is None else ""
        if pending:
            raise PolicyError(
                f"run `{run_id}`'s export (job `{job_id}`) is not published yet: {pending}\n"
                f"hint: `dflash-coordinator runs show {run_id}` shows what that job waits for"
            )
        why = pub.reason if pub is not None else "the regression gate has not decided on it yet"
        raise PolicyError(
            f"run `{run_id}`'s export (job `{job_id}`) is not published: {why}\n"
            f"hint: `dflash-coordinator runs publish {run_id} --override` publishes it anyway (the override is recorded)"
        )

    # --- admin directives -----------------------------------------------

    def _job(self, job_id: str) -> tuple[str, str | None]:
        r = self.db.execute("SELECT state, current_attempt_id FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        if r is None:
            raise NotFoundError(f"no job `{job_id}`\nhint: `dflash-coordinator runs show RUN_ID` lists a run's jobs")
        return r

    def cancel_job(self, job_id: str) -> str:
        """Cancel a queued job now, or ask its live attempt to stop; returns the job state."""
        self.expire_due()
        state, current = self._job(job_id)
        if state in FINAL_JOB_STATES or state == "cancelling":
            return state
        with self._tx() as db:
            if current is None:
                db.execute("UPDATE jobs SET state='cancelled', cancel_requested=1, updated_unix=? WHERE job_id=?", (self.clock(), job_id))
                self._fail_graph_run(db, job_id, "cancelled", "cancelled by an admin", self.clock())
                return "cancelled"
            db.execute("UPDATE jobs SET state='cancelling', cancel_requested=1, updated_unix=? WHERE job_id=?", (self.clock(), job_id))
            return "cancelling"

    def request_checkpoint(self, job_id: str) -> str:
        """Ask the job's live attempt to checkpoint on its next heartbeat; returns the job state."""
        self.expire_due()
        state, current = self._job(job_id)
        if current is None or state != "leased":
            raise PolicyError(f"job `{job_id}` is `{state}`; only a leased job can be asked to checkpoint")
        with self._tx() as db:
            db.execute("UPDATE jobs SET checkpoint_requested=1 WHERE job_id=?", (job_id,))
        return state
