"""Artifact records, their quotas and checkpoint rotation (the ``records`` table).

``records`` maps (attempt, name) to a blob's sha256; the bytes live in the blob store
(`blobs`), each blob once. Records belong to the attempt that uploaded them, so a failed or
retried attempt's records never shadow another's: a job's final artifacts are its SUCCEEDED
attempt's, and its resume checkpoint is the newest checkpoint any attempt committed. Quotas
(`Quotas`) bound each attempt's records and bytes, and each run's in its live and succeeded
attempts, uploads staged but not yet recorded included (`check_quota`). Only the newest
`keep_checkpoints` checkpoints of a job are kept; older ones lose their records first and
their blobs after (`take_garbage`), so no record points at deleted bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError, ConflictError, InvalidRequestError, NotFoundError, QuotaError
from ..artifacts.names import ArtifactRecord, Claim, artifact_uri, checkpoint_dir, escape_name, fold_name, name_conflict
from ..artifacts.staging import NOTHING_STAGED, Staged
from .db import Database, Part, page

REC_COLS = "name, kind, sha256, size_bytes, step, run_id, job_id, attempt"


def record_from_row(r) -> ArtifactRecord:
    """An `ArtifactRecord` from a row of `REC_COLS`."""
    name, kind, sha, size, step, run_id, job_id, attempt = r
    return ArtifactRecord(name=name, kind=kind, sha256=sha, size_bytes=size, uri=artifact_uri(run_id, job_id, attempt, name), step=step)


@dataclass(frozen=True, kw_only=True)
class LiveLease:
    """The attempt behind a live lease, as a write sees it (`Leases.live_lease` finds it; the
    writes here and the upload engine take it)."""

    attempt_id: str
    job_id: str
    run_id: str


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


class Records(Part):
    """A job's artifact records: recording an upload (quotas, names, checkpoint rotation) and finding them."""

    def __init__(self, database: Database, *, quotas: Quotas, keep_checkpoints: int):
        super().__init__(database)
        self.quotas = quotas
        self.keep_checkpoints = keep_checkpoints
        # Blobs whose last record went away (checkpoint rotation, ended attempts): the
        # server deletes them from the blob store unless a record refers to them again.
        self.garbage: set[str] = set()
        # `check_name_free`'s twin lookup folds only non-ASCII names in Python (an ASCII name's fold is SQLite's `lower`).
        self.db.create_function("dflash_fold_name", 1, fold_name, deterministic=True)

    def recorded(self, attempt_id: str, claim: Claim) -> ArtifactRecord | None:
        """This attempt's record of `claim.name` if it has the same sha256; ALREADY_EXISTS if it differs; None if absent."""
        r = self.db.execute(f"SELECT {REC_COLS} FROM records WHERE attempt_id=? AND name=?", (attempt_id, claim.name)).fetchone()
        if r is None:
            return None
        if r[2] != claim.sha256:
            raise ConflictError(
                f"artifact `{claim.name}` was already uploaded by this attempt with sha256 `{r[2]}`; this upload has `{claim.sha256}`\n"
                "hint: artifacts are immutable; upload new bytes under a new name"
            )
        return record_from_row(r)

    def check_quota(self, lease: LiveLease, claim: Claim, *, staged: Staged = NOTHING_STAGED) -> None:
        """RESOURCE_EXHAUSTED, naming the limit, if recording `claim` (plus the uploads `staged`) would pass a quota.

        An attempt counts all its records. A run counts the records of its live and succeeded attempts:
        an attempt that ended otherwise keeps its records (listed with `--all-attempts`, its checkpoints
        still a resume point) but no longer holds the run's quota against the attempts after it; each
        attempt is bounded by its own quota, and `--max-attempts` bounds how many a job has.
        """
        q = self.quotas
        for scope, sql, key, max_records, max_bytes, pending_records, pending_bytes in (
            ("attempt", "SELECT COUNT(*), COALESCE(SUM(size_bytes), 0) FROM records WHERE attempt_id=?", lease.attempt_id,
             q.attempt_records, q.attempt_bytes, staged.attempt_records, staged.attempt_bytes),
            ("run", "SELECT COUNT(*), COALESCE(SUM(r.size_bytes), 0) FROM records r JOIN attempts a ON a.attempt_id=r.attempt_id"
             " WHERE r.run_id=? AND a.state IN ('live', 'succeeded')", lease.run_id,
             q.run_records, q.run_bytes, staged.run_records, staged.run_bytes),
        ):  # fmt: skip
            n, b = self.db.execute(sql, (key,)).fetchone()
            of = " in its live and succeeded attempts" if scope == "run" else ""
            if n + pending_records + 1 > max_records:
                raise QuotaError(
                    f"artifact `{claim.name}`: this {scope} already has {n} artifact records{of} (+{pending_records} staged or uploading); "
                    f"the {scope} quota is {max_records} records\nhint: the run admin sets it with `serve --quota-{scope}-records`"
                )
            if b + pending_bytes + claim.size_bytes > max_bytes:
                raise QuotaError(
                    f"artifact `{claim.name}` ({claim.size_bytes} bytes): this {scope} already stores {b} bytes{of} "
                    f"(+{pending_bytes} declared by uploads staged or in progress); "
                    f"the {scope} quota is {max_bytes} bytes\nhint: the run admin sets it with `serve --quota-{scope}-bytes`"
                    + ("; a stopped upload keeps its share until it is resumed and committed, its attempt ends, or it sits idle" if pending_bytes else "")
                )

    def check_name_free(self, attempt_id: str, name: str) -> None:
        """INVALID_ARGUMENT if `name` and one of this attempt's names cannot both be paths (`a` and `a/b`), or if
        another name of the attempt's job differs from `name` only by case or Unicode normalisation (`fold_name`)."""
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
        # Names are free of control characters (`check_name`), so GLOB '*[^ -~]*' is "not ASCII".
        twin = self.db.execute(
            "SELECT r.name FROM attempts a JOIN records r ON r.job_id=a.job_id WHERE a.attempt_id=? AND r.name<>?"
            " AND (CASE WHEN r.name GLOB '*[^ -~]*' THEN dflash_fold_name(r.name) ELSE lower(r.name) END) = ? LIMIT 1",
            (attempt_id, name, fold_name(name)),
        ).fetchone()
        if twin is not None:
            raise InvalidRequestError(
                f"artifact `{escape_name(name)}` differs from this job's artifact `{escape_name(twin[0])}` only by case or Unicode normalisation: "
                "a case- or normalisation-insensitive disk (macOS, Windows) would store both as one file\n"
                f"hint: upload it as `{escape_name(twin[0])}`, exactly as spelled before"
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

    def drop_loose_checkpoint_files(self, db, attempt_id: str) -> None:
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

    def succeeded_attempt(self, job_id: str) -> tuple[str, int] | None:
        r = self.db.execute("SELECT attempt_id, number FROM attempts WHERE job_id=? AND state='succeeded' ORDER BY number DESC LIMIT 1", (job_id,)).fetchone()
        return None if r is None else (r[0], r[1])

    def list_artifacts(self, job_id: str, *, all_attempts: bool, page_size: int = 0, page_token: str = "") -> tuple[list[StoredArtifact], str]:
        """A job's final artifacts (its SUCCEEDED attempt's) or every attempt's (newest attempt first); one page."""
        size, after = page(page_size, page_token)
        where, params = "r.job_id=?", [job_id]
        if not all_attempts:
            final = self.succeeded_attempt(job_id)
            if final is None:
                return [], ""
            where, params = "r.attempt_id=?", [final[0]]
        # Paged by seq; newest attempt first means ordering by (attempt DESC, seq), so the token holds a rank.
        rows = self.db.execute(
            f"SELECT r.seq, {', '.join('r.' + c.strip() for c in REC_COLS.split(','))}, a.state, r.created_unix FROM records r"
            f" JOIN attempts a ON a.attempt_id=r.attempt_id WHERE {where} ORDER BY r.attempt DESC, r.seq LIMIT ? OFFSET ?",
            (*params, size + 1, after),
        ).fetchall()
        out = [StoredArtifact(job_id=job_id, attempt=r[8], attempt_state=r[9], record=record_from_row(r[1:9]), created_unix=r[10]) for r in rows[:size]]
        return out, (f"s{after + size}" if len(rows) > size else "")

    def find_record(self, job_id: str, name: str, sha256: str = "", *, final_only: bool = False) -> ArtifactRecord:
        """A job's record of `name` (with `sha256`, any attempt's; else the SUCCEEDED attempt's); NOT_FOUND otherwise.

        The message is the same whether the name, the digest or the attempt is
        what is missing, so a caller learns nothing about records it cannot fetch.
        """
        if sha256 and not final_only:
            r = self.db.execute(
                f"SELECT {REC_COLS} FROM records WHERE job_id=? AND name=? AND sha256=? ORDER BY seq DESC LIMIT 1", (job_id, name, sha256)
            ).fetchone()
        else:
            final = self.succeeded_attempt(job_id)
            r = None
            if final is not None:
                r = self.db.execute(
                    f"SELECT {REC_COLS} FROM records WHERE attempt_id=? AND name=?" + (" AND sha256=?" if sha256 else ""),
                    (final[0], name, *((sha256,) if sha256 else ())),
                ).fetchone()
        if r is None:
            raise NotFoundError(f"job `{job_id}` has no artifact `{name[:200]}`" + (f" with sha256 `{sha256}`" if sha256 else " from a succeeded attempt"))
        return record_from_row(r)

    def last_checkpoint(self, job_id: str) -> ArtifactRecord | None:
        """The job's newest committed checkpoint, by any attempt (highest step, then latest recorded)."""
        r = self.db.execute(
            f"SELECT {REC_COLS} FROM records WHERE job_id=? AND kind='checkpoint' ORDER BY step DESC, seq DESC LIMIT 1", (job_id,)
        ).fetchone()
        return None if r is None else record_from_row(r)

    def has_final_export(self, job_id: str) -> bool:
        final = self.succeeded_attempt(job_id)
        return final is not None and self.db.execute("SELECT 1 FROM records WHERE attempt_id=? AND kind='export' LIMIT 1", (final[0],)).fetchone() is not None
