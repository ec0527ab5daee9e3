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
- one differs (or the verifier recomputed a shard the producer never uploaded): a disagreement, which
  is settled, not believed (`settle`). The verify attempt ends ``disputed`` and the verify job is
  queued again, leasable only to a provider that is neither the producer nor any disputing verifier,
  on the same backend (`leases._VERIFIER`): a tie-break replaying the same unit. Until it reports,
  nobody is quarantined and the producer's result is not handed on (the verify job has not
  succeeded, and train needs it); with no such provider the job waits and `runs show` says why
  (`tie_break_wait`). Two that agree stand, whoever disagrees with them is quarantined:

  - the tie-breaker recomputed the producer's bytes: the verify job succeeds; each disputing attempt
    ends ``overruled`` and its provider is quarantined (a lying verifier);
  - it recomputed the same bytes as a disputing attempt: a mismatch. Both attempts end ``mismatch``;
    the producer's attempt becomes ``discarded`` (its records are no longer the job's result nor
    anyone's input), the capture job is queued again, the jobs needing it wait for it again (the
    verify job among them: the new capture is verified too), and the producer is quarantined
    (`quarantine`); a disputing attempt that agreed with neither is overruled as above;
  - it agreed with nobody: it is ``disputed`` too, and one more provider is asked.

A quarantined provider is leased nothing more, its live attempts end ``quarantined``, and its other
succeeded capture, train and verify attempts whose results no job has used yet are discarded and
redone likewise. An admin lifts a quarantine with `providers unquarantine` (`providers`, audited).

