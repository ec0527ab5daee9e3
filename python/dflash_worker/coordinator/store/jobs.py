"""How a job moves between states: an attempt ending, leases expiring, a graph run failing, an admin's directives.

Job states: ``queued`` -> ``leased`` (-> ``cancelling``) -> ``succeeded`` | ``failed`` |
``cancelled``, or back to ``queued`` when an attempt expires or ends retryable (at most
``max_attempts`` attempts, then ``failed``).
Attempt states: ``live``, ``succeeded``, ``failed``, ``cancelled``, ``retryable``, ``expired``,
``revoked`` (its provider was revoked; the job is requeued like an expired one), ``quarantined``
(likewise, its provider was quarantined), ``discarded`` (a capture or train attempt that had succeeded,
and its provider was quarantined: its job is queued again; or a verify attempt of such an attempt),
``disputed`` (a verify attempt that recomputed other bytes than the capture's or train's, until a tie-break
settles it), ``mismatch`` (one whose disagreement was settled against the producer), ``overruled`` (one
outvoted: the tie-break recomputed the producer's bytes, and its provider was quarantined); `verify`.

When a job of a graph run ends ``failed`` or ``cancelled`` the run fails: ``runs.failure``
names that job, and every queued job of the run (its dependents among them) is failed with
that reason, so no more of the run's work is leased; attempts already running finish, but a
job whose attempt is requeued after that fails instead. A job's ``pending_deps`` counts the
jobs it needs that have not succeeded (a succeeded job never changes state again).
"""

from __future__ import annotations

from ...errors import NotFoundError, PolicyError
from .db import Database, Part, printable
from .records import Records
from .verify import Judgement, Settlement, describe, discard, dispute_message, judge, overruled_reason, quarantine, settle

FINAL_JOB_STATES = ("succeeded", "failed", "cancelled")


