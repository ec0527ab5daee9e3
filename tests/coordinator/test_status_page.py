"""The status page over HTTP against a real coordinator: what it shows, its token rules, and hostile input
(wrong, missing and provider tokens, odd paths, huge headers, a guessing client). The browser test is
`test_status_browser.py`."""

from __future__ import annotations

import hashlib
import http.client
import json
import re
import socket
import urllib.parse
from pathlib import Path

import pytest
from coordinator_helpers import Provider, register_provider, run_spec
from launchers import wait_until
from test_publish import BETTER, WORSE, report, spec_json

from dflash_worker.coordinator.artifacts.publish import REPORT_NAME


@pytest.fixture
def coord(start_coordinator):
    return start_coordinator("--http-listen", "127.0.0.1:0", "--auth-failure-limit", "8", warm=True)


def hostport(coord) -> tuple[str, int]:
    u = urllib.parse.urlsplit(coord.info["http_address"])
    return u.hostname, u.port


def get(coord, path: str, *, token: str | None = None, cookie: str | None = None, method: str = "GET", body: bytes | None = None, headers=None):
    host, port = hostport(coord)
    c = http.client.HTTPConnection(host, port, timeout=10)
    h = dict(headers or {})
    if token is not None:
        h["Authorization"] = f"Bearer {token}"
    if cookie is not None:
        h["Cookie"] = f"dflash_token={cookie}"
    c.request(method, path, body=body, headers=h)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, dict(r.getheaders()), data


def viewer_token(coord) -> str:
    return Path(coord.info["viewer_token_file"]).read_text().strip()


def test_page_lists_runs_jobs_progress_providers_and_the_evaluation(coord, tmp_path):
    with coord.admin() as admin:
        p = Provider(coord.address, admin.create_provider("gpu-box-1"))
        running = admin.create_run(run_spec("running-run"))
        done = admin.create_run(run_spec("finished-run", spec_json=spec_json()))
    p.register(name="rig <b>7</b>")  # a name that would be markup if not escaped
    lease = p.acquire().lease
    assert lease.run_id == running.run_id
    hb = p.heartbeats()
    hb.send(lease.lease_id, step=2, metrics={"loss": 0.75, "tokens_per_s": 1234.5})
    status, headers, body = get(coord, "/", token=viewer_token(coord))
    page = body.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "running-run" in page and running.run_id in page and "finished-run" in page
    assert 'class="loss">0.7500<' in page and 'class="tps">1234.5<' in page and 'class="step">2/10<' in page
    assert "gpu-box-1" in page and "rig &lt;b&gt;7&lt;/b&gt;" in page and "<b>7</b>" not in page
    for k in ("Content-Security-Policy", "X-Content-Type-Options", "X-Frame-Options", "Referrer-Policy"):
        assert k in headers, headers
    hb.close()
    p.finish(lease.lease_id)

    # The finished run: its evaluation (table, counts, plot) and download links once published.
    lease = p.acquire().lease
    assert lease.run_id == done.run_id
    model = b"weights" * 1000
    p.upload(lease.lease_id, "run/export/model.safetensors", model, kind="export")
    p.upload(lease.lease_id, REPORT_NAME, report(BETTER), kind="report")
    p.finish(lease.lease_id)
    # One snapshot serves every page for up to a second (WebConfig.max_age): wait for the next one.
    def finished():
        snap = json.loads(get(coord, "/api/status", token=coord.admin_token)[2])
        return snap if any(r["run_id"] == done.run_id and r["state"] == "finished" for r in snap["runs"]) else None

    snap = wait_until(finished, timeout=10, interval=0.2)
    (run,) = [r for r in snap["runs"] if r["run_id"] == done.run_id]
    (job,) = run["jobs"]
    assert run["state"] == "finished" and job["publication"]["published"] and job["publication"]["verdict"] == "improved"
    ev = job["publication"]["evaluation"]
    assert ev["tau_trained"] > ev["tau_released"] and len(ev["per_position_trained"]) == 3
    assert {a["name"]: a["downloadable"] for a in job["artifacts"]} == {"run/export/model.safetensors": True, REPORT_NAME: True}
    frag = get(coord, "/status.html", token=coord.admin_token)[2].decode()
    assert 'class="evaluation"' in frag and 'class="counts"' in frag and "<svg class=\"plot\"" in frag and "export published" in frag
    href = f"/artifacts/{done.run_id}/{job['job_id']}/run/export/model.safetensors"
    assert f'href="{href}"' in frag
    status, headers, body = get(coord, href, token=viewer_token(coord))
    assert status == 200 and body == model and headers["X-Sha256"] == hashlib.sha256(model).hexdigest()
    (prov,) = snap["providers"]
    assert prov["identity"] == "gpu-box-1" and prov["device"]["backend"] == "cuda" and prov["client_version"] == "0.1.0"
    p.close()


