"""The coordinator: runs, jobs, leases, version policy and artifacts over gRPC (`dflash.v1`).

`serve` runs it (`server.py`); `AdminClient` talks to a running one (`client.py`); `Store`
holds its state in SQLite (`store/`). The rest, by what it serves:

- `grpc/`: the two services (`ProviderService`, `AdminService`), the upload engine they share
  and the record <-> protobuf converters;
- `artifacts/`: artifact names and checks, the upload staging area, the blob store, direct I/O
  and the regression gate that decides what is published;
- `web/`: the status page, its snapshot process and the Prometheus metrics;
- `auth.py` (tokens and the interceptor), `status.py` (errors <-> gRPC status codes),
  `policy.py` (versions, devices, placement), `tls.py`, `cli.py` + `cli_output.py`
  (`dflash-coordinator`).
"""

from .client import AdminClient
from .server import ServeConfig, serve
from .store import RunSpecData, Store

__all__ = ["AdminClient", "RunSpecData", "ServeConfig", "Store", "serve"]
