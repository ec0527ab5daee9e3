"""The regression gate's decisions: whether each job's export is published (served by default).

One ``publications`` row per succeeded job with an export says whether the export is served
by default, the verdict and why, the evaluation figures the status page shows, and an admin's
override (time, note, address) when there was one. The gate itself (`publish`) decides; this
part finds what it decides on (`gate_inputs`) and keeps the decision. In a job graph the
export is the train job's and the report evaluate shard 0's, so the decision waits for that job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ...errors import InvalidRequestError, PolicyError
from ..artifacts.names import ArtifactRecord
from .db import Database, Part, printable
from .reader import PublicationRow, read_publication
from .records import REC_COLS, Records, record_from_row
from .runs import Runs


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


class Publications(Part):
    """What the regression gate decides on, its decisions, and an admin's override."""

    def __init__(self, database: Database, *, runs: Runs, records: Records):
        super().__init__(database)
        self.runs = runs
        self.records = records

    def publication(self, job_id: str) -> PublicationRow | None:
        """The gate's decision on the job's export; None when it has none (no export, or not decided yet)."""
        return read_publication(self.db, job_id)

    def gated_job(self, job_id: str) -> str:
        """The job whose export a success of `job_id` lets the gate decide on: in a job graph, evaluate
        shard 0's success decides on the train job's export (shard 0 uploads the run's one report)."""
        r = self.db.execute("SELECT run_id, kind, shard_index FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        if r is not None and r[1] == "evaluate" and r[2] == 0:
            return self.runs.graph_job(r[0], "train") or job_id
        return job_id

    def pending_gate(self, job_id: str) -> str:
        """Why the gate has not decided on `job_id`'s export yet, when it waits for its run's evaluate job; "" otherwise."""
        r = self.db.execute("SELECT j.run_id, j.kind, r.failure FROM jobs j JOIN runs r ON r.run_id=j.run_id WHERE j.job_id=?", (job_id,)).fetchone()
        if r is None or r[1] != "train" or r[2]:
            return ""
        ev = self.runs.graph_job(r[0], "evaluate")
        if ev is None or self.records.succeeded_attempt(ev) is not None:
            return ""
        return f"it waits for the run's evaluate job `{ev}` (shard 0), whose report the regression gate decides on"

    def gate_inputs(self, job_id: str, report_name: str) -> GateInputs | None:
        """What the gate needs to decide on a succeeded job with an export; None when there is nothing to decide yet.

        A pipeline job's report is its own attempt's. A job graph's export comes from its train job
        and its report from evaluate shard 0: the decision waits (None) until that job succeeds, and
        is taken without a report once the run has failed instead.
        """
        final = self.records.succeeded_attempt(job_id)
        if final is None or not self.records.has_final_export(job_id):
            return None
        run_id, kind, failure = self.db.execute(
            "SELECT j.run_id, j.kind, r.failure FROM jobs j JOIN runs r ON r.run_id=j.run_id WHERE j.job_id=?", (job_id,)
        ).fetchone()
        report_attempt, no_report = final[0], ""
        ev = self.runs.graph_job(run_id, "evaluate") if kind == "train" else None
        if ev is not None:
            ev_final = self.records.succeeded_attempt(ev)
            if ev_final is not None:
                report_attempt = ev_final[0]
                no_report = f"the run's evaluate job `{ev}` (shard 0) succeeded without an evaluation report (`{report_name}`)"
            elif failure:
                report_attempt, no_report = None, f"no evaluation report: {printable(failure)}"
            else:
                return None
        r = None
        if report_attempt is not None:
            r = self.db.execute(f"SELECT {REC_COLS} FROM records WHERE attempt_id=? AND name=? AND kind='report'", (report_attempt, report_name)).fetchone()
        return GateInputs(
            job_id=job_id, run_id=run_id, attempt_id=final[0], spec_json=self.runs.spec_json(run_id), report=None if r is None else record_from_row(r), no_report=no_report
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
            if not self.records.has_final_export(job_id):
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