def test_a_held_back_export_has_no_download_link_and_is_refused(coord):
    with coord.admin() as admin:
        p = Provider(coord.address, admin.create_provider("box"))
        run = admin.create_run(run_spec("worse", spec_json=spec_json()))
    p.register()
    lease = p.acquire().lease
    p.upload(lease.lease_id, "run/export/model.safetensors", b"bad weights", kind="export")
    p.upload(lease.lease_id, REPORT_NAME, report(WORSE), kind="report")
    p.finish(lease.lease_id)

    def held_back():
        frag = get(coord, "/status.html", token=coord.admin_token)[2].decode()
        return frag if "export not published" in frag else None

    frag = wait_until(held_back, timeout=10, interval=0.2)
    assert "export not published" in frag and "regressed: acceptance length" in frag
    assert "/artifacts/" + run.run_id + "/" + lease.job_id + "/run/export/model.safetensors" not in frag
    status, _, body = get(coord, f"/artifacts/{run.run_id}/{lease.job_id}/run/export/model.safetensors", token=coord.admin_token)
    assert status == 409 and b"is not published: regressed" in body
    assert get(coord, f"/artifacts/{run.run_id}/{lease.job_id}/{REPORT_NAME}", token=coord.admin_token)[0] == 200
    p.close()


def test_tokens_missing_wrong_provider_and_the_sign_in_cookie(coord):
    with coord.admin() as admin:
        provider_token = admin.create_provider("box")
    status, headers, _ = get(coord, "/")
    assert status == 303 and headers["Location"] == "/login"
    for path in ("/status.html", "/api/status", "/metrics", "/artifacts/r/j/x"):
        assert get(coord, path)[0] == 401, path
    for bad in ("not-a-token", "x" * 600, provider_token):
        for kw in ({"token": bad}, {"cookie": bad}):
            status, _, body = get(coord, "/api/status", **kw)
            assert status == 401 and b"token refused" in body, (kw, body)
    # Another scheme than Bearer is no token.
    assert get(coord, "/api/status", headers={"Authorization": f"Basic {coord.admin_token}"})[0] == 401

    # Sign in: a wrong token is refused on the form; a right one sets an HttpOnly, SameSite=Strict cookie.
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    status, _, body = get(coord, "/login", method="POST", body=b"token=wrong", headers=form)
    assert status == 401 and b"token refused" in body
    status, headers, _ = get(coord, "/login", method="POST", body=urllib.parse.urlencode({"token": viewer_token(coord)}).encode(), headers=form)
    assert status == 303 and headers["Location"] == "/"
    cookie = headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
    status, _, body = get(coord, "/", cookie=viewer_token(coord))
    assert status == 200 and b'data-role="viewer"' in body
    status, headers, _ = get(coord, "/logout", method="POST")
    assert status == 303 and 'dflash_token=""' in headers["Set-Cookie"]
    # The viewer token is no gRPC credential.
    from dflash_worker.coordinator.client import AdminClient
    from dflash_worker.errors import AuthenticationError

    with pytest.raises(AuthenticationError), AdminClient(coord.address, viewer_token(coord), timeout=10) as c:
        c.list_runs()


