"""The coordinator's HTTP side (aiohttp, beside gRPC): the status page, its JSON, artifact downloads, `/metrics`.

- `app`: the routes, the viewer/admin token check and the server (`StatusApp`, `start_web`);
- `snapshot`: what the page shows, read from the database in a few bounded queries;
- `snapshot_proc`: the child process that builds and renders a snapshot off the event loop;
- `page`: the page's HTML, rendered from a snapshot;
- `metrics`: the Prometheus metrics served at `/metrics`.
"""

from .app import StatusApp, WebConfig, server_ssl_context, start_web
from .metrics import Metrics
from .snapshot_proc import SnapshotProcess

__all__ = ["Metrics", "SnapshotProcess", "StatusApp", "WebConfig", "server_ssl_context", "start_web"]
