"""TLS and mutual TLS end to end: the real coordinator serving `--tls-cert/--tls-key[/--tls-client-ca]`, the
real run-manager joining it over `https://` and the real native client running a `noop` job. Certificates
are made at test time (`tests/tls_certs.py`).

Shown here: a job over TLS and over mutual TLS completes; a client certificate from another CA, one whose CN
is not the token's provider, and an expired one are refused; plaintext meeting TLS fails with a `hint:`
(both ways round); an expired server certificate is named; a token file others can read is refused.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_helpers import client_version
from launchers import REPO, Coordinator

sys.path.insert(0, str(REPO / "tests"))
from tls_certs import CertFiles, TlsWorld, tls_world  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.real_process("native_client")]  # the native client over TLS

NOOP_SPEC = {"stages": ["noop"], "noop": {"steps": 4, "step_seconds": 0.02, "checkpoint_every": 2}}


class TlsCoordinator(Coordinator):
    """`dflash-coordinator serve` with `--tls-cert/--tls-key` (and `--tls-client-ca` for mutual TLS); its admin CLI over https."""

    def __init__(self, workdir: Path, *, certs: TlsWorld, mtls: bool, server: CertFiles | None = None, **kw):
        server = server or certs.server
        serve_args = ("--tls-cert", str(server.cert), "--tls-key", str(server.key))
        serve_args += ("--tls-client-ca", str(certs.ca.cert)) if mtls else ()
        super().__init__(workdir, serve_args=serve_args, **kw)
        self.certs, self.mtls, self.server = certs, mtls, server

    def start(self, port: int = 0) -> TlsCoordinator:
        super().start(port)
        assert (self.info["tls"], self.info["mtls"]) == (True, self.mtls), self.info
        assert self.url.startswith("https://"), self.url
        return self

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        tls = ["--ca-file", str(self.certs.ca.cert)]
        if self.mtls:
            admin = self.certs.client("admin")
            tls += ["--client-cert", str(admin.cert), "--client-key", str(admin.key)]
        return super().cli(*args, *tls, check=check)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> TlsWorld:
    return tls_world(tmp_path_factory.mktemp("certs"), clients=("box-a", "box-b", "admin"))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tls-e2e")


def _serve(coord: Coordinator):
    coord.start()
    try:
        yield coord
    finally:
        coord.stop()


@pytest.fixture(scope="module")
def tls_coord(root, certs, binaries):
    yield from _serve(TlsCoordinator(root / "coord-tls", certs=certs, mtls=False, lease_ttl=10, warm=True))


@pytest.fixture(scope="module")
def mtls_coord(root, certs, binaries):
    yield from _serve(TlsCoordinator(root / "coord-mtls", certs=certs, mtls=True, lease_ttl=10, warm=True))


def token_file(path: Path, token: str, mode: int = 0o600) -> Path:
    path.write_text(token + "\n")
    path.chmod(mode)
    return path


def tls_args(certs: TlsWorld, client: CertFiles | None = None) -> list[str]:
    args = ["--ca-file", str(certs.ca.cert)]
    if client is not None:
        args += ["--client-cert", str(client.cert), "--client-key", str(client.key)]
    return args


def refused(rm, *, timeout: float = 60) -> str:
    """The run-manager exits 1 (a user error) without running anything; its stderr."""
    rc = rm.wait(timeout)
    err = rm.text()
    assert rc == 1, f"exit {rc}:\n{err}"
    assert not rm.worker_pids(), err
    return err


def run_noop(coord: TlsCoordinator, procs, work: Path, provider: str, *args: str):
    """A provider created as `provider` joins `coord` with `args` and runs one `noop` job to `succeeded`; its RunManager."""
    token = coord.provider_token(provider)
    run_id = coord.create_run(f"tls-{provider}-{work.name}", NOOP_SPEC, client_version=client_version())
    tf = token_file(work.parent / f"{work.name}.token", token)
    rm = procs.run_manager(work, "--coordinator", coord.url, "--token-file", str(tf), "--name", provider, "--max-jobs", "1", *args)
    rc = rm.wait()
    assert rc == 0, f"stdout:\n{rm.stdout}\nstderr:\n{rm.text()}"
    (job,) = coord.show(run_id)["jobs"]
    assert job["state"] == "succeeded", json.dumps(job, indent=1)
    assert any(a["kind"] == "checkpoint" for a in job["artifacts"]), job
    return rm


def test_noop_job_over_tls_completes(tls_coord, certs, procs, root):
    rm = run_noop(tls_coord, procs, root / "work-tls", "box-tls", *tls_args(certs))
    assert rm.messages(lambda v: "connecting over TLS (verified against CA file" in str(v.get("message", ""))), rm.text()


def test_noop_job_over_mtls_completes(mtls_coord, certs, procs, root):
    rm = run_noop(mtls_coord, procs, root / "work-mtls", "box-a", *tls_args(certs, certs.client("box-a")))
    assert rm.messages(lambda v: "mutual TLS" in str(v.get("message", "")) and "CN `box-a`" in str(v.get("message", ""))), rm.text()


def test_client_certificate_from_another_ca_is_refused(mtls_coord, certs, procs, root):
    token = mtls_coord.provider_token("box-foreign")
    foreign = certs.foreign_client("box-foreign")
    tf = token_file(root / "foreign.token", token)
    rm = procs.run_manager(root / "work-foreign", "--coordinator", mtls_coord.url, "--token-file", str(tf), *tls_args(certs, foreign))
    err = refused(rm)
    # The coordinator ends the handshake (how depends on timing: a close or an alert); either is named.
    assert re.search(
        r"error: coordinator call `Register` failed: the coordinator (closed the connection during the TLS handshake|refused this provider's TLS handshake)",
        err,
    ), err
    # The hint names the certificate that was refused.
    assert re.search(rf"hint: .*`{re.escape(str(foreign.cert))}`", err), err


def test_certificate_cn_must_be_the_tokens_provider(mtls_coord, certs, procs, root):
    token = mtls_coord.provider_token("box-a-cn")
    tf = token_file(root / "cn.token", token)
    # A valid certificate from the right CA, but for another provider.
    rm = procs.run_manager(
        root / "work-cn", "--coordinator", mtls_coord.url, "--token-file", str(tf), *tls_args(certs, certs.client("box-b"))
    )
    err = refused(rm)
    want = "error: coordinator call `Register` failed: the client certificate's CN `box-b` and the token's provider `box-a-cn` disagree (Unauthenticated)"
    assert want in err, err
    # The coordinator's hint, and no generic one about the token after it.
    assert "\nhint: a provider's certificate CN must be the name it was created with" in err, err
    assert "hint: check the provider token" not in err, err


def test_expired_client_certificate_is_refused(mtls_coord, certs, procs, root):
    token = mtls_coord.provider_token("box-old")
    expired = certs.expired_client("box-old")
    tf = token_file(root / "old.token", token)
    rm = procs.run_manager(root / "work-old", "--coordinator", mtls_coord.url, "--token-file", str(tf), *tls_args(certs, expired))
    err = refused(rm)
    assert re.search(
        rf"error: client certificate `{re.escape(str(expired.cert))}` \(CN `box-old`\) expired on \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC", err
    ), err
    assert "hint: ask the coordinator's admin for a new certificate" in err, err


def test_plaintext_to_a_tls_coordinator_fails_with_a_hint(tls_coord, procs, root):
    plain = tls_coord.address
    rm = procs.run_manager(root / "work-plain", "--coordinator", plain, "--token", "whatever")
    err = refused(rm)
    assert f"error: coordinator call `Register` failed: the coordinator at `{plain}` speaks TLS, but this connection is plaintext" in err, (
        err
    )
    assert f"hint: use `--coordinator https://{plain}`" in err, err


def test_tls_to_a_plaintext_coordinator_is_named(certs, procs, tmp_path):
    coord = procs.coordinator(tmp_path / "coord-plain", lease_ttl=10, warm=True)
    rm = procs.run_manager(tmp_path / "work", "--coordinator", f"https://{coord.address}", "--token", "whatever", *tls_args(certs))
    err = refused(rm)
    assert f"failed: the coordinator at `{coord.address}` does not speak TLS" in err, err
    assert "hint: the coordinator serves plaintext" in err, err


def test_expired_server_certificate_is_named(certs, procs, tmp_path):
    old = certs.ca.server_cert(tmp_path / "old-server", expired=True)
    coord = TlsCoordinator(tmp_path / "coord-old", certs=certs, mtls=False, server=old, lease_ttl=10, warm=True)
    procs.coordinators.append(coord)
    coord.start()
    rm = procs.run_manager(tmp_path / "work", "--coordinator", coord.url, "--token", "whatever", *tls_args(certs))
    err = refused(rm)
    assert re.search(r"failed: the coordinator's TLS certificate was not accepted: invalid peer certificate: .*[Ee]xpired", err), err
    assert "hint: the coordinator's certificate has expired: its admin must renew it" in err, err


def test_token_file_readable_by_others_is_refused(tls_coord, certs, procs, root):
    tf = token_file(root / "open.token", "some-token", mode=0o644)
    rm = procs.run_manager(root / "work-open", "--coordinator", tls_coord.url, "--token-file", str(tf), *tls_args(certs))
    err = refused(rm)
    assert f"error: token file `{tf}` has mode 0644: group or others can read or change it; it must be mode 0600 or stricter" in err, err
    assert f"hint: chmod 600 {tf}" in err, err


def test_plaintext_off_loopback_needs_insecure(procs, tmp_path):
    # TEST-NET-1: nothing is contacted; the address alone is refused.
    rm = procs.run_manager(tmp_path / "work", "--coordinator", "192.0.2.10:50051", "--token", "whatever")
    err = refused(rm, timeout=30)
    assert "error: refusing plaintext to `192.0.2.10:50051`, which is not this machine" in err, err
    assert "hint: use `--coordinator https://192.0.2.10:50051`" in err and "`--insecure`" in err, err
