"""The coordinator database's one connection and its one transaction helper, shared by every part.

One process owns the database and uses one connection from its event-loop thread, so every
state change is a short serial transaction and no SQLite locking is needed beyond what
protects against a second process. The database runs in WAL mode with ``synchronous=NORMAL``:
a committed transaction survives the coordinator process being killed (only an OS crash or
power loss can drop the last few), which is the failure the restart test exercises.

Writes go through `Database.tx`: ``BEGIN IMMEDIATE`` takes the write lock up front (another
process holding it is waited for up to ``busy_timeout``, 5 s, then SQLite raises BUSY; nothing
retries), any exception rolls the transaction back and is raised again, and a normal exit
commits, whichever way the block is left (``continue`` and ``return`` included). It does not
nest: a part never opens one inside another. Reads, and the heartbeat's one-statement
updates, run in autocommit mode on the same connection.

At open the database also passes SQLite's ``quick_check`` or is refused, and its schema is
created or upgraded (`schema`). Only a path that does not exist (or a database with no tables)
becomes a new database, in one transaction; an existing file that is empty (0 bytes), has
tables but no schema version, or lacks a table its version has, is refused naming the file and
the tables, because ``CREATE TABLE IF NOT EXISTS`` would otherwise bring a dropped table back
empty and lose its rows without a word.

A serving coordinator also holds `ServeLock` on ``FILE.lock`` beside the database, so a second
coordinator on the same database is refused (two would lease the same job twice).
"""

from __future__ import annotations

import collections
import fcntl
import os
import re
import secrets
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ...errors import ConfigError, InvalidRequestError
from .schema import MIGRATIONS, SCHEMA, SCHEMA_AFTER_MIGRATIONS, SCHEMA_VERSION

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1_000

# The schema version that created each table of `SCHEMA` (the migration to that version relies on
# `SCHEMA` creating it): a database of an older version may lack the newer ones. A table missing
# here counts as created by the current version (`test_store_guard` checks that none is missing).
TABLES_SINCE = {
    "meta": 1, "runs": 1, "approved_versions": 1, "providers": 1, "jobs": 1, "attempts": 1,
    "retired_tokens": 2, "records": 3, "publications": 4, "job_deps": 5, "placements": 6, "attempt_inputs": 7,
    "audit_log": 9,
}  # fmt: skip


def schema_tables() -> list[str]:
    """The tables `SCHEMA` creates, in order."""
    return re.findall(r"CREATE TABLE IF NOT EXISTS (\w+)", SCHEMA)


def refuse_empty_file(path: Path) -> None:
    """ConfigError if `path` is an existing empty file: SQLite would take it for a new database.

    The coordinator never leaves one (it creates a database whole, in one transaction), so an
    empty file at the path is someone else's: a truncated copy, or the wrong path.
    """
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"cannot open coordinator database `{path}`: {exc.strerror or exc}") from None
    if size == 0 and path.is_file():
        raise ConfigError(
            f"coordinator database `{path}` is an empty file (0 bytes), not a coordinator database: a truncated copy, or the wrong path\n"
            "hint: restore it from a backup, or remove the empty file (or pass `--db` a path that does not exist) to start a new database"
        )


