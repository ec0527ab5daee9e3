"""Runs: creating one (its jobs, their edges and placements), reading runs and their jobs back,
approved native versions, and why a ready job is not leased yet (`waiting_reasons`).

A queued job is leasable only once every job it needs has succeeded, and only by a provider
that fits its kind's placement (``placements``, written at creation; `kind_requirements`).
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from dataclasses import dataclass

from ...errors import ConflictError, InvalidRequestError, NotFoundError
from ..artifacts.names import ArtifactRecord
from ..policy import GRAPH_KINDS, Placement, RunRequirements, Verdict, check_version, decide, default_placement
from .db import Database, Part, new_id, next_token, page
from .provenance import InputSource, result_attempt, sources
from .providers import Providers
from .reader import PublicationRow, read_publication
from .records import REC_COLS, Records, record_from_row
from .spec import RunSpecData
from .verify import tie_break_wait

# How many providers one waiting reason names.
WAITING_NAMED = 5


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
    # The attempts whose artifacts reached the job's result (its SUCCEEDED attempt, else its newest): `provenance.sources`.
    provenance: tuple[InputSource, ...] = ()


class Runs(Part):
    """Runs and the jobs they were created with, as the admin service and leasing read them."""

    def __init__(self, database: Database, *, providers: Providers, records: Records):
        super().__init__(database)
        self.providers = providers
        self.records = records

    def create_run(self, spec: RunSpecData) -> RunRow:
        now = self.clock()
        run_id = new_id("run")
        try:
            with self._tx() as db:
                db.execute(
                    "INSERT INTO runs(run_id, name, spec_json, required_client_version, checkpoint_policy,"
                    " max_local_ranks, required_features, image, num_jobs, created_unix, capture_shards, eval_shards, trust_inputs)"
                    " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
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
                        spec.trust_inputs,
                    ),
                )
                graph = spec.graph(run_id)
                ids = [new_id("job") for _ in graph]
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
            trust_inputs=r[13],
        )
        return RunRow(run_id=run_id, spec=spec, approved_native_versions=approved, created_unix=r[9], job_states=states, failure=r[12])

    _RUN_COLS = (
        "run_id, name, spec_json, required_client_version, checkpoint_policy, max_local_ranks, required_features, image, num_jobs, created_unix,"
        " capture_shards, eval_shards, failure, trust_inputs"
    )

    def run_for_lease(self, run_id: str) -> RunRow:
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
        out = {kind: req.for_kind(stored.get(kind) or default_placement(kind, req.max_local_ranks)) for kind in GRAPH_KINDS}
        # A verify job recomputes a capture shard (one rank's capture equals several ranks' byte for byte), or
        # replays training of a run whose train job has one rank (`spec.RunSpecData`): what capture needs, on one rank.
        out["verify"] = dataclasses.replace(out["capture"], max_local_ranks=1)
        return out

    def spec_json(self, run_id: str) -> str:
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
            final = self.records.succeeded_attempt(job_id)
            count, export = 0, None
            if final is not None:
                count = self.db.execute("SELECT COUNT(*) FROM records WHERE attempt_id=?", (final[0],)).fetchone()[0]
                r = self.db.execute(
                    f"SELECT {REC_COLS} FROM records WHERE attempt_id=? AND kind='export' ORDER BY (name LIKE '%model.safetensors') DESC, seq LIMIT 1",
                    (final[0],),
                ).fetchone()
                export = None if r is None else record_from_row(r)
            pub = read_publication(self.db, job_id) if export is not None else None
            result = result_attempt(self.db, job_id) if attempts else None
            provenance = tuple(sources(self.db, result)) if result is not None else ()
            out.append(
                JobRow(
                    job_id=job_id, run_id=run_id, state=state, attempts=attempts, artifact_count=count, export=export, publication=pub,
                    kind=kind, shard_index=shard_index, shard_count=shard_count, reason=reason,
                    needs=tuple(d for d, _ in deps), waiting_for=tuple(d for d, st in deps if st != "succeeded"),
                    provenance=provenance,
                )  # fmt: skip
            )
        waiting = [j for j in out if j.state == "queued" and not j.waiting_for] if not run.failure else []
        if waiting:
            why = self.waiting_reasons(run, {j.kind for j in waiting})
            ids = {j.job_id for j in waiting}
            since = self.clock() - self.providers.live_seconds
            for i, j in enumerate(out):
                if j.job_id in ids:  # a verify job with a disagreement to settle says whose, and who could break the tie
                    tie = tie_break_wait(self.db, j.job_id, live_since=since) if j.kind == "verify" else ""
                    out[i] = dataclasses.replace(j, waiting_reason=tie or why[j.kind])
        return out, next_token(rows, size)

    def waiting_reasons(self, run: RunRow, kinds: set[str]) -> dict[str, str]:
        """Why a ready queued job of each of `kinds` in `run` is not leased: no live provider, none that
        fits (each named with the first requirement it misses, `policy.decide`, placement included), or
        the ones that fit are busy or have not asked for work since it became ready."""
        providers, found = self.providers.live_providers()
        if not providers:
            return dict.fromkeys(kinds, f"waiting for a provider: no live provider is registered (none asked for work in the last {self.providers.live_seconds:.0f} s)")
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
            if kind == "verify":
                out[kind] += "; a verify job goes only to a provider other than the one that produced its capture (or its training), on the same backend"
        return out

    def approve_version(self, run_id: str, version: str) -> RunRow:
        check_version(version, "version")
        self.get_run(run_id)
        with self._tx() as db:
            db.execute("INSERT OR IGNORE INTO approved_versions(run_id, version, approved_unix) VALUES (?,?,?)", (run_id, version, self.clock()))
        self.on_work()
        return self.get_run(run_id)

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
        train = self.graph_job(run_id, "train") if len(jobs) > 1 else None
        if train is not None:
            return train
        if len(jobs) != 1:
            raise InvalidRequestError(f"run `{run_id}` has several jobs; name one with `--job`\nhint: `dflash-coordinator runs show {run_id}` lists them")
        return jobs[0]

    def graph_job(self, run_id: str, kind: str, shard_index: int = 0) -> str | None:
        r = self.db.execute("SELECT job_id FROM jobs WHERE run_id=? AND kind=? AND shard_index=? ORDER BY seq LIMIT 1", (run_id, kind, shard_index)).fetchone()
        return None if r is None else r[0]
