"""The coordinator: runs, jobs, leases, version policy and artifacts over gRPC (`dflash.v1`).

`serve` runs it (see `server.py`); `AdminClient` talks to a running one;
`Store` holds its state in SQLite.
"""

from .client import AdminClient
from .server import ServeConfig, serve
from .store import RunSpecData, Store

__all__ = ["AdminClient", "RunSpecData", "ServeConfig", "Store", "serve"]