class ServeLock:
    """An exclusive `flock` on ``FILE.lock`` beside the database, held while a coordinator serves it.

    A second coordinator on the same database is refused, naming the holder's pid (written into
    the lock file). The kernel drops the lock when the holder's file is closed or its process
    ends however it ends (SIGKILL included), so a stale lock file never blocks a restart. The
    lock file is named after the database's real path (symlinks resolved) and is never deleted:
    deleting it would let a waiter lock a file the next coordinator no longer opens.
    """

    def __init__(self, db_path: Path):
        self.db_path = Path(db_path)
        real = Path(os.path.realpath(self.db_path))
        self.path = real.with_name(real.name + ".lock")
        self._fd: int | None = None

    def acquire(self) -> ServeLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ConfigError(
                f"cannot create the lock file `{self.path}` of coordinator database `{self.db_path}`: {exc.strerror or exc}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            who = f"pid {holder}" if holder.isdigit() else "a process that has not written its pid yet"
            raise ConfigError(
                f"coordinator database `{self.db_path}` is in use by another coordinator ({who}, holding `{self.path}`)\n"
                "hint: one coordinator serves a database; stop the other one first (two would lease the same job twice)"
            ) from None
        except OSError as exc:
            os.close(fd)
            raise ConfigError(f"cannot lock `{self.path}` for coordinator database `{self.db_path}`: {exc.strerror or exc}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Database:
    """The connection (`conn`), the transaction helper (`tx`), the clock and the counters the parts share."""

    def __init__(self, path: Path, *, clock: Callable[[], float], on_work: Callable[[], None]):
        self.path = Path(path)
        self.clock = clock
        # Called after a change that may give a waiting provider work (long polls wake on it).
        self.on_work = on_work
        # Event counts since this process started (`metrics` exposes them): leases_granted,
        # heartbeats, attempt_<state> for each attempt that ended.
        self.counts: collections.Counter[str] = collections.Counter()
        self._ckpt_lock = threading.Lock()
        self._ckpt_db: sqlite3.Connection | None = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        refuse_empty_file(self.path)
        try:
            self.conn = sqlite3.connect(str(self.path), isolation_level=None)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self.conn.execute("PRAGMA foreign_keys=ON")
            self.conn.execute("PRAGMA busy_timeout=5000")
            problems = [r[0] for r in self.conn.execute("PRAGMA quick_check(5)")]
            if problems != ["ok"]:
                raise ConfigError(
                    f"coordinator database `{self.path}` is damaged (SQLite quick_check: {'; '.join(problems)[:400]})\n"
                    "hint: restore it from a backup; the coordinator will not run on a damaged database"
                )
            tables = {r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if not tables:
                # A new database (or one whose creation never committed): every table and the version in one transaction.
                self.conn.executescript(
                    f"BEGIN IMMEDIATE;{SCHEMA}INSERT INTO meta(key, value) VALUES ('schema_version', '{SCHEMA_VERSION}');COMMIT;"
                )
            else:
                version = self._stored_version(tables)
                self._check_tables(version, tables)
                # Tables of versions after `version` are created here; the migrations fill them.
                self.conn.executescript(SCHEMA)
                self._migrate(version)
            self.conn.executescript(SCHEMA_AFTER_MIGRATIONS)
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"cannot open coordinator database `{self.path}`: {exc}") from None

    def _stored_version(self, tables: set[str]) -> int:
        """The schema version of an existing database; refused when it has none or a newer one."""
        row = self.conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() if "meta" in tables else None
        if row is None:
            found = ", ".join(f"`{t}`" for t in sorted(tables)[:8]) + (", ..." if len(tables) > 8 else "")
            raise ConfigError(
                f"coordinator database `{self.path}` has tables ({found}) but no schema version: it is not a database this coordinator wrote\n"
                "hint: pass `--db` a path that does not exist yet to start a new coordinator database"
            )
        try:
            version = int(str(row[0]).strip())
        except ValueError:
            raise ConfigError(
                f"coordinator database `{self.path}` has a malformed schema version `{str(row[0])[:40]}`\n"
                "hint: this is not a database this coordinator wrote, or it was edited by hand"
            ) from None
        if version > SCHEMA_VERSION or (version < SCHEMA_VERSION and version not in MIGRATIONS):
            raise ConfigError(
                f"coordinator database `{self.path}` has schema version {version}, this coordinator uses {SCHEMA_VERSION}"
                + ("\nhint: it was written by a newer coordinator; run that one" if version > SCHEMA_VERSION else "")
            )
        return version

    def _check_tables(self, version: int, tables: set[str]) -> None:
        """Refuse a database that lacks a table its schema version has (dropped, or a damaged copy).

        `SCHEMA` creates missing tables, so without this a dropped table would come back empty
        and its rows (runs, records, tokens) would be lost without a word.
        """
        missing = sorted(t for t in schema_tables() if t not in tables and TABLES_SINCE.get(t, SCHEMA_VERSION) <= version)
        if missing:
            raise ConfigError(
                f"coordinator database `{self.path}` (schema version {version}) lacks the table{'s' if len(missing) > 1 else ''} "
                f"{', '.join(f'`{t}`' for t in missing)}: it was damaged or edited by hand\n"
                "hint: restore it from a backup; the coordinator will not recreate a table empty, which would lose its rows without a word"
            )

    def _migrate(self, version: int) -> None:
        """Upgrade a database at schema `version` (checked by `_stored_version`) to SCHEMA_VERSION in one transaction."""
        if version == SCHEMA_VERSION:
            return
        with self.tx() as db:
            while version < SCHEMA_VERSION:
                MIGRATIONS[version](db)
                version += 1
            db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(version),))

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (``BEGIN IMMEDIATE`` ... ``COMMIT``; ``ROLLBACK`` on any exception)."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def close(self) -> None:
        with self._ckpt_lock:
            if self._ckpt_db is not None:
                self._ckpt_db.close()
                self._ckpt_db = None
        self.conn.close()

    def checkpoint_in_background(self) -> None:
        """Stop this connection's automatic WAL checkpoints: the caller runs `checkpoint_wal` off the loop.

        In WAL mode with ``synchronous=NORMAL`` a commit does not fsync; the checkpoint
        that copies the WAL into the database does, and by default it runs inside whichever
        commit crosses 1,000 pages: a heartbeat's, on the event loop, behind every dirty page
        an upload left for the disk. The server calls `checkpoint_wal` from a thread instead.
        """
        self.conn.execute("PRAGMA wal_autocheckpoint=0")

    def checkpoint_wal(self) -> tuple[int, int, int]:
        """One PASSIVE WAL checkpoint on a connection of its own (never waits for writers); SQLite's
        `(busy, wal pages, pages checkpointed)`. Safe from any one thread at a time."""
        with self._ckpt_lock:
            if self._ckpt_db is None:
                self._ckpt_db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
                self._ckpt_db.execute("PRAGMA busy_timeout=5000")
            busy, log, done = self._ckpt_db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            return int(busy), int(log), int(done)


class Part:
    """One aggregate's queries over the shared `Database`: `db` (the connection) to read, `_tx()` to write."""

    def __init__(self, database: Database):
        self.database = database
        self.db = database.conn
        self.clock = database.clock
        self.on_work = database.on_work
        self.counts = database.counts

    def _tx(self):
        return self.database.tx()


def page(page_size: int, page_token: str) -> tuple[int, int]:
    """`(size, after_seq)` of a page request; INVALID_ARGUMENT on a token this server did not hand out."""
    size = DEFAULT_PAGE_SIZE if page_size == 0 else min(page_size, MAX_PAGE_SIZE)
    if not page_token:
        return size, 0
    if len(page_token) > 24 or not page_token.startswith("s") or not page_token[1:].isdigit():
        raise InvalidRequestError(f"`page_token` `{page_token[:40]}` is not one this coordinator handed out")
    return size, int(page_token[1:])


def next_token(rows: list, size: int) -> str:
    """The next page's token when `rows` (fetched with LIMIT size+1, `seq` first) has more."""
    return f"s{rows[size - 1][0]}" if len(rows) > size else ""


def printable(text: str) -> str:
    """`text` with control characters replaced by `?` (newlines kept): it reaches an admin's terminal."""
    return "".join(c if c == "\n" or not (ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0) else "?" for c in text)


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(8)}"
