"""`Store`: one coordinator database and the parts over it, built in dependency order.

Callers name the part they need (`store.leases.acquire(...)`, `store.runs.get_run(...)`): each
method lives in one part, and `Store` itself holds only the parts and the connection.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from ...errors import ConfigError
from .credentials import Credentials
from .db import Database
from .jobs import Jobs
from .leases import Leases
from .providers import Providers
from .publications import Publications
from .reader import StoreReader
from .records import Quotas, Records
from .runs import Runs


class Store(StoreReader):
    """SQLite-backed coordinator state. Not thread-safe: use it from one thread.

    Parts (each its own module): `credentials` (tokens, principals), `providers` (registration),
    `runs` (runs and their jobs), `jobs` (job and attempt state changes), `leases`, `records`
    (artifacts and quotas), `publications` (the regression gate). They share one connection
    (`db`) and one transaction helper (`database.tx`).
    """

    def __init__(
        self,
        path: Path,
        *,
        lease_ttl: float = 30.0,
        max_attempts: int = 5,
        clock: Callable[[], float] = time.time,
        on_work: Callable[[], None] | None = None,
        quotas: Quotas | None = None,
        keep_checkpoints: int = 2,
        live_seconds: float | None = None,
    ):
        if lease_ttl <= 0:
            raise ConfigError(f"`--lease-ttl` must be positive, got {lease_ttl}")
        # A provider counts as live for `runs show`'s waiting reasons when it asked for work this
        # recently (a long poll refreshes it) or holds a live lease.
        live_seconds = float(live_seconds) if live_seconds is not None else max(2 * lease_ttl, 60.0)
        if max_attempts < 1:
            raise ConfigError(f"`--max-attempts` must be at least 1, got {max_attempts}")
        quotas = quotas or Quotas()
        if keep_checkpoints < 1:
            raise ConfigError(f"`--keep-checkpoints` must be at least 1, got {keep_checkpoints}")
        self.database = database = Database(path, clock=clock, on_work=on_work or (lambda: None))
        self.path = database.path
        self.db = database.conn
        self.records = Records(database, quotas=quotas, keep_checkpoints=int(keep_checkpoints))
        self.providers = Providers(database, live_seconds=live_seconds)
        self.runs = Runs(database, providers=self.providers, records=self.records)
        self.publications = Publications(database, runs=self.runs, records=self.records)
        self.jobs = Jobs(database, records=self.records, max_attempts=int(max_attempts))
        self.leases = Leases(
            database, lease_ttl=float(lease_ttl), runs=self.runs, providers=self.providers, jobs=self.jobs, records=self.records
        )
        self.credentials = Credentials(database, providers=self.providers, jobs=self.jobs)

    def close(self) -> None:
        self.database.close()

