"""Build and run the coordinator's gRPC server (grpc.aio, one event loop).

`serve()` reads and checks the TLS files, locks and opens the database (a second
coordinator on the same database is refused: `store.ServeLock`), makes sure an
admin token exists, binds the listen address (TLS when a certificate is
given; plaintext only on loopback unless `insecure`), reports the bound
address through `on_ready`, expires leases on a timer and stops cleanly on
SIGINT/SIGTERM. One asyncio event loop serves every call, so thousands of
open heartbeat streams cost coroutines, not threads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from ..errors import ConfigError, DflashError
from ..proto.dflash.v1 import admin_pb2_grpc, provider_pb2_grpc
from .artifacts.blobs import BlobStore, LocalBlobStore, open_blob_store
from .artifacts.publish import PublishGate
from .artifacts.staging import Staging
from .auth import DEFAULT_FAILURE_LIMIT, DEFAULT_FAILURE_WINDOW, AuthInterceptor, FailureLimiter, Gate
from .grpc import DEFAULT_UPLOAD_IDLE_SECONDS, AdminService, Artifacts, ProviderService, WorkSignal
from .store import Quotas, ServeLock, Store, new_token
from .tls import ServerTls, is_loopback, load_server_tls
from .web import Metrics, SnapshotProcess, StatusApp, WebConfig, server_ssl_context, start_web

if TYPE_CHECKING:
    from aiohttp.web import AppRunner

log = logging.getLogger("dflash_worker.coordinator")

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """Everything `dflash-coordinator serve` takes."""

    db: Path
    listen: str = "127.0.0.1:50051"
    # Where blobs live: a directory (default `artifacts/` next to the database) or
    # `s3://BUCKET[/PREFIX]`; staging is always `staging/` next to the database.
    artifact_store: str | None = None
    s3_endpoint_url: str | None = None
    quotas: Quotas = field(default_factory=Quotas)
    keep_checkpoints: int = 2
    upload_idle_seconds: float = DEFAULT_UPLOAD_IDLE_SECONDS
    lease_ttl: float = 30.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_wait: float = 30.0
    retry_after: int = 5
    max_attempts: int = 5
    # Seconds between expiry sweeps (None: a quarter of the TTL, at most 1 s).
    # Expiry is also checked whenever a lease is used, so this only bounds how
    # long an abandoned job waits before another provider can take it.
    expiry_interval: float | None = None
    admin_token: str | None = None
    admin_token_file: Path | None = None
    # TLS: certificate chain and key (PEM); with `tls_client_ca`, mutual TLS.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    # Serve plaintext on a non-loopback address (logs a warning).
    insecure: bool = False
    # Failed authentications per peer address allowed in a window (0: no limit).
    auth_failure_limit: int = DEFAULT_FAILURE_LIMIT
    auth_failure_window: float = DEFAULT_FAILURE_WINDOW
    # The status page and /metrics (HTTP beside gRPC; None: not served). TLS when `tls_cert` is given.
    http_listen: str | None = None
    viewer_token: str | None = None
    viewer_token_file: Path | None = None
    page_refresh_seconds: float = 2.0
    extra_options: tuple = field(default=())

    def __post_init__(self):
        if self.lease_ttl <= 0:
            raise ConfigError(f"`--lease-ttl` must be positive, got {self.lease_ttl}")
        if not 1024 <= self.max_message_bytes <= 1 << 30:
            raise ConfigError(f"`--max-message-bytes` must be between 1024 and 2**30, got {self.max_message_bytes}")
        if self.expiry_interval is not None and self.expiry_interval <= 0:
            raise ConfigError(f"`--expiry-interval` must be positive, got {self.expiry_interval}")
        if self.max_wait < 0:
            raise ConfigError(f"`--max-wait` must be >= 0, got {self.max_wait}")
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"`--listen` must be HOST:PORT (port 0 picks a free one), got `{self.listen}`")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("`--tls-cert` and `--tls-key` go together\nhint: pass both to serve TLS")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("`--tls-client-ca` (mutual TLS) needs `--tls-cert` and `--tls-key`")
        if self.tls_cert is None and not self.insecure and not is_loopback(host):
            raise ConfigError(
                f"refusing to serve plaintext on `{self.listen}`, which is not a loopback address: bearer tokens would cross the network in the clear\n"
                "hint: pass `--tls-cert` and `--tls-key` (see docs/run-admin.md), or `--insecure` on a network you trust"
            )
        if self.upload_idle_seconds <= 0:
            raise ConfigError(f"`--upload-idle-timeout` must be positive, got {self.upload_idle_seconds}")
        if self.http_listen is not None:
            h_host, h_sep, h_port = self.http_listen.rpartition(":")
            if not h_sep or not h_host or not h_port.isdigit() or int(h_port) > 65535:
                raise ConfigError(f"`--http-listen` must be HOST:PORT (port 0 picks a free one), got `{self.http_listen}`")
            if self.tls_cert is None and not self.insecure and not is_loopback(h_host.strip("[]")):
                raise ConfigError(
                    f"refusing to serve the status page over plain HTTP on `{self.http_listen}`, which is not a loopback address: tokens would cross the network in the clear\n"
                    "hint: pass `--tls-cert` and `--tls-key` (the page is then HTTPS), or `--insecure` on a network you trust"
                )
        if not 0.2 <= self.page_refresh_seconds <= 3600:
            raise ConfigError(f"`--page-refresh` must be 0.2-3600 seconds, got {self.page_refresh_seconds}")
        if self.auth_failure_limit < 0 or self.auth_failure_window <= 0:
            raise ConfigError("`--auth-failure-limit` must be >= 0 and `--auth-failure-window` positive")

    @property
    def blob_url(self) -> str:
        return self.artifact_store or str(self.db.parent / "artifacts")

    @property
    def staging_dir(self) -> Path:
        return self.db.parent / "staging"

    @property
    def token_file(self) -> Path:
        return self.admin_token_file or self.db.parent / "admin-token"

    @property
    def viewer_file(self) -> Path:
        return self.viewer_token_file or self.db.parent / "viewer-token"

    def load_tls(self) -> ServerTls | None:
        """The checked TLS material, or None for plaintext (warned about off loopback)."""
        if self.tls_cert is None:
            if not is_loopback(self.listen.rpartition(":")[0]):
                log.warning("serving plaintext on `%s` (--insecure): tokens and job specs cross the network in the clear", self.listen)
            return None
        return load_server_tls(self.tls_cert, self.tls_key, self.tls_client_ca)


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path` atomically with mode 0600 (never readable by others, even briefly)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def ensure_admin_token(store: Store, token: str | None, token_file: Path) -> str:
    """Install the admin token; return how it was set ("given", "file" or "generated").

    A token given on the command line or in the environment replaces the stored
    one. Otherwise the token in `token_file` is kept if it matches the database;
    if not (first start, or the file was lost), a new token is generated and
    written there with mode 0600.
    """
    if token:
        store.credentials.set_admin_token(token)
        return "given"
    if store.credentials.has_admin_token() and token_file.is_file():
        existing = token_file.read_text().strip()
        p = store.credentials.principal(existing)
        if p is not None and p.admin:
            return "file"
    fresh = new_token()
    _write_private(token_file, fresh + "\n")
    store.credentials.set_admin_token(fresh)
    return "generated"


def ensure_viewer_token(store: Store, token: str | None, token_file: Path) -> str:
    """Install the status page's read-only viewer token, as `ensure_admin_token` does the admin's."""
    if token:
        store.credentials.set_viewer_token(token)
        return "given"
    if store.credentials.has_viewer_token() and token_file.is_file():
        if store.credentials.web_role(token_file.read_text().strip()) == "viewer":
            return "file"
    fresh = new_token()
    _write_private(token_file, fresh + "\n")
    store.credentials.set_viewer_token(fresh)
    return "generated"


@dataclass(frozen=True, kw_only=True)
class _Parts:
    """What the gRPC services, the status page and the periodic tasks share."""

    store: Store
    blobs: BlobStore
    artifacts: Artifacts
    work: WorkSignal
    limiter: FailureLimiter
    metrics: Metrics
    publisher: PublishGate


@dataclass(frozen=True, kw_only=True)
class _Web:
    """The status page's server, once it listens."""

    runner: AppRunner
    snapshots: SnapshotProcess
    address: str
    viewer_how: str