Training is replayed the same way (training is bit-reproducible on one kind of device and resumes
exactly). A run with a ``verify_fraction`` also gets one verify job that needs prepare, every capture
job and train, and that every evaluate job needs, so nothing reads the train job's export before it
is checked. Its target is the train job (`target`); the producer's export derives from the checkpoint
of step T, the step of its ``run/selection.json`` record. The lease hands it the producer's checkpoint
of step S as its resume checkpoint (`replay_start`: the newest the coordinator still holds with
S <= T - ceil(fraction x T); step 0, the released draft, when there is none, and always at fraction 1),
so the replayed span always ends at the checkpoint the export derives from and covers at least that
share of its steps. The verifier trains from S to T (the full run's schedule), exports checkpoint T in
every format, and uploads the checkpoint's files and the exports under ``verify/``. The comparison
leaves out the files that record the job directory's paths (``manifest.json``, ``state.json``): the
weights, optimizer state and RNG state of checkpoint T and every export file else must be equal. A
mismatch discards the train attempt, requeues train (the evaluate jobs and the verify job wait for the
redo) and quarantines its provider, as for a capture, once the disagreement is settled.
"""

from __future__ import annotations

import math
import posixpath
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass

from ..policy import TRAIN_CHECKPOINTS, TRAIN_SELECTION, VERIFY_PREFIX
from . import audit
from .db import printable

# Names a mismatch's reason lists at most.
MAX_NAMED = 3
# Files of a checkpoint or an export that hold the job directory's paths (the resolved recipe, the
# provenance), so a replay in another directory writes other bytes: not compared.
PATH_BEARING = ("manifest.json", "state.json")


@dataclass(frozen=True, kw_only=True)
class Judgement:
    """What a verify attempt's uploads say about the capture or train attempt it recomputed."""

    target_kind: str = ""  # `capture` or `train`
    target_job_id: str = ""
    producer_attempt_id: str = ""
    producer_id: str = ""
    # Producer names with no recomputation (the verifier's failure), and names whose digests differ.
    missing: tuple[str, ...] = ()
    differ: tuple[str, ...] = ()
    # The producer's names a recomputation must have (those `missing` is drawn from).
    required: tuple[str, ...] = ()

    @property
    def mismatch(self) -> bool:
        return bool(self.differ)


def target(db: sqlite3.Connection, job_id: str) -> tuple[str, str] | None:
    """`(kind, job_id)` of the job verify job `job_id` checks: the train job it needs (a replay of training),
    else its capture job."""
    return db.execute(
        "SELECT c.kind, c.job_id FROM job_deps d JOIN jobs c ON c.job_id=d.needs_job_id WHERE d.job_id=? AND c.kind IN ('capture', 'train')"
        " ORDER BY c.kind='train' DESC LIMIT 1",
        (job_id,),
    ).fetchone()


def producer(db: sqlite3.Connection, job_id: str) -> tuple[str, str] | None:
    """`(attempt_id, provider_id)` of job `job_id`'s succeeded attempt."""
    return db.execute("SELECT attempt_id, provider_id FROM attempts WHERE job_id=? AND state='succeeded' LIMIT 1", (job_id,)).fetchone()


def _compared(name: str) -> bool:
    return posixpath.basename(name) not in PATH_BEARING


def selected_step(db: sqlite3.Connection, attempt_id: str) -> int | None:
    """The step whose checkpoint train attempt `attempt_id`'s export derives from: its `run/selection.json` record's step."""
    r = db.execute("SELECT step FROM records WHERE attempt_id=? AND name=? LIMIT 1", (attempt_id, TRAIN_SELECTION)).fetchone()
    return None if r is None else int(r[0])


def checkpoint_prefix(step: int) -> str:
    """Where a train job's checkpoint of `step` is recorded (`train.checkpoint.step_name` under the run directory)."""
    return f"{TRAIN_CHECKPOINTS}step-{step:08d}/"


def replay_start(target_step: int, checkpoints: Iterable[int], fraction: float) -> int:
    """The step a train replay starts from: the newest of `checkpoints` (the producer's, still held) at or
    before `target_step` - ceil(`fraction` x `target_step`) (at least one step back), else 0."""
    need = max(1, math.ceil(fraction * target_step - 1e-9))
    return max([0, *(c for c in checkpoints if c <= target_step - need)])


def judge(db: sqlite3.Connection, attempt_id: str, job_id: str) -> Judgement:
    """Compare verify attempt `attempt_id` (of verify job `job_id`) with the attempt it recomputed."""
    t = target(db, job_id)
    p = None if t is None else producer(db, t[1])
    if t is None or p is None:  # nothing to compare with (discarded meanwhile, or an edited database): nothing is judged
        return Judgement()
    (kind, target_job_id), (producer_attempt_id, producer_id) = t, p
    who = {"target_kind": kind, "target_job_id": target_job_id, "producer_attempt_id": producer_attempt_id, "producer_id": producer_id}
    ours = recomputed(db, attempt_id)
    if kind == "capture":
        theirs = dict(db.execute("SELECT name, sha256 FROM records WHERE attempt_id=? AND kind='capture'", (producer_attempt_id,)).fetchall())
        missing = tuple(sorted(n for n in theirs if n not in ours))
        differ = tuple(sorted(n for n in ours if theirs.get(n) != ours[n]))
        return Judgement(**who, missing=missing, differ=differ, required=tuple(sorted(theirs)))
    step = selected_step(db, producer_attempt_id)
    if step is None:  # a graph's train attempt always reports its selection: without one nothing can be replayed
        return Judgement(**who, differ=(TRAIN_SELECTION,))
    theirs = {
        n: sha
        for n, sha in db.execute("SELECT name, sha256 FROM records WHERE attempt_id=? AND kind IN ('checkpoint_file', 'export')", (producer_attempt_id,))
        if _compared(n)
    }
    # Checkpoints the coordinator rotated away on either side are not compared; the target's and the exports' must be.
    required = [n for n in theirs if n.startswith(checkpoint_prefix(step)) or not n.startswith(TRAIN_CHECKPOINTS)]
    missing = tuple(sorted(n for n in required if n not in ours))
    differ = tuple(sorted(n for n in ours if _compared(n) and n in theirs and theirs[n] != ours[n]))
    return Judgement(**who, missing=missing, differ=differ, required=tuple(sorted(required)))


def recomputed(db: sqlite3.Connection, attempt_id: str) -> dict[str, str]:
    """What verify attempt `attempt_id` uploaded under `verify/`: the producer's name -> sha256."""
    return {
        name[len(VERIFY_PREFIX) :]: sha
        for name, sha in db.execute("SELECT name, sha256 FROM records WHERE attempt_id=? AND substr(name, 1, ?)=?", (attempt_id, len(VERIFY_PREFIX), VERIFY_PREFIX))
    }


@dataclass(frozen=True, kw_only=True)
class Settlement:
    """How a verify attempt's verdict (`judge`) weighs against the verify job's open disagreement (`settle`)."""

    # `producer`: the producer's bytes stand; `verifiers`: two verifiers agree against it; `open`: no two agree yet.
    outcome: str
    # `(attempt_id, provider_id)` of disputing attempts that recomputed this attempt's bytes (outcome `verifiers`),
    # and of those outvoted (their providers are quarantined).
    agreeing: tuple[tuple[str, str], ...] = ()
    overruled: tuple[tuple[str, str], ...] = ()


def disputed(db: sqlite3.Connection, job_id: str) -> list[tuple[str, str]]:
    """`(attempt_id, provider_id)` of verify job `job_id`'s attempts whose disagreement is not settled yet."""
    return db.execute("SELECT attempt_id, provider_id FROM attempts WHERE job_id=? AND state='disputed' ORDER BY number", (job_id,)).fetchall()


def agree(db: sqlite3.Connection, a: Judgement, a_id: str, b: Judgement, b_id: str) -> bool:
    """Whether verify attempts `a_id` and `b_id` (judged `a`, `b` against the same producer attempt) recomputed the
    same bytes for every name that decides their verdicts: those the producer has to have, and those either differs on."""
    ours, theirs = recomputed(db, a_id), recomputed(db, b_id)
    return all(ours.get(n) == theirs.get(n) for n in {*a.required, *a.differ, *b.differ})


def settle(db: sqlite3.Connection, attempt_id: str, job_id: str, j: Judgement) -> Settlement:
    """Weigh verify attempt `attempt_id`'s verdict `j` (no recomputation missing, or a mismatch) against the verify
    job's disputing attempts of the same producer attempt: two that agree (the producer counts as one) stand."""
    open_ = disputed(db, job_id)
    if not j.mismatch:
        return Settlement(outcome="producer", overruled=tuple(open_))
    agreeing = tuple(d for d in open_ if agree(db, j, attempt_id, judge(db, d[0], job_id), d[0]))
    if not agreeing:
        return Settlement(outcome="open")
    return Settlement(outcome="verifiers", agreeing=agreeing, overruled=tuple(d for d in open_ if d not in agreeing))


def _named(names: tuple[str, ...]) -> str:
    return ", ".join(f"`{printable(n[:200])}`" for n in names[:MAX_NAMED]) + (f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else "")


def dispute_message(j: Judgement) -> str:
    """A disputing verify attempt's message: what it disagreed on, and that a tie-break settles it."""
    return (
        f"disputed: recomputed other bytes for {_named(j.differ)} than attempt `{j.producer_attempt_id}` of provider `{j.producer_id}` uploaded;"
        f" a provider on the same backend that is neither of them replays {j.target_kind} job `{j.target_job_id}` to settle it"
    )


def overruled_reason(j: Judgement, *, verify_job_id: str, attempt_id: str, by: tuple[str, str], producer_stands: bool) -> str:
    """Why a disputing verify attempt `attempt_id` (judged `j`) is outvoted by attempt `by` = `(attempt_id, provider_id)`,
    which recomputed the producer's bytes (`producer_stands`) or another disputing attempt's."""
    what = "the producer's bytes" if producer_stands else "the same bytes as another verifier, unlike both"
    return (
        f"verify job `{verify_job_id}` (attempt `{attempt_id}`) recomputed other bytes for {_named(j.differ)} of {j.target_kind} job `{j.target_job_id}`"
        f" than attempt `{j.producer_attempt_id}` of provider `{j.producer_id}` uploaded, and was outvoted: attempt `{by[0]}` of provider `{by[1]}`"
        f" recomputed {what}"
    )


def tie_break_wait(db: sqlite3.Connection, job_id: str, *, live_since: float) -> str:
    """Why verify job `job_id` waits when it has a disagreement to settle: whose, and which live providers (seen since
    `live_since`) could break the tie, or that none can; "" when it has none."""
    open_ = disputed(db, job_id)
    t = target(db, job_id) if open_ else None
    p = None if t is None else producer(db, t[1])
    if p is None:
        return ""
    (backend,) = db.execute("SELECT backend FROM providers WHERE provider_id=?", (p[1],)).fetchone()
    excluded = [p[1], *(d for _, d in open_)]
    fit = [
        printable(n[:80])
        for (n,) in db.execute(
            f"SELECT COALESCE(NULLIF(identity, ''), name) FROM providers WHERE backend=? AND provider_id NOT IN ({','.join('?' * len(excluded))})"
            " AND revoked_unix IS NULL AND quarantined_unix IS NULL AND registered_unix IS NOT NULL AND last_seen_unix >= ? ORDER BY last_seen_unix DESC LIMIT ?",
            (backend, *excluded, live_since, MAX_NAMED + 1),
        )
    ]
    who = ", ".join(f"attempt `{a}` of provider `{d}`" for a, d in open_)
    head = (
        f"waiting for a tie-break: {who} recomputed other bytes than attempt `{p[0]}` of provider `{p[1]}` uploaded; a provider on backend"
        f" `{printable(backend)}` that is none of them replays {t[0]} job `{t[1]}`, and until it does nobody is quarantined and the {t[0]} job's result is not handed on"
    )
    if not fit:
        return f"{head}: no live provider is one\nhint: start a provider on backend `{printable(backend)}` (a new one: `dflash-coordinator providers create NAME`)"
    return f"{head}: {', '.join(fit[:MAX_NAMED])}{' and more' if len(fit) > MAX_NAMED else ''} can; it is leased when one asks for work"


def replay_checkpoint(db: sqlite3.Connection, job_id: str, fraction: float) -> tuple[int, str] | None:
    """For verify job `job_id` replaying training at `fraction`: `(records.seq, attempt_id)` of the producer's
    checkpoint it starts from (`replay_start`); None for step 0, and for a verify job of a capture."""
    t = target(db, job_id)
    if t is None or t[0] != "train":
        return None
    p = producer(db, t[1])
    step = None if p is None else selected_step(db, p[0])
    if step is None:
        return None
    held = dict(
        db.execute(
            "SELECT step, MAX(seq) FROM records WHERE attempt_id=? AND kind='checkpoint' AND step < ? GROUP BY step", (p[0], step)
        ).fetchall()
    )
    start = replay_start(step, held, fraction)
    return None if start == 0 else (held[start], p[0])


def describe(j: Judgement, *, verify_job_id: str, attempt_id: str, verifier: str, seconded: tuple[tuple[str, str], ...] = ()) -> str:
    """The reason a mismatch gives (quarantine, discarded attempt, requeued job): verify attempt `attempt_id` of provider
    `verifier`, and the attempts `(attempt_id, provider_id)` that recomputed the same bytes (`settle`); no control characters."""
    also = "".join(f"; attempt `{a}` of provider `{d}` recomputed the same bytes" for a, d in seconded)
    return (
        f"verify job `{verify_job_id}` (attempt `{attempt_id}` of provider `{verifier}`) recomputed {j.target_kind} job `{j.target_job_id}` and got other bytes for {_named(j.differ)}"
        f" than attempt `{j.producer_attempt_id}` of provider `{j.producer_id}` uploaded{also}"
    )


def discard(db: sqlite3.Connection, attempt_id: str, job_id: str, reason: str, now: float) -> None:
    """Capture or train attempt `attempt_id` no longer counts: its job is queued again, and the jobs needing it wait for it again."""
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
    # A disagreement over the discarded attempt is moot: its verify job checks the redo.
    for (verify_job_id,) in db.execute(
        "SELECT DISTINCT a.job_id FROM job_deps d JOIN attempts a ON a.job_id=d.job_id WHERE d.needs_job_id=? AND a.state='disputed'", (job_id,)
    ).fetchall():
        if (target(db, verify_job_id) or ("", ""))[1] == job_id:
            db.execute(
                "UPDATE attempts SET state='discarded', message=? WHERE job_id=? AND state='disputed'",
                (f"the attempt it disputed was discarded: {reason}"[:4000], verify_job_id),
            )


def quarantine(db: sqlite3.Connection, provider_id: str, reason: str, now: float) -> tuple[list, list]:
    """Quarantine `provider_id` (the first reason is kept; recorded in the audit log). Returns its live attempts
    `(attempt_id, job_id)`, to end, and its other succeeded capture, train and verify attempts that no job has used yet
    (every job needing them, verify jobs aside, is still queued, and their runs have not failed), to discard."""
    cur = db.execute(
        "UPDATE providers SET quarantined_unix=?, quarantine_reason=? WHERE provider_id=? AND quarantined_unix IS NULL", (now, reason[:4000], provider_id)
    )
    if cur.rowcount == 1:
        audit.record(db, action="quarantine", provider_id=provider_id, reason=reason, now=now)
    live = db.execute("SELECT attempt_id, job_id FROM attempts WHERE provider_id=? AND state='live'", (provider_id,)).fetchall()
    others = db.execute(
        "SELECT a.attempt_id, a.job_id FROM attempts a JOIN jobs j ON j.job_id=a.job_id JOIN runs r ON r.run_id=j.run_id"
        " WHERE a.provider_id=? AND a.state='succeeded' AND j.kind IN ('capture', 'train', 'verify') AND r.failure='' AND NOT EXISTS"
        " (SELECT 1 FROM job_deps d JOIN jobs n ON n.job_id=d.job_id WHERE d.needs_job_id=a.job_id AND n.kind!='verify' AND n.state!='queued')",
        (provider_id,),
    ).fetchall()
    return live, others
