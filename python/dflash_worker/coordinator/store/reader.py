"""What the status page reads (`StoreReader`), over the coordinator's connection or a read-only one.

`snapshot` runs its queries on `StoreReader.db`; the coordinator's `Store` is one reader, and so
is a read-only connection another process opens (`StoreReader.open`, `snapshot_proc`), which
writes nothing. A publication is read the same way by both and by the gate (`read_publication`).
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from ...errors import ConfigError


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


_PUB_COLS = "job_id, run_id, attempt_id, published, verdict, reason, evaluation_json, decided_unix, override_unix, override_note, override_peer"


def read_publication(db: sqlite3.Connection, job_id: str) -> PublicationRow | None:
    """The gate's decision on the job's export; None when it has none (no export, or not decided yet)."""
    r = db.execute(f"SELECT {_PUB_COLS} FROM publications WHERE job_id=?", (job_id,)).fetchone()
    if r is None:
        return None
    return PublicationRow(
        job_id=r[0], run_id=r[1], attempt_id=r[2], published=bool(r[3]), verdict=r[4], reason=r[5], evaluation=json.loads(r[6]),
        decided_unix=r[7], override_unix=r[8], override_note=r[9], override_peer=r[10],
    )  # fmt: skip


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

    def publication(self, job_id: str) -> PublicationRow | None:
        """The gate's decision on the job's export; None when it has none (no export, or not decided yet)."""
        return read_publication(self.db, job_id)