def test_odd_paths_and_huge_requests_are_refused_and_the_server_keeps_serving(coord):
    token = coord.admin_token
    for path in (
        "/../../etc/passwd", "/%2e%2e/%2e%2e/etc/passwd", "/artifacts/run-x/job-y/../../../../etc/passwd",
        "/artifacts/run-x/job-y/%00", "/artifacts/run-x/job-y/a/../b", "/nope", "/api/status/../../metrics?x=" + "y" * 5000,
        "/artifacts/" + "r" * 3000 + "/j/n",
    ):  # fmt: skip
        status, _, body = get(coord, urllib.parse.quote(path, safe="/%?=."), token=token)
        assert status in (400, 404), (path, status, body[:200])
        assert b"root:" not in body
    # Methods the routes do not take.
    assert get(coord, "/api/status", method="DELETE", token=token)[0] == 405
    # Huge headers: one over aiohttp's field limit, then very many; a request line too long.
    host, port = hostport(coord)
    for raw in (
        b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(5000)) + b"\r\n",
        b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\x16\x03\x01\x02\x00garbage that is not HTTP\r\n\r\n",
    ):
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(raw)
            got = s.recv(200)
        assert re.match(rb"HTTP/1\.[01] 4\d\d ", got) or got == b"", got  # 400/431, or the connection closed
    # A large form body is cut at the server's limit.
    status, _, _ = get(coord, "/login", method="POST", body=b"token=" + b"a" * 200_000, headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 413
    # Still serving, with the right token.
    assert get(coord, "/api/status", token=token)[0] == 200


def test_a_guessing_client_is_throttled_even_with_the_right_token(coord):
    for i in range(8):
        assert get(coord, "/api/status", token=f"guess-{i}-" * 4)[0] == 401
    status, _, body = get(coord, "/api/status", token=coord.admin_token)
    assert status == 429 and b"too many failed authentications" in body


def test_plain_http_off_loopback_is_refused(tmp_path):
    from dflash_worker.coordinator.server import ServeConfig
    from dflash_worker.errors import ConfigError

    with pytest.raises(ConfigError, match="status page over plain HTTP"):
        ServeConfig(db=tmp_path / "c.db", http_listen="0.0.0.0:8080")
    with pytest.raises(ConfigError, match="--http-listen"):
        ServeConfig(db=tmp_path / "c.db", http_listen="8080")


def test_eta_is_the_current_phases_and_the_snapshot_is_bounded(tmp_path):
    """ETA = steps left x seconds per step since the phase began; a phase change restarts the clock."""
    from dflash_worker.coordinator.store import Progress, RunSpecData, Store
    from dflash_worker.coordinator.web import snapshot as snap_mod
    from dflash_worker.proto.dflash.v1 import provider_pb2 as pb

    now = [1000.0]
    store = Store(tmp_path / "c.db", clock=lambda: now[0], lease_ttl=1000)
    try:
        pid = register_provider(store)
        store.runs.create_run(RunSpecData(name="eta", spec_json="{}", required_client_version="0.1.0", num_jobs=snap_mod.MAX_JOBS + 5))
        g = store.leases.acquire(pid)
        store.leases.heartbeat(pid, g.lease_id, Progress(phase=pb.PHASE_CAPTURE, step=0, total_steps=4))
        now[0] = 1100.0
        store.leases.heartbeat(pid, g.lease_id, Progress(phase=pb.PHASE_CAPTURE, step=2, total_steps=4))
        (job,) = [j for j in snap_mod.snapshot(store, now=1100.0)["runs"][0]["jobs"] if j["job_id"] == g.job_id]
        assert job["progress"]["phase"] == "capture" and job["progress"]["eta_seconds"] == pytest.approx(100.0)  # 2 left at 50 s each
        # Training starts: its clock starts at its first heartbeat, not at the attempt's start.
        now[0] = 1200.0
        store.leases.heartbeat(pid, g.lease_id, Progress(phase=pb.PHASE_TRAIN, step=10, total_steps=110, metrics={"loss": 3.0}))
        now[0] = 1210.0
        store.leases.heartbeat(pid, g.lease_id, Progress(phase=pb.PHASE_TRAIN, step=20, total_steps=110, metrics={"loss": 2.0, "tokens_per_s": 512.0}))
        s = snap_mod.snapshot(store, now=1212.0)
        (job,) = [j for j in s["runs"][0]["jobs"] if j["job_id"] == g.job_id]
        p = job["progress"]
        assert (p["phase"], p["step"], p["total_steps"], p["loss"], p["tokens_per_s"]) == ("train", 20, 110, 2.0, 512.0)
        assert p["eta_seconds"] == pytest.approx(90.0) and p["heartbeat_age_seconds"] == pytest.approx(2.0)  # 90 left at 1 s each
        # Bounded: at most MAX_JOBS jobs of a run are shown, and the count of the rest is kept.
        assert len(s["runs"][0]["jobs"]) == snap_mod.MAX_JOBS and s["runs"][0]["num_jobs"] == snap_mod.MAX_JOBS + 5
        from dflash_worker.coordinator.web import page

        assert "5 more jobs not shown" in page.render_status(s)
    finally:
        store.close()


def test_under_tls_the_page_is_https_with_a_secure_cookie(start_coordinator, tmp_path):
    import ssl

    from tls_certs import tls_world

    from dflash_worker.coordinator.tls import ClientTls

    certs = tls_world(tmp_path / "tls", clients=("admin",))
    coord = start_coordinator(
        "--tls-cert", str(certs.server.cert), "--tls-key", str(certs.server.key), "--http-listen", "127.0.0.1:0",
        tls=ClientTls(ca_file=certs.ca.cert), warm=True
    )  # fmt: skip
    url = urllib.parse.urlsplit(coord.info["http_address"])
    assert url.scheme == "https", coord.info
    ctx = ssl.create_default_context(cafile=str(certs.ca.cert))
    c = http.client.HTTPSConnection(url.hostname, url.port, context=ctx, timeout=10)
    c.request("POST", "/login", body=urllib.parse.urlencode({"token": coord.admin_token}), headers={"Content-Type": "application/x-www-form-urlencoded"})
    r = c.getresponse()
    r.read()
    assert r.status == 303 and "Secure" in r.getheader("Set-Cookie") and "HttpOnly" in r.getheader("Set-Cookie")
    c.request("GET", "/api/status", headers={"Authorization": f"Bearer {coord.admin_token}"})
    r = c.getresponse()
    assert r.status == 200 and json.loads(r.read())["runs"] == []
    c.close()
