"""Verification by replay: a `verify` job recomputes a capture job's shards on another provider.

Capture is byte-reproducible on one kind of device: the same prepared data, recipe and shard give
the same shard and sidecar bytes. A graph run whose spec JSON names a ``verify_fraction`` gets a
``verify`` job for that share of its capture jobs (`spec.RunSpecData.verified_shards`), needing
prepare and the capture job, and needed by train. It is leased only to a provider other than the
one whose attempt produced the capture, on the same backend (`leases._VERIFIER`); it uploads what
it recomputed under ``verify/`` + the producer's name (`policy.VERIFY_PREFIX`), so the coordinator
compares digests it computed itself from the bytes it received (`judge`).

When the verify attempt ends SUCCEEDED:

- every producer record has its recomputation with the same sha256: the verify job succeeds and
  train may start;
- none differs but one is missing: the verify attempt did not do its work; it ends ``retryable``;
- one differs (or the verifier recomputed a shard the producer never uploaded): a mismatch. The
  producer's attempt becomes ``discarded`` (its records are no longer the job's result nor anyone's
  input), the capture job is queued again, the jobs needing it wait for it again (the verify job
  among them: the new capture is verified too), and the producer is quarantined (`quarantine`):
  it is leased nothing more, its live attempts end ``quarantined``, and its other succeeded
  capture attempts whose results no job has used yet are discarded and redone likewise.

A lying verifier can get an honest producer quarantined; the producer's work is then redone by a
third provider and verified again, and an admin sees both providers in the quarantine's reason.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

from ..policy import VERIFY_PREFIX
from .db import printable

# Names a mismatch's reason lists at most.
MAX_NAMED = 3


@dataclass(frozen=True, kw_only=True)
class Judgement:
    """What a verify attempt's uploads say about the capture attempt it recomputed."""

    capture_job_id: str = ""
    producer_attempt_id: str = ""
    producer_id: str = ""
    # Producer names with no recomputation (the verifier's failure), and names whose digests differ.
    missing: tuple[str, ...] = ()
    differ: tuple[str, ...] = ()

    @property
    def mismatch(self) -> bool:
        return bool(self.differ)


def judge(db: sqlite3.Connection, attempt_id: str, job_id: str) -> Judgement:
    """Compare verify attempt `attempt_id` (of verify job `job_id`) with the capture attempt it recomputed."""
    r = db.execute(
        "SELECT c.job_id, a.attempt_id, a.provider_id FROM job_deps d JOIN jobs c ON c.job_id=d.needs_job_id AND c.kind='capture'"
        " JOIN attempts a ON a.job_id=c.job_id AND a.state='succeeded' WHERE d.job_id=? LIMIT 1",
        (job_id,),
    ).fetchone()
    if r is None:  # nothing to compare with (an edited database): nothing is judged
        return Judgement()
    capture_job_id, producer_attempt_id, producer_id = r
    theirs = dict(db.execute("SELECT name, sha256 FROM records WHERE attempt_id=? AND kind='capture'", (producer_attempt_id,)).fetchall())
    ours = {
        name[len(VERIFY_PREFIX) :]: sha
        for name, sha in db.execute("SELECT name, sha256 FROM records WHERE attempt_id=? AND substr(name, 1, ?)=?", (attempt_id, len(VERIFY_PREFIX), VERIFY_PREFIX))
    }
    missing = tuple(sorted(n for n in theirs if n not in ours))
    differ = tuple(sorted(n for n in ours if theirs.get(n) != ours[n]))
    return Judgement(capture_job_id=capture_job_id, producer_attempt_id=producer_attempt_id, producer_id=producer_id, missing=missing, differ=differ)


def describe(j: Judgement, *, verify_job_id: str, attempt_id: str) -> str:
    """The reason a mismatch gives (quarantine, discarded attempt, requeued job): no control characters."""
    named = ", ".join(f"`{printable(n[:200])}`" for n in j.differ[:MAX_NAMED]) + (f" and {len(j.differ) - MAX_NAMED} more" if len(j.differ) > MAX_NAMED else "")
    return (
        f"verify job `{verify_job_id}` (attempt `{attempt_id}`) recomputed capture job `{j.capture_job_id}` and got other bytes for {named}"
        f" than attempt `{j.producer_attempt_id}` of provider `{j.producer_id}` uploaded"
    )


def discard(db: sqlite3.Connection, attempt_id: str, job_id: str, reason: str, now: float) -> None:
    """Capture attempt `attempt_id` no longer counts: its job is queued again, and the jobs needing it wait for it again."""
    db.execute("UPDATE attempts SET state='discarded', message=? WHERE attempt_id=?", (f"discarded: {reason}"[:4000], attempt_id))
    db.execute(
        "UPDATE jobs SET state='queued', current_attempt_id=NULL, reason=?, updated_unix=? WHERE job_id=? AND state='succeeded'",
        (f"requeued: {reason}"[:4000], now, job_id),
    )
    db.execute(
        "UPDATE jobs SET pending_deps=pending_deps+1 WHERE job_id IN (SELECT job_id FROM job_deps WHERE needs_job_id=?)"
        " AND state NOT IN ('succeeded', 'failed', 'cancelled')",
        (job_id,),
    )


def quarantine(db: sqlite3.Connection, provider_id: str, reason: str, now: float) -> tuple[list, list]:
    """Quarantine `provider_id` (the first reason is kept). Returns its live attempts `(attempt_id, job_id)`, to end,
    and its other succeeded capture attempts that no job has used yet (every job needing them, verify jobs aside,
    is still queued, and their runs have not failed), to discard."""
    db.execute(
        "UPDATE providers SET quarantined_unix=?, quarantine_reason=? WHERE provider_id=? AND quarantined_unix IS NULL", (now, reason[:4000], provider_id)
    )
    live = db.execute("SELECT attempt_id, job_id FROM attempts WHERE provider_id=? AND state='live'", (provider_id,)).fetchall()
    others = db.execute(
        "SELECT a.attempt_id, a.job_id FROM attempts a JOIN jobs j ON j.job_id=a.job_id JOIN runs r ON r.run_id=j.run_id"
        " WHERE a.provider_id=? AND a.state='succeeded' AND j.kind='capture' AND r.failure='' AND NOT EXISTS"
        " (SELECT 1 FROM job_deps d JOIN jobs n ON n.job_id=d.job_id WHERE d.needs_job_id=a.job_id AND n.kind!='verify' AND n.state!='queued')",
        (provider_id,),
    ).fetchall()
    return live, others