class Jobs(Part):
    """The job state machine every lease, revocation and admin directive goes through."""

    def __init__(self, database: Database, *, records: Records, max_attempts: int):
        super().__init__(database)
        self.records = records
        self.max_attempts = max_attempts
        # Attempts that ended since the server last looked (their staged uploads go).
        self.ended_attempts: set[str] = set()

    def end_attempt(self, db, attempt_id: str, job_id: str, attempt_state: str, message: str, now: float) -> str:
        """Close an attempt and move its job on; returns the job's new state."""
        cancel, attempts, kind = db.execute("SELECT cancel_requested, attempts, kind FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        verdict = judge(db, attempt_id, job_id) if attempt_state == "succeeded" and kind == "verify" else None
        settled, job_state = None, ""
        if verdict is not None:
            attempt_state, job_state, message, settled = self._weigh(db, verdict, attempt_id, job_id, message)
        if job_state:
            pass
        elif attempt_state == "succeeded":
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
        self.records.drop_loose_checkpoint_files(db, attempt_id)
        self.ended_attempts.add(attempt_id)
        db.execute(
            "UPDATE jobs SET state=?, current_attempt_id=NULL, checkpoint_requested=0, reason=?, updated_unix=? WHERE job_id=?",
            (job_state, f"run failed: {failure}" if failure else "", now, job_id),
        )
        if settled is not None:
            self._apply(db, verdict, settled, attempt_id, job_id, now)
        if job_state == "succeeded":
            db.execute("UPDATE jobs SET pending_deps=pending_deps-1 WHERE job_id IN (SELECT job_id FROM job_deps WHERE needs_job_id=?)", (job_id,))
        if job_state in ("failed", "cancelled") and not failure:
            self.fail_graph_run(db, job_id, job_state, message, now)
        return job_state

    @staticmethod
    def _weigh(db, verdict: Judgement, attempt_id: str, job_id: str, message: str) -> tuple[str, str, str, Settlement | None]:
        """A succeeded verify attempt's `(attempt state, job state or "" to decide as usual, message, settlement)`."""
        if not verdict.producer_attempt_id:
            # The attempt it recomputed was discarded meanwhile (its producer was quarantined): verified again once redone.
            return "discarded", "queued", "the attempt it verified was discarded meanwhile", None
        if verdict.missing and not verdict.mismatch:
            return "retryable", "", f"the verify attempt uploaded no recomputation of `{printable(verdict.missing[0][:200])}`", None
        settled = settle(db, attempt_id, job_id, verdict)
        if settled.outcome == "open":  # a tie-break replays the unit on a provider that is none of them
            return "disputed", "queued", dispute_message(verdict), settled
        if settled.outcome == "verifiers":  # verified again once the capture or train job is redone
            return "mismatch", "queued", message, settled
        return "succeeded", "", message, settled

    def _apply(self, db, verdict: Judgement, settled: Settlement, attempt_id: str, job_id: str, now: float) -> None:
        """A settled disagreement: the outvoted verifiers are quarantined; against the producer (two verifiers agree),
        its capture or train attempt is discarded and its job redone, and it is quarantined."""
        if settled.outcome == "open":
            self.counts["verify_disputes"] += 1
            return
        me = db.execute("SELECT provider_id FROM attempts WHERE attempt_id=?", (attempt_id,)).fetchone()[0]
        for disputing, _ in settled.agreeing:
            db.execute(
                "UPDATE attempts SET state='mismatch', message=? WHERE attempt_id=?",
                (f"mismatch: settled against the producer by attempt `{attempt_id}` of provider `{me}`, which recomputed the same bytes", disputing),
            )
        for disputing, provider_id in settled.overruled:
            j = judge(db, disputing, job_id)
            by = (attempt_id, me)
            reason = overruled_reason(j, verify_job_id=job_id, attempt_id=disputing, by=by, producer_stands=settled.outcome == "producer")
            db.execute("UPDATE attempts SET state='overruled', message=? WHERE attempt_id=?", (f"overruled: {reason}"[:4000], disputing))
            self.counts["verifiers_overruled"] += 1
            self._quarantine_provider(db, provider_id, reason, now)
        if settled.outcome == "verifiers":
            reason = describe(verdict, verify_job_id=job_id, attempt_id=attempt_id, verifier=me, seconded=settled.agreeing)
            discard(db, verdict.producer_attempt_id, verdict.target_job_id, reason, now)
            self.counts["verify_mismatches"] += 1
            self._quarantine_provider(db, verdict.producer_id, reason, now)

    def _quarantine_provider(self, db, provider_id: str, reason: str, now: float) -> None:
        """Quarantine `provider_id`: its other work no job has used yet is discarded and redone, its live attempts end."""
        live, others = quarantine(db, provider_id, reason, now)
        for attempt_id, job_id in others:  # its other captures, trainings and verdicts that no job has used yet are redone too
            discard(db, attempt_id, job_id, f"its provider was quarantined: {reason}", now)
        for attempt_id, job_id in live:
            self.end_attempt(db, attempt_id, job_id, "quarantined", f"provider `{provider_id}` was quarantined: {reason}", now)

    def fail_graph_run(self, db, job_id: str, job_state: str, message: str, now: float) -> None:
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
                state = self.end_attempt(db, attempt_id, job_id, "expired", "lease expired without a heartbeat", now)
                requeued |= state == "queued"
        if requeued:
            self.on_work()
        return len(due)

    def readied_by(self, job_id: str) -> bool:
        """Whether a queued job needing `job_id` has no unmet need left (a graph's next jobs, once it succeeded)."""
        return (
            self.db.execute(
                "SELECT 1 FROM job_deps d JOIN jobs j ON j.job_id=d.job_id WHERE d.needs_job_id=? AND j.state='queued' AND j.pending_deps=0 LIMIT 1",
                (job_id,),
            ).fetchone()
            is not None
        )

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
                self.fail_graph_run(db, job_id, "cancelled", "cancelled by an admin", self.clock())
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
