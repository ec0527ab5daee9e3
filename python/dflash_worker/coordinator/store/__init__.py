"""Coordinator state in SQLite: runs, providers, jobs, attempts (leases), artifacts, publications.

One process owns the database and uses one connection; every part below reads on it and writes
through its one transaction helper (`db`). `Store` owns the connection and the parts:

- `schema`: the tables and the migrations of an older database; `db`: the connection, the
  transaction helper and the helpers every part shares (pages, ids, printable text);
- `credentials`: bearer tokens and whose they are (admin, viewer, providers; rotation, revocation);
- `providers`: what each provider registered, and which are live; `audit`: what changed a
  provider's standing (quarantines, and an admin lifting one);
- `spec` and `runs`: a run's validated specification and job graph; runs and their jobs;
- `jobs`: how jobs and attempts change state (attempts ending, expiry, graph failure, directives);
- `leases`: granting, renewing and ending leases;
- `records`: artifact records, quotas and checkpoint rotation;
- `publications`: the regression gate's decisions; `reader`: what the status page reads.
"""

from .audit import AuditRow
from .credentials import DEFAULT_ROTATE_GRACE_SECONDS, MAX_ROTATE_GRACE_SECONDS, Principal, hash_token, new_token
from .db import Database, ServeLock, next_token, page, printable
from .facade import Store
from .jobs import FINAL_JOB_STATES
from .leases import MAX_LEASE_INPUT_BYTES, MAX_LEASE_INPUTS, Grant, Progress, Upgrade
from .providers import ProviderRow, Registration
from .publications import GateInputs
from .reader import PublicationRow, StoreReader
from .records import LiveLease, Quotas, StoredArtifact
from .runs import JobRow, RunRow
from .schema import PRE_GATE_REASON, SCHEMA_VERSION
from .spec import JOB_KINDS, MAX_JOBS_PER_RUN, MAX_SHARDS, RunSpecData, parse_spec_json

__all__ = [
    "AuditRow",
    "DEFAULT_ROTATE_GRACE_SECONDS",
    "FINAL_JOB_STATES",
    "JOB_KINDS",
    "MAX_JOBS_PER_RUN",
    "MAX_LEASE_INPUTS",
    "MAX_LEASE_INPUT_BYTES",
    "MAX_ROTATE_GRACE_SECONDS",
    "MAX_SHARDS",
    "PRE_GATE_REASON",
    "SCHEMA_VERSION",
    "Database",
    "GateInputs",
    "Grant",
    "JobRow",
    "LiveLease",
    "Principal",
    "Progress",
    "ProviderRow",
    "PublicationRow",
    "Quotas",
    "Registration",
    "RunRow",
    "RunSpecData",
    "ServeLock",
    "Store",
    "StoreReader",
    "StoredArtifact",
    "Upgrade",
    "hash_token",
    "new_token",
    "next_token",
    "page",
    "parse_spec_json",
    "printable",
]
