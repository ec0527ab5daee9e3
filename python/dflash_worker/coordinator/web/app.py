"""The coordinator's read-only HTTP side: the status page, its JSON, artifact downloads and `/metrics`.

Why aiohttp in the coordinator's own process and event loop: the routes need its state
(the token store and the failure limiter shared with gRPC, the metrics, the artifact
store), and aiohttp is an asyncio HTTP/1.1 server with the limits a public endpoint needs
(request line and header sizes, header counts: over them a request is refused 400 before a
handler runs). The one heavy piece, the page's snapshot and its rendering, runs in a child
process on a read-only connection (`snapshot_proc`), so a refresh costs the event loop one
pipe round trip, whatever the page shows; one snapshot serves every open page for up to a
second. `bench/coordinator.py --modes page` measures what the page costs heartbeats.

Every route but the login form and the two static files needs a token: the admin token or
the read-only **viewer token** (`serve --viewer-token`, or generated into `viewer-token`
next to the database). A provider token is refused, and the viewer token is never a gRPC
credential. The token comes as `Authorization: Bearer TOKEN` (scripts, Prometheus) or from
the sign-in form, which sets it as an HttpOnly, SameSite=Strict cookie (Secure under TLS).
Failed tokens count towards the same per-address limit as gRPC's (`auth.FailureLimiter`).

Routes: `GET /` (the page), `GET /status.html` (the part the page refreshes), `GET
/api/status` (the same data as JSON), `GET /artifacts/RUN/JOB/NAME` (a final artifact's
bytes; an export only once published), `GET /metrics` (Prometheus text format), `GET|POST
/login`, `POST /logout`, `GET /page.js`, `GET /page.css`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import ssl
from dataclasses import dataclass

from aiohttp import web

from ...errors import DflashError, NotFoundError, PolicyError, RateLimitedError
from ..artifacts.names import CHUNK_BYTES, check_name
from ..auth import FailureLimiter, peer_key
from ..store import Store
from . import page
from .metrics import CONTENT_TYPE, Metrics
from .snapshot_proc import SnapshotProcess, SnapshotUnavailable

log = logging.getLogger("dflash_worker.coordinator")

COOKIE = "dflash_token"
ROLE = web.AppKey("role", str)
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
_PUBLIC = {"/login", "/logout", "/page.js", "/page.css"}


@dataclass(frozen=True, kw_only=True)
class WebConfig:
    refresh_ms: int = 2000
    secure: bool = False  # served over TLS: the cookie is Secure


def _redirect(location: str) -> web.Response:
    return web.Response(status=303, headers={"Location": location})


def _peer(request: web.Request) -> str:
    host = request.remote or "unknown"
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return host[:64]
    return peer_key(f"ipv{addr.version}:{'[' + host + ']' if addr.version == 6 else host}:0")


class StatusApp:
    """The aiohttp application over one coordinator's store, artifact service and metrics."""

    def __init__(self, store: Store, artifacts, metrics: Metrics, limiter: FailureLimiter, snapshots: SnapshotProcess, config: WebConfig = WebConfig()):
        self.store = store
        self.artifacts = artifacts
        self.metrics = metrics
        self.limiter = limiter
        self.config = config
        # Snapshots are built in a process of their own (`snapshot_proc`), never on this event loop.
        self.snapshots = snapshots
        # One snapshot (and its rendered HTML) serves every open page for `max_age` seconds, so
        # the page's cost does not grow with the number of people watching.
        self.max_age = min(1.0, config.refresh_ms / 2000)
        self._cached: tuple[float, bytes, str] | None = None  # (monotonic time, snapshot JSON, fragment HTML)
        self._lock = asyncio.Lock()

    async def _snapshot(self) -> tuple[bytes, str]:
        """(snapshot JSON, fragment HTML), at most `max_age` old; `SnapshotUnavailable` when the process fails."""
        loop = asyncio.get_running_loop()
        async with self._lock:
            if self._cached is None or loop.time() - self._cached[0] > self.max_age:
                snap_json, html = await self.snapshots.take()
                self._cached = (loop.time(), snap_json, html.decode())
            return self._cached[1], self._cached[2]

    async def _fragment(self) -> str:
        return (await self._snapshot())[1]

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._headers, self._auth], client_max_size=64 * 1024)
        app.router.add_get("/", self.index)
        app.router.add_get("/status.html", self.fragment)
        app.router.add_get("/api/status", self.api_status)
        app.router.add_get("/metrics", self.metrics_route)
        app.router.add_get("/artifacts/{run_id}/{job_id}/{name:.+}", self.download)
        app.router.add_get("/login", self.login_form)
        app.router.add_post("/login", self.login)
        app.router.add_post("/logout", self.logout)
        app.router.add_get("/page.js", lambda r: web.Response(text=page.JS, content_type="application/javascript"))
        app.router.add_get("/page.css", lambda r: web.Response(text=page.CSS, content_type="text/css"))
        return app

    # --- middleware -----------------------------------------------------

    @web.middleware
    async def _headers(self, request: web.Request, handler):
        try:
            resp = await handler(request)
        except web.HTTPException as exc:  # aiohttp's own: no route (404), wrong method (405), ...
            resp = web.Response(status=exc.status, text=f"{exc.status} {exc.reason}\n", content_type="text/plain")
        except SnapshotUnavailable as exc:
            log.warning("%s", exc)
            resp = web.Response(status=503, text=f"{exc}\n", content_type="text/plain", headers={"Retry-After": "1"})
        for k, v in _HEADERS.items():
            resp.headers.setdefault(k, v)
        return resp

    def _token(self, request: web.Request) -> str:
        auth = request.headers.get("Authorization", "")
        if auth:
            scheme, _, token = auth.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
        return request.cookies.get(COOKIE, "")

    def _refuse(self, request: web.Request, status: int, message: str) -> web.Response:
        if request.path == "/" and request.method == "GET" and status == 401 and "Authorization" not in request.headers:
            return _redirect("/login")
        if request.path.startswith("/api/"):
            return web.json_response({"error": message}, status=status)
        return web.Response(status=status, text=message + "\n", content_type="text/plain")

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if request.path in _PUBLIC:
            return await handler(request)
        peer = _peer(request)
        try:
            self.limiter.check(peer)
        except RateLimitedError as exc:
            return self._refuse(request, 429, str(exc).splitlines()[0])
        token = self._token(request)
        role = self.store.credentials.web_role(token) if token else None
        if role is None:
            if token:
                self.limiter.failed(peer)
                return self._refuse(request, 401, "token refused: it is not this coordinator's admin or viewer token")
            return self._refuse(request, 401, "a token is needed: sign in at /login, or send `Authorization: Bearer TOKEN`")
        request[ROLE] = role
        return await handler(request)

    # --- routes ---------------------------------------------------------

    async def index(self, request: web.Request) -> web.Response:
        html = page.render_page(await self._fragment(), role=request[ROLE], refresh_ms=self.config.refresh_ms)
        return web.Response(text=html, content_type="text/html")

    async def fragment(self, request: web.Request) -> web.Response:
        return web.Response(text=await self._fragment(), content_type="text/html")

    async def api_status(self, request: web.Request) -> web.Response:
        snap_json, _ = await self._snapshot()
        return web.Response(body=snap_json, content_type="application/json")

    async def metrics_route(self, request: web.Request) -> web.Response:
        resp = web.Response(body=self.metrics.exposition())
        resp.headers["Content-Type"] = CONTENT_TYPE
        return resp

    async def login_form(self, request: web.Request) -> web.Response:
        return web.Response(text=page.render_login(), content_type="text/html")

    async def login(self, request: web.Request) -> web.Response:
        peer = _peer(request)
        try:
            self.limiter.check(peer)
        except RateLimitedError as exc:
            return web.Response(status=429, text=page.render_login(str(exc).splitlines()[0]), content_type="text/html")
        form = await request.post()
        token = str(form.get("token", "")).strip()
        if self.store.credentials.web_role(token) is None:
            if token:
                self.limiter.failed(peer)
            return web.Response(status=401, text=page.render_login("token refused: it is not this coordinator's admin or viewer token"), content_type="text/html")
        resp = _redirect("/")
        resp.set_cookie(COOKIE, token, httponly=True, samesite="Strict", secure=self.config.secure, path="/")
        return resp

    async def logout(self, request: web.Request) -> web.Response:
        resp = _redirect("/login")
        resp.del_cookie(COOKIE, path="/")
        return resp

    async def download(self, request: web.Request) -> web.StreamResponse:
        run_id, job_id = request.match_info["run_id"], request.match_info["job_id"]
        try:
            name = check_name(request.match_info["name"])
            if self.store.runs.job_of(run_id, job_id) != job_id:
                raise NotFoundError(f"run `{run_id[:80]}` has no job `{job_id[:80]}`")
            record = self.store.records.find_record(job_id, name, final_only=True)
            if record.kind == "export":
                self.store.publications.check_published(run_id, job_id)
        except PolicyError as exc:
            return web.Response(status=409, text=str(exc) + "\n", content_type="text/plain")
        except NotFoundError as exc:
            return web.Response(status=404, text=str(exc).splitlines()[0] + "\n", content_type="text/plain")
        except DflashError as exc:
            return web.Response(status=400, text=str(exc).splitlines()[0] + "\n", content_type="text/plain")
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream", "Content-Length": str(record.size_bytes)})
        filename = name.rsplit("/", 1)[-1].replace('"', "")
        resp.headers["Content-Disposition"] = f'attachment; filename="{filename}"'
        resp.headers["X-Sha256"] = record.sha256
        chunks = await asyncio.to_thread(self.artifacts.blobs.read, record.sha256, 0, CHUNK_BYTES)
        await resp.prepare(request)
        it = iter(chunks)
        try:
            while (chunk := await asyncio.to_thread(next, it, None)) is not None:
                self.artifacts.bytes_out += len(chunk)
                await resp.write(chunk)
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                await asyncio.to_thread(close)
        await resp.write_eof()
        return resp


async def start_web(app: StatusApp, listen: str, ssl_context: ssl.SSLContext | None) -> tuple[web.AppRunner, int]:
    """Serve `app` on `listen` (HOST:PORT, port 0 picks one); returns the runner (to clean up) and the bound port."""
    host, _, port = listen.rpartition(":")
    runner = web.AppRunner(app.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host.strip("[]"), int(port), ssl_context=ssl_context, reuse_port=False)
    await site.start()
    return runner, int(runner.addresses[0][1])


def server_ssl_context(cert, key) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(cert), str(key))
    return ctx
