"""The coordinator database is refused when it is not whole, and served by one coordinator at a time.

Issue 34: a 0-byte file or a database with a dropped table used to start silently (SQLite takes
an empty file for a new database, and ``CREATE TABLE IF NOT EXISTS`` brings a dropped table back
empty), and a second coordinator on the same database used to start beside the first. Each case
runs the real `dflash-coordinator serve` process on a real SQLite file; only a path that does
not exist becomes a new database.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

import pytest
from coordinator_helpers import subprocess_env

from dflash_worker.coordinator.store import SCHEMA_VERSION, RunSpecData, ServeLock, Store
from dflash_worker.coordinator.store.db import TABLES_SINCE, schema_tables
from dflash_worker.errors import ConfigError


def _serve(db, *extra: str, timeout: float = 30) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dflash_worker.coordinator", "serve", "--db", str(db), "--listen", "127.0.0.1:0", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=timeout)


def _tables(path) -> set[str]:
    con = sqlite3.connect(path)
    try:
        return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    finally:
        con.close()


def _refused(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and r.stdout == "", r.stderr
    for n in needles:
        assert n in r.stderr, (n, r.stderr)


def test_an_empty_database_file_is_refused_and_left_empty(tmp_path):
    db = tmp_path / "coordinator.db"
    db.write_bytes(b"")
    _refused(_serve(db), f"coordinator database `{db}` is an empty file (0 bytes)", "hint:")
    assert db.stat().st_size == 0, "the refused file was written to"
    assert not (tmp_path / "admin-token").exists()
    with pytest.raises(ConfigError, match="empty file"):
        Store(db)
    assert db.stat().st_size == 0


def _populated(path) -> str:
    """A current database with a run in it; returns the run id."""
    store = Store(path)
    try:
        return store.runs.create_run(RunSpecData(name="kept", spec_json="{}", required_client_version="0.1.0", num_jobs=2)).run_id
    finally:
        store.close()


def test_a_database_with_dropped_tables_is_refused_naming_them(tmp_path):
    db = tmp_path / "coordinator.db"
    run_id = _populated(db)
    con = sqlite3.connect(db, isolation_level=None)
    con.execute("DROP TABLE records")
    con.execute("DROP TABLE retired_tokens")
    con.close()
    _refused(_serve(db), f"coordinator database `{db}`", f"schema version {SCHEMA_VERSION}", "lacks the tables `records`, `retired_tokens`")
    # Nothing was recreated behind the refusal, and what is there is untouched.
    assert not {"records", "retired_tokens"} & _tables(db)
    con = sqlite3.connect(db)
    assert con.execute("SELECT run_id FROM runs").fetchall() == [(run_id,)]
    assert con.execute("SELECT COUNT(*) FROM jobs").fetchone() == (2,)
    con.close()
    with pytest.raises(ConfigError, match="lacks the tables `records`, `retired_tokens`"):
        Store(db)


def test_an_older_database_lacking_a_table_of_its_own_version_is_refused(tmp_path):
    """A version-4 database need not have `job_deps` (version 5) or `placements` (6), but must have `records` (3)."""
    db = tmp_path / "coordinator.db"
    _populated(db)
    con = sqlite3.connect(db, isolation_level=None)
    for t in [t for t, since in TABLES_SINCE.items() if since > 4] + ["records"]:
        con.execute(f"DROP TABLE IF EXISTS {t}")
    con.execute("UPDATE meta SET value='4' WHERE key='schema_version'")
    con.close()
    with pytest.raises(ConfigError, match=r"\(schema version 4\) lacks the table `records`:"):
        Store(db)


def test_a_database_without_a_schema_version_is_refused_and_left_alone(tmp_path):
    db = tmp_path / "someone-elses.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE notes (x)")
    con.execute("INSERT INTO notes VALUES ('mine')")
    con.commit()
    con.close()
    _refused(_serve(db), f"coordinator database `{db}` has tables (`notes`) but no schema version")
    assert _tables(db) == {"notes"}


def test_a_new_path_and_a_database_with_no_tables_become_new_databases(tmp_path):
    fresh = tmp_path / "sub" / "new.db"
    Store(fresh).close()
    assert set(schema_tables()) <= _tables(fresh)
    # A valid SQLite file with no tables yet (a creation cut short before its one transaction).
    bare = tmp_path / "bare.db"
    con = sqlite3.connect(bare, isolation_level=None)
    con.execute("PRAGMA journal_mode=WAL")
    con.close()
    assert bare.stat().st_size > 0
    store = Store(bare)
    try:
        assert store.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == (str(SCHEMA_VERSION),)
    finally:
        store.close()


def test_every_table_says_which_schema_version_created_it():
    assert [t for t in schema_tables() if t not in TABLES_SINCE] == []
    assert all(1 <= TABLES_SINCE[t] <= SCHEMA_VERSION for t in schema_tables())


@pytest.mark.real_process("coordinator")  # the lock names the pid of the serving process: the console script's own
def test_a_second_coordinator_on_the_same_database_is_refused_until_the_first_dies(start_coordinator, tmp_path):
    first = start_coordinator()
    pid = first.pid
    assert pid == first.proc.pid
    r = _serve(first.db)
    _refused(r, f"coordinator database `{first.db}` is in use by another coordinator (pid {pid}", f"{first.db}.lock")
    # The same file by another name (a symlink) is the same database.
    alias = tmp_path / "alias.db"
    alias.symlink_to(first.db)
    _refused(_serve(alias), f"is in use by another coordinator (pid {pid}")
    # The first one still serves.
    with first.admin() as admin:
        assert admin.list_runs() == []
    # SIGKILL: no cleanup ran, the kernel dropped the lock with the process.
    first.kill()
    second = start_coordinator(workdir=first.workdir)
    assert second.pid != pid
    with second.admin() as admin:
        assert admin.list_runs() == []
    assert (first.workdir / "coordinator.db.lock").read_text().strip() == str(second.pid)


def test_the_lock_is_released_when_serving_ends(tmp_path):
    db = tmp_path / "c.db"
    lock = ServeLock(db).acquire()
    with pytest.raises(ConfigError, match=f"pid {os.getpid()}"):
        ServeLock(db).acquire()
    lock.release()
    ServeLock(db).acquire().release()
