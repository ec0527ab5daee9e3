"""Leases: handing a provider the oldest job it can run, renewing the lease, and ending it.

Leases live on the ``attempts`` table: each attempt of a job holds exactly one lease
(``lease_id``, ``lease_expires_unix``), valid while the attempt's state is ``live``, it is its
job's ``current_attempt_id`` and it has not expired. A lease names the final artifacts of the
jobs its job needs (`Grant.inputs`), which the provider may download (`find_input`), and the
job's newest checkpoint to resume from. Earlier attempts' checkpoints and capture shards are
named only as the run's ``trust_inputs`` allows (`provenance.trust_filter`), and what a lease
names is recorded with the attempt that produced it (`provenance.record_inputs`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ...errors import InvalidRequestError, NotFoundError, PermissionDeniedError, StaleLeaseError
from ..artifacts.names import ArtifactRecord
from ..policy import ProviderProfile, RunRequirements, Verdict, decide, local_ranks
from .db import Database, Part, new_id
from .jobs import Jobs
from .provenance import Handed, record_inputs, trust_filter
from .providers import Providers
from .records import REC_COLS, LiveLease, Records, record_from_row
from .runs import RunRow, Runs
from .verify import replay_checkpoint

# Input artifacts one lease names at most (a train job's: every capture shard's final records),
# and their size in the Lease message, so a lease stays well inside the 16 MiB message limit
# that server and run-manager share. A job needing more fails (never a lease missing inputs).
MAX_LEASE_INPUTS = 20_000
MAX_LEASE_INPUT_BYTES = 8 << 20
# A queued job `j` is leasable when every job it needs has SUCCEEDED (pipeline jobs need none):
# `pending_deps` counts those that have not (a succeeded job never changes state again), so
# finding a leasable job is an index lookup (`jobs_ready`), however many jobs wait.
_READY = "j.pending_deps=0"
# A verify job goes to a provider other than the one whose attempt produced the capture it recomputes (or
# the training it replays: the train job it needs, `verify.target`), on the same backend (capture and
# training are byte-reproducible on one kind of device; `verify`), and, while a disagreement over it is open, to
# none of the providers whose verify attempts are `disputed` (a tie-break: `verify.settle`). Parameters: the
# provider asking, its backend, the provider asking.
_VERIFIER = (
    "(j.kind!='verify' OR (EXISTS (SELECT 1 FROM job_deps d JOIN jobs c ON c.job_id=d.needs_job_id"
    " AND c.kind=(CASE WHEN EXISTS (SELECT 1 FROM job_deps t JOIN jobs tj ON tj.job_id=t.needs_job_id WHERE t.job_id=j.job_id AND tj.kind='train')"
    " THEN 'train' ELSE 'capture' END)"
    " JOIN attempts a ON a.job_id=c.job_id AND a.state='succeeded' JOIN providers p ON p.provider_id=a.provider_id"
    " WHERE d.job_id=j.job_id AND a.provider_id!=? AND p.backend=?)"
    " AND NOT EXISTS (SELECT 1 FROM attempts x WHERE x.job_id=j.job_id AND x.state='disputed' AND x.provider_id=?)))"
)


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


@dataclass(kw_only=True)
class Progress:
    phase: int = 0
    step: int = 0
    total_steps: int = 0
    committed_step: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


def sort_kinds(reqs: dict[str, RunRequirements], profile: ProviderProfile) -> tuple[list[str], list[str], str]:
    """`(fits, behind, why)`: the job kinds of `reqs` the provider `profile` can run now, those it could
    after a client upgrade, and why the last of those needs one (`policy.decide`; other kinds are left out)."""
    fits, behind, why = [], [], ""
    for kind, req in reqs.items():
        verdict, reason = decide(req, profile)
        if verdict is Verdict.ELIGIBLE:
            fits.append(kind)
        elif verdict is Verdict.UPGRADE:
            behind.append(kind)
            why = reason
    return fits, behind, why


class Leases(Part):
    """Granting, renewing and ending leases, and the inputs a lease names."""

    def __init__(self, database: Database, *, lease_ttl: float, runs: Runs, providers: Providers, jobs: Jobs, records: Records):
        super().__init__(database)
        self.lease_ttl = lease_ttl
        self.runs = runs
        self.providers = providers
        self.jobs = jobs
        self.records = records

    def acquire(self, provider_id: str) -> Grant | Upgrade | None:
        """Lease the oldest eligible queued job to `provider_id`.

        Returns a `Grant`, an `Upgrade` when queued work exists that only a
        different client version could take, or None when there is nothing
        this provider can run.
        """
        self.jobs.expire_due()
        profile = self.providers.profile(provider_id)
        now = self.clock()
        self.db.execute("UPDATE providers SET last_seen_unix=? WHERE provider_id=?", (now, provider_id))
        if self.providers.quarantined(provider_id):
            return None  # a verify job recomputed other bytes than it uploaded: it is leased nothing more
        who = (provider_id, profile.backend)
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
            run = self.runs.run_for_lease(run_id)
            # Decided per job kind (placement): the oldest ready job of a kind this provider fits.
            reqs = self.runs.kind_requirements(run)
            fits, behind, why = sort_kinds(reqs, profile)
            if behind and upgrade is None and self._ready_job(run_id, behind, who) is not None:
                upgrade = Upgrade(required_client_version=run.spec.required_client_version, message=f"run `{run.spec.name}`: {why}")
            if fits:
                grant = self._lease_oldest(run_id, run, reqs, fits, profile=profile, who=who, now=now)
                if grant is not None:
                    return grant
        return upgrade

    def _lease_oldest(
        self, run_id: str, run: RunRow, reqs: dict[str, RunRequirements], fits: list[str], *, profile: ProviderProfile, who: tuple[str, str], now: float
    ) -> Grant | None:
        """Lease the run's oldest ready job of one of `fits` to provider `who`; None when there is none
        (or the one found names too many inputs: it fails, and its run's graph with it)."""
        provider_id = who[0]
        with self._tx() as db:
            row = self._ready_job(run_id, fits, who)
            if row is None:
                return None
            job_id, attempts, kind, shard_index, shard_count = row
            req = reqs[kind]
            trust = run.spec.trust_inputs
            handed = self.handed_inputs(job_id, provider_id=provider_id, trust=trust)
            inputs = tuple(h.record for h in handed)
            too_many = self._too_many_inputs(inputs)
            if too_many:
                db.execute("UPDATE jobs SET state='failed', reason=?, updated_unix=? WHERE job_id=?", (too_many, now, job_id))
                self.jobs.fail_graph_run(db, job_id, "failed", too_many, now)
                return None
            attempt_id, lease_id = new_id("att"), new_id("lease")
            db.execute(
                "INSERT INTO attempts(attempt_id, job_id, number, provider_id, lease_id, state, lease_expires_unix, started_unix)"
                " VALUES (?,?,?,?,?,'live',?,?)",
                (attempt_id, job_id, attempts + 1, provider_id, lease_id, now + self.lease_ttl, now),
            )
            db.execute(
                "UPDATE jobs SET state='leased', attempts=?, current_attempt_id=?, checkpoint_requested=0, updated_unix=? WHERE job_id=?",
                (attempts + 1, attempt_id, now, job_id),
            )
            if kind == "verify":  # a replay of training starts from the producer's checkpoint, or from step 0
                resume = self.replay_checkpoint(job_id, run_id)
            else:
                resume = self.resume_checkpoint(job_id, provider_id=provider_id, trust=trust)
            record_inputs(db, attempt_id, resume=resume, inputs=handed)
        self.counts["leases_granted"] += 1
        return Grant(
            lease_id=lease_id,
            run_id=run_id,
            job_id=job_id,
            attempt=attempts + 1,
            spec_json=self.runs.spec_json(run_id),
            ttl_seconds=self.lease_ttl,
            resume_checkpoint=None if resume is None else resume.record,
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

    def _ready_job(self, run_id: str, kinds: list[str], who: tuple[str, str]) -> tuple | None:
        """`(job_id, attempts, kind, shard_index, shard_count)` of the run's oldest job of one of `kinds` leasable
        to provider `who` = `(provider_id, backend)` (a verify job: not to its capture's producer nor to a provider disputing it, `_VERIFIER`)."""
        return self.db.execute(
            f"SELECT job_id, attempts, kind, shard_index, shard_count FROM jobs j WHERE run_id=? AND state='queued' AND {_READY}"
            f" AND kind IN ({','.join('?' * len(kinds))}) AND {_VERIFIER} ORDER BY seq LIMIT 1",
            (run_id, *kinds, *who, who[0]),
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

    def inputs(self, job_id: str, *, provider_id: str = "", trust: str = "any") -> tuple[ArtifactRecord, ...]:
        """The records a lease of `job_id` on `provider_id` names as inputs under the run policy `trust` (`handed_inputs`)."""
        return tuple(h.record for h in self.handed_inputs(job_id, provider_id=provider_id, trust=trust))

    def handed_inputs(self, job_id: str, *, provider_id: str, trust: str) -> tuple[Handed, ...]:
        """The final artifacts of the jobs `job_id` needs (their SUCCEEDED attempts' records, checkpoints
        aside: those are a job's own), in the needed jobs' order, each with the attempt that uploaded it;
        at most MAX_LEASE_INPUTS + 1 (one more says "too many").

        A capture job's earlier attempts (a provider lost mid-job) hand on their `capture` records too,
        the newest of each name among the attempts the run's `trust` policy allows a new attempt on
        `provider_id` (`provenance.trust_filter`; never a discarded attempt's): the shards they committed, which the next attempt
        verifies and keeps instead of capturing them again (`capture.shards.scan_shards`)."""
        cols = ", ".join("r." + c.strip() for c in REC_COLS.split(","))
        (kind,) = self.db.execute("SELECT kind FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        rows = self.db.execute(
            f"SELECT {cols}, r.attempt_id FROM job_deps d JOIN jobs n ON n.job_id=d.needs_job_id"
            " JOIN attempts a ON a.job_id=n.job_id AND a.state='succeeded' JOIN records r ON r.attempt_id=a.attempt_id"
            " WHERE d.job_id=? AND r.kind NOT IN ('checkpoint', 'checkpoint_file') AND n.kind!='verify'"
            # a replay of training recomputes the export: it is not handed the producer's
            " AND NOT (? AND n.kind='train' AND r.kind='export') ORDER BY n.seq, r.seq LIMIT ?",
            (job_id, kind == "verify", MAX_LEASE_INPUTS + 1),
        ).fetchall()
        if len(rows) <= MAX_LEASE_INPUTS and kind == "capture":
            trusted, params = trust_filter(trust, provider_id)
            rows += self.db.execute(
                f"SELECT {cols}, r.attempt_id FROM records r WHERE r.seq IN (SELECT MAX(x.seq) FROM records x JOIN attempts a ON a.attempt_id=x.attempt_id"
                f" WHERE x.job_id=? AND x.kind='capture' AND {trusted} GROUP BY x.name) ORDER BY r.seq LIMIT ?",
                (job_id, *params, MAX_LEASE_INPUTS + 1 - len(rows)),
            ).fetchall()
        return tuple(Handed(record=record_from_row(r[:-1]), producer_attempt_id=r[-1]) for r in rows)

    def resume_checkpoint(self, job_id: str, *, provider_id: str, trust: str) -> Handed | None:
        """The job's newest committed checkpoint (highest step, then latest recorded) among the attempts
        the run's `trust` policy allows a new attempt on `provider_id`, with the attempt that uploaded it."""
        trusted, params = trust_filter(trust, provider_id)
        r = self.db.execute(
            f"SELECT {', '.join('r.' + c.strip() for c in REC_COLS.split(','))}, r.attempt_id FROM records r"
            f" JOIN attempts a ON a.attempt_id=r.attempt_id WHERE r.job_id=? AND r.kind='checkpoint' AND {trusted}"
            " ORDER BY r.step DESC, r.seq DESC LIMIT 1",
            (job_id, *params),
        ).fetchone()
        return None if r is None else Handed(record=record_from_row(r[:-1]), producer_attempt_id=r[-1])

    def replay_checkpoint(self, job_id: str, run_id: str) -> Handed | None:
        """A verify job's resume checkpoint: for a replay of training, the train producer's checkpoint it starts
        from (`verify.replay_checkpoint`, by the run's `verify_fraction`); None for step 0 and for a capture's."""
        # The fraction is read from the run's spec JSON (checked at creation) only when a verify job is leased.
        fraction = float(json.loads(self.runs.spec_json(run_id)).get("verify_fraction", 0))
        found = replay_checkpoint(self.db, job_id, fraction)
        if found is None:
            return None
        seq, attempt_id = found
        r = self.db.execute(f"SELECT {REC_COLS} FROM records WHERE seq=?", (seq,)).fetchone()
        return Handed(record=record_from_row(r), producer_attempt_id=attempt_id)

    def find_input(self, job_id: str, name: str, sha256: str) -> ArtifactRecord:
        """A record a lease of `job_id` may download: its own job's (`find_record`), or one of its `inputs`
        (a verify job replaying training: also the train producer's checkpoints, which it starts from)."""
        try:
            return self.records.find_record(job_id, name, sha256)
        except NotFoundError:
            r = self.db.execute(
                f"SELECT {', '.join('r.' + c.strip() for c in REC_COLS.split(','))} FROM job_deps d JOIN jobs v ON v.job_id=d.job_id"
                " JOIN jobs n ON n.job_id=d.needs_job_id"
                " JOIN attempts a ON a.job_id=d.needs_job_id AND a.state='succeeded' JOIN records r ON r.attempt_id=a.attempt_id"
                " WHERE d.job_id=? AND r.name=? AND r.sha256=?"
                " AND (r.kind NOT IN ('checkpoint', 'checkpoint_file') OR (v.kind='verify' AND n.kind='train')) LIMIT 1",
                (job_id, name, sha256),
            ).fetchone()
            if r is None:
                raise
            return record_from_row(r)

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
            self.jobs.expire_due()
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
            state = self.jobs.end_attempt(db, attempt_id, job_id, outcome, message, self.clock())
        if state == "queued" or (state == "succeeded" and self.jobs.readied_by(job_id)):
            self.on_work()  # long-polling providers wake for the requeued job, or the jobs this success made ready
        return state

    def live_attempt_ids(self) -> set[str]:
        return {a for (a,) in self.db.execute("SELECT attempt_id FROM attempts WHERE state='live'")}