async def serve(
    config: ServeConfig,
    *,
    on_ready: Callable[[dict], None] = lambda info: None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run the coordinator until SIGINT/SIGTERM (or `stop` is set)."""
    tls = config.load_tls()
    work = WorkSignal()
    lock, store = _open_store(config, work)
    try:
        how = ensure_admin_token(store, config.admin_token, config.token_file)
        parts = await _parts(config, store, work)
        server, port = await _start_grpc(config, tls, parts)
        web = await _start_status_page(config, tls, parts, server) if config.http_listen is not None else None
        # Requeue whatever expired while the coordinator was down; decide on exports it left undecided.
        store.jobs.expire_due()
        await parts.publisher.catch_up()
        on_ready(_ready_info(config, tls, port=port, blobs=parts.blobs, how=how, web=web))
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError, ValueError):
                pass  # not the main thread (tests drive `stop` instead)
        store.database.checkpoint_in_background()
        tasks = _start_periodic(config, parts)
        try:
            await stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            if web is not None:
                await web.runner.cleanup()
                await web.snapshots.close()
            await server.stop(grace=1.0)
    finally:
        store.close()
        lock.release()


def _open_store(config: ServeConfig, work: WorkSignal) -> tuple[ServeLock, Store]:
    """Lock the database, then open (and migrate) it: one coordinator per database, from before it is
    opened until it is closed. The caller releases the lock."""
    lock = ServeLock(config.db).acquire()
    try:
        store = Store(
            config.db,
            lease_ttl=config.lease_ttl,
            max_attempts=config.max_attempts,
            on_work=work.notify,
            quotas=config.quotas,
            keep_checkpoints=config.keep_checkpoints,
            # An idle provider asks again at least every long poll plus its retry delay.
            live_seconds=max(2 * config.lease_ttl, 2 * (config.max_wait + config.retry_after)),
        )
    except BaseException:
        lock.release()
        raise
    return lock, store


async def _parts(config: ServeConfig, store: Store, work: WorkSignal) -> _Parts:
    """The blob store (checked usable), the upload engine and what the services share over `store`."""
    blobs = open_blob_store(config.blob_url, s3_endpoint_url=config.s3_endpoint_url)
    try:
        await asyncio.to_thread(blobs.check)
    except DflashError as exc:
        raise ConfigError(f"artifact store {blobs.describe} is not usable: {exc}") from None
    staging = Staging(config.staging_dir, blob_dir=blobs.root if isinstance(blobs, LocalBlobStore) else None)
    artifacts = Artifacts(store, blobs, staging, idle_seconds=config.upload_idle_seconds)
    limiter = FailureLimiter(limit=config.auth_failure_limit, window=config.auth_failure_window)
    return _Parts(
        store=store, blobs=blobs, artifacts=artifacts, work=work, limiter=limiter, metrics=Metrics(store, artifacts), publisher=PublishGate(store, blobs)
    )


async def _start_grpc(config: ServeConfig, tls: ServerTls | None, parts: _Parts) -> tuple[grpc.aio.Server, int]:
    """Both services behind the auth interceptor, listening; returns the server and its bound port."""
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        # Refuse to share a port with another process instead of silently
        # splitting traffic with it.
        ("grpc.so_reuseport", 0),
        *config.extra_options,
    ]
    store, artifacts = parts.store, parts.artifacts
    gate = Gate(store.credentials.authenticate, parts.limiter, mtls=tls is not None and tls.mtls)
    server = grpc.aio.server(interceptors=[AuthInterceptor(gate)], options=options)
    provider = ProviderService(
        store, artifacts, parts.work, max_wait=config.max_wait, retry_after=config.retry_after, gate=parts.publisher,
        heartbeat_latency=parts.metrics.heartbeat_latency,
    )  # fmt: skip
    provider_pb2_grpc.add_ProviderServiceServicer_to_server(provider, server)
    admin_pb2_grpc.add_AdminServiceServicer_to_server(AdminService(store, artifacts, parts.publisher), server)
    try:
        port = server.add_secure_port(config.listen, tls.credentials()) if tls else server.add_insecure_port(config.listen)
    except RuntimeError as exc:
        raise ConfigError(f"cannot listen on `{config.listen}`: {exc}\nhint: is another coordinator running there?") from None
    if not port:
        raise ConfigError(f"cannot listen on `{config.listen}`\nhint: is another coordinator running there?")
    await server.start()
    return server, port


async def _start_status_page(config: ServeConfig, tls: ServerTls | None, parts: _Parts, server: grpc.aio.Server) -> _Web:
    """The status page and `/metrics` on `config.http_listen`; stops `server` when it cannot listen."""
    assert config.http_listen is not None
    viewer_how = ensure_viewer_token(parts.store, config.viewer_token, config.viewer_file)
    snapshots = SnapshotProcess(config.db)
    web_config = WebConfig(refresh_ms=int(config.page_refresh_seconds * 1000), secure=tls is not None)
    status_app = StatusApp(parts.store, parts.artifacts, parts.metrics, parts.limiter, snapshots, web_config)
    ssl_context = server_ssl_context(config.tls_cert, config.tls_key) if tls is not None else None
    try:
        runner, http_port = await start_web(status_app, config.http_listen, ssl_context)
    except OSError as exc:
        await server.stop(grace=None)
        raise ConfigError(f"cannot listen on `{config.http_listen}` (--http-listen): {exc.strerror or exc}") from None
    address = f"{'https' if tls else 'http'}://{config.http_listen.rpartition(':')[0]}:{http_port}"
    return _Web(runner=runner, snapshots=snapshots, address=address, viewer_how=viewer_how)


def _ready_info(config: ServeConfig, tls: ServerTls | None, *, port: int, blobs: BlobStore, how: str, web: _Web | None) -> dict:
    """What `on_ready` reports: the bound addresses and where each token came from (one JSON line on stdout)."""
    viewer_how = None if web is None else web.viewer_how
    return {
        "event": "listening",
        "address": f"{config.listen.rpartition(':')[0]}:{port}",
        "pid": os.getpid(),
        "db": str(config.db),
        "artifacts": blobs.describe,
        "admin_token": how,
        "admin_token_file": None if how == "given" else str(config.token_file),
        "tls": tls is not None,
        "mtls": tls is not None and tls.mtls,
        "http_address": None if web is None else web.address,
        "viewer_token": viewer_how,
        "viewer_token_file": None if viewer_how in (None, "given") else str(config.viewer_file),
    }


def _start_periodic(config: ServeConfig, parts: _Parts) -> list[asyncio.Task]:
    """Lease expiry, the artifact janitor and WAL checkpoints, each on its own timer until cancelled."""
    store = parts.store
    interval = config.expiry_interval or max(0.05, min(config.lease_ttl / 4, 1.0))

    async def expire() -> None:
        store.jobs.expire_due()

    async def checkpoint_wal() -> None:
        # WAL checkpoints (the database's only fsyncs) on a thread, never inside a commit on the loop.
        await asyncio.to_thread(store.database.checkpoint_wal)

    return [
        asyncio.create_task(every(interval, expire, "lease expiry failed")),
        # Blobs of rotated checkpoints, staged uploads of ended or idle attempts.
        asyncio.create_task(every(min(5.0, config.upload_idle_seconds), parts.artifacts.collect_garbage, "artifact garbage collection failed")),
        asyncio.create_task(every(1.0, checkpoint_wal, "database checkpoint failed")),
    ]


async def every(seconds: float, step: Callable[[], Awaitable[object]], failure: str) -> None:
    """Await `step()` every `seconds` until cancelled; a step that raises is logged as `failure` and the next tick retries."""
    while True:
        await asyncio.sleep(seconds)
        try:
            await step()
        except Exception:  # noqa: BLE001 - keep serving; the next tick retries
            log.exception(failure)
