"""Provenance of what an attempt is handed, and the trust rule that decides what it may be handed.

A lease names a resume checkpoint and inputs (`leases.Grant`). Each is a record some attempt
uploaded; the coordinator hashed the bytes, but only the provider that sent them vouches for
what they mean. A job's earlier attempts never succeeded, so their checkpoints and capture shards
are handed to a new attempt only as the run's ``trust_inputs`` policy allows (`trust_filter`,
`policy.TRUST_INPUTS`); the outputs of the jobs it needs (their SUCCEEDED attempts') always are.

What a lease names is written to ``attempt_inputs`` with the attempt that produced each record
(`record_inputs`), in the lease's transaction. `sources` reads it back for a job's result: the
attempts whose artifacts reached it, directly or through the attempts that produced those, each
with its provider and its state (``runs show``'s ``provenance``).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

from ..artifacts.names import ArtifactRecord
from ..policy import TRUST_INPUTS

# Producer groups `sources` returns for one job at most (untrusted ones first): a train job of a
# 1,024-shard graph has about a thousand, so a GetRun page stays far inside the message limit.
MAX_SOURCES = 2_000
# How far `sources` follows inputs back (prepare -> capture -> train -> evaluate is 3 deep).
MAX_DEPTH = 8


def trust_filter(policy: str, provider_id: str) -> tuple[str, tuple]:
    """An SQL condition on the producing attempt (alias ``a``) for an earlier attempt of the same job
    whose records a new attempt on `provider_id` may be handed under `policy`, and its parameters."""
    if policy not in TRUST_INPUTS:  # a value the store did not write (runs.trust_inputs is checked at creation)
        policy = "succeeded"
    # A discarded attempt (its provider was quarantined: `verify`) is never handed on, whatever the policy.
    if policy == "any":
        return "a.state NOT IN ('discarded', 'mismatch')", ()
    if policy == "own":
        return "(a.state='succeeded' OR (a.provider_id=? AND a.state NOT IN ('discarded', 'mismatch')))", (provider_id,)
    return "a.state='succeeded'", ()


@dataclass(frozen=True, kw_only=True)
class Handed:
    """A record a lease names, with the attempt that uploaded it."""

    record: ArtifactRecord
    producer_attempt_id: str


def record_inputs(db: sqlite3.Connection, attempt_id: str, *, resume: Handed | None, inputs: tuple[Handed, ...]) -> None:
    """Write what a new attempt is handed (inside the lease's transaction)."""
    rows = [("input", h) for h in inputs] + ([("resume", resume)] if resume is not None else [])
    db.executemany(
        "INSERT OR IGNORE INTO attempt_inputs(attempt_id, role, name, kind, sha256, producer_attempt_id) VALUES (?,?,?,?,?,?)",
        [(attempt_id, role, h.record.name, h.record.kind, h.record.sha256, h.producer_attempt_id) for role, h in rows],
    )


@dataclass(frozen=True, kw_only=True)
class InputSource:
    """One attempt whose artifacts reached a job's result."""

    # `resume` (a checkpoint to resume from) or `input` (a needed job's output, an earlier attempt's capture shards).
    role: str
    job_id: str
    attempt: int
    attempt_id: str
    provider_id: str
    # The provider's identity (its `providers create` name).
    provider: str
    # The producing attempt's state now: `succeeded`, `retryable`, `expired`, `revoked`, `failed`, ...
    attempt_state: str
    # Distinct artifact names it handed on.
    artifacts: int
    # 1: handed to the job's attempt itself; 2: to an attempt of depth 1; ...
    depth: int


def result_attempt(db: sqlite3.Connection, job_id: str) -> str | None:
    """The attempt a job's result is (to be) from: its SUCCEEDED one, else its newest."""
    r = db.execute("SELECT attempt_id FROM attempts WHERE job_id=? ORDER BY state='succeeded' DESC, number DESC LIMIT 1", (job_id,)).fetchone()
    return None if r is None else r[0]


def sources(db: sqlite3.Connection, attempt_id: str) -> list[InputSource]:
    """The attempts whose artifacts reached `attempt_id`, following `attempt_inputs` back through their
    producers; one entry per (role, producing attempt), those that did not succeed first."""
    rows = db.execute(
        "WITH RECURSIVE chain(attempt_id, depth) AS (SELECT ?, 0 UNION"
        " SELECT i.producer_attempt_id, c.depth + 1 FROM chain c JOIN attempt_inputs i ON i.attempt_id=c.attempt_id"
        "  WHERE c.depth < ? AND i.producer_attempt_id != c.attempt_id),"
        " consumers AS (SELECT attempt_id, MIN(depth) AS depth FROM chain GROUP BY attempt_id)"
        " SELECT i.role, a.job_id, a.number, a.attempt_id, a.provider_id, COALESCE(p.identity, ''), a.state,"
        "  COUNT(DISTINCT i.name), MIN(c.depth) + 1"
        " FROM consumers c JOIN attempt_inputs i ON i.attempt_id=c.attempt_id JOIN attempts a ON a.attempt_id=i.producer_attempt_id"
        " LEFT JOIN providers p ON p.provider_id=a.provider_id"
        " GROUP BY i.role, a.attempt_id ORDER BY a.state='succeeded', MIN(c.depth), a.job_id, a.number, i.role LIMIT ?",
        (attempt_id, MAX_DEPTH, MAX_SOURCES),
    ).fetchall()
    return [
        InputSource(
            role=role, job_id=job_id, attempt=number, attempt_id=aid, provider_id=pid, provider=identity,
            attempt_state=state, artifacts=count, depth=depth,
        )  # fmt: skip
        for role, job_id, number, aid, pid, identity, state, count, depth in rows
    ]
