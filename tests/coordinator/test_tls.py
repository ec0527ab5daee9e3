"""TLS and mutual TLS against a real coordinator process: round trips, refused certificates, identity checks,
plaintext refused off loopback, unusable certificate files named at startup."""

from __future__ import annotations

import json

import grpc
import pytest
from coordinator_helpers import REPO, Provider, code_of, run_spec, subprocess_env
from prewarmed import coordinator_cli
from tls_certs import tls_world

from dflash_worker.coordinator.server import ServeConfig
from dflash_worker.coordinator.tls import ClientTls
from dflash_worker.errors import ConfigError


@pytest.fixture
def certs(tmp_path):
    return tls_world(tmp_path / "tls", clients=("box-a", "box-b", "admin"))


def _creds(certs, client=None, *, ca=None) -> grpc.ChannelCredentials:
    """Channel credentials trusting `ca` (default the test CA), presenting `client` (CertFiles) if given."""
    root = (ca or certs.ca.cert).read_bytes()
    if client is None:
        return grpc.ssl_channel_credentials(root)
    return grpc.ssl_channel_credentials(root, client.key.read_bytes(), client.cert.read_bytes())


def _serve_tls(start_coordinator, certs, *, mtls: bool):
    args = ["--tls-cert", str(certs.server.cert), "--tls-key", str(certs.server.key)]
    admin = ClientTls(ca_file=certs.ca.cert)
    if mtls:
        args += ["--tls-client-ca", str(certs.ca.cert)]
        admin = ClientTls(ca_file=certs.ca.cert, client_cert=certs.client("admin").cert, client_key=certs.client("admin").key)
    return start_coordinator(*args, tls=admin, warm=True)


def _provider(coord, name: str, creds) -> Provider:
    with coord.admin() as admin:
        token = admin.create_provider(name)
    return Provider(coord.address, token, credentials=creds)


def run_cli(*argv, env_extra=None):
    env = subprocess_env()
    env.update(env_extra or {})
    return coordinator_cli(*argv, env=env, cwd=REPO, timeout=60)


def test_a_job_round_trips_over_tls(start_coordinator, certs):
    coord = _serve_tls(start_coordinator, certs, mtls=False)
    assert coord.info["tls"] is True and coord.info["mtls"] is False
    with coord.admin() as admin:
        admin.create_run(run_spec("tls-run"))
    prov = _provider(coord, "box-a", _creds(certs))
    try:
        prov.register()
        lease = prov.acquire(wait=1).lease
        assert prov.heartbeat_once(lease.lease_id, step=1).lease_expires_unix > 0
        assert prov.finish(lease.lease_id) == "succeeded"
    finally:
        prov.close()
    # The admin CLI over https://, trusting the test CA through the environment.
    env = {"DFLASH_ADMIN_TOKEN": coord.admin_token, "DFLASH_TLS_CA": str(certs.ca.cert)}
    r = run_cli("runs", "list", "--json", "--server", f"https://{coord.address}", env_extra=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[0]["job_states"] == {"succeeded": 1}


def test_plaintext_clients_of_a_tls_coordinator_fail_with_a_hint(start_coordinator, certs):
    coord = _serve_tls(start_coordinator, certs, mtls=False)
    with coord.admin() as admin:
        token = admin.create_provider("box-a")
    plain = Provider(coord.address, token)
    try:
        with pytest.raises(grpc.RpcError) as e:
            plain.register()
        assert code_of(e) == grpc.StatusCode.UNAVAILABLE
    finally:
        plain.close()
    r = run_cli("runs", "list", "--server", coord.address, "--timeout", "5", env_extra={"DFLASH_ADMIN_TOKEN": coord.admin_token})
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr and "https://" in r.stderr, r.stderr
    # TLS files with a plaintext address are a mistake, said as such.
    r = run_cli("runs", "list", "--server", coord.address, "--ca-file", str(certs.ca.cert), env_extra={"DFLASH_ADMIN_TOKEN": coord.admin_token})
    assert r.returncode == 1 and f"use `https://{coord.address}`" in r.stderr, r.stderr


def test_a_tls_client_that_does_not_trust_the_ca_fails(start_coordinator, certs):
    coord = _serve_tls(start_coordinator, certs, mtls=False)
    p = _provider(coord, "box-a", _creds(certs, ca=certs.other_ca.cert))
    try:
        with pytest.raises(grpc.RpcError) as e:
            p.register()
        assert code_of(e) == grpc.StatusCode.UNAVAILABLE
    finally:
        p.close()


def test_mtls_admits_a_provider_whose_certificate_names_it(start_coordinator, certs):
    coord = _serve_tls(start_coordinator, certs, mtls=True)
    assert coord.info["mtls"] is True
    with coord.admin() as admin:  # admin with a certificate from the same CA (any CN)
        admin.create_run(run_spec("mtls-run"))
    p = _provider(coord, "box-a", _creds(certs, certs.client("box-a")))
    try:
        assert p.register().provider_id.startswith("prov-")
        assert p.acquire(wait=1).WhichOneof("result") == "lease"
    finally:
        p.close()


@pytest.mark.parametrize("which", ["none", "foreign-ca", "expired"])
def test_mtls_refuses_a_missing_foreign_or_expired_client_certificate(start_coordinator, certs, which):
    coord = _serve_tls(start_coordinator, certs, mtls=True)
    client = {"none": None, "foreign-ca": certs.foreign_client("box-a"), "expired": certs.expired_client("box-a")}[which]
    p = _provider(coord, "box-a", _creds(certs, client))
    try:
        with pytest.raises(grpc.RpcError) as e:
            p.register()
        # The handshake fails: the call never reaches the coordinator's handlers.
        assert code_of(e) == grpc.StatusCode.UNAVAILABLE, e.value.details()
    finally:
        p.close()


def test_mtls_refuses_a_certificate_of_another_provider(start_coordinator, certs):
    coord = _serve_tls(start_coordinator, certs, mtls=True)
    # box-a's token with box-b's (valid, same CA) certificate.
    p = _provider(coord, "box-a", _creds(certs, certs.client("box-b")))
    try:
        with pytest.raises(grpc.RpcError) as e:
            p.register()
        assert code_of(e) == grpc.StatusCode.UNAUTHENTICATED
        assert "CN `box-b`" in e.value.details() and "provider `box-a`" in e.value.details() and "disagree" in e.value.details()
    finally:
        p.close()


def test_mtls_admin_cli_needs_a_client_certificate(start_coordinator, certs):
    coord = _serve_tls(start_coordinator, certs, mtls=True)
    env = {"DFLASH_ADMIN_TOKEN": coord.admin_token, "DFLASH_TLS_CA": str(certs.ca.cert)}
    r = run_cli("providers", "list", "--server", f"https://{coord.address}", "--timeout", "5", env_extra=env)
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr and "--client-cert" in r.stderr, r.stderr
    admin = certs.client("admin")
    r = run_cli("providers", "list", "--server", f"https://{coord.address}", "--client-cert", str(admin.cert), "--client-key", str(admin.key), env_extra=env)
    assert r.returncode == 0, r.stderr


def test_plaintext_off_loopback_needs_insecure(tmp_path):
    # Refused before anything is bound or opened.
    r = run_cli("serve", "--db", str(tmp_path / "c.db"), "--listen", "0.0.0.0:0")
    assert r.returncode == 1 and r.stdout == ""
    assert "refusing to serve plaintext on `0.0.0.0:0`" in r.stderr and "--insecure" in r.stderr, r.stderr
    assert not (tmp_path / "c.db").exists()
    for listen in ("10.1.2.3:50051", "[::]:50051", "coordinator.example:50051"):
        with pytest.raises(ConfigError, match="not a loopback address"):
            ServeConfig(db=tmp_path / "c.db", listen=listen)
    # Allowed: loopback in every spelling, --insecure, or TLS.
    for listen in ("127.0.0.1:0", "127.8.9.1:0", "[::1]:0", "localhost:0"):
        ServeConfig(db=tmp_path / "c.db", listen=listen)
    ServeConfig(db=tmp_path / "c.db", listen="0.0.0.0:0", insecure=True)
    ServeConfig(db=tmp_path / "c.db", listen="0.0.0.0:0", tls_cert=tmp_path / "c.pem", tls_key=tmp_path / "k.pem")


def _serve_fails(tmp_path, *args: str) -> str:
    r = run_cli("serve", "--db", str(tmp_path / "c.db"), "--listen", "127.0.0.1:0", *args)
    assert r.returncode == 1 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    return r.stderr


def test_unusable_tls_files_are_named_at_startup(tmp_path, certs):
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"-----BEGIN CERTIFICATE-----\nnot base64 at all!!\n-----END CERTIFICATE-----\n")
    noise = tmp_path / "noise.bin"
    noise.write_bytes(bytes(range(256)) * 4)
    empty = tmp_path / "empty.pem"
    empty.write_bytes(b"")
    encrypted = tmp_path / "enc.key"
    encrypted.write_text("-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIB\n-----END ENCRYPTED PRIVATE KEY-----\n")
    cert, key = str(certs.server.cert), str(certs.server.key)
    cases = [
        (("--tls-cert", str(garbage), "--tls-key", key), [str(garbage), "does not parse"]),
        (("--tls-cert", str(noise), "--tls-key", key), [str(noise), "no PEM certificate"]),
        (("--tls-cert", str(empty), "--tls-key", key), [str(empty), "is empty"]),
        (("--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", key), [str(tmp_path / "missing.pem"), "cannot read"]),
        (("--tls-cert", cert, "--tls-key", str(noise)), [str(noise), "no PEM private key"]),
        (("--tls-cert", cert, "--tls-key", str(encrypted)), [str(encrypted), "encrypted"]),
        # A real key that belongs to another certificate.
        (("--tls-cert", cert, "--tls-key", str(certs.client("box-a").key)), [str(certs.client("box-a").key), "does not belong"]),
        # A certificate given as the key.
        (("--tls-cert", cert, "--tls-key", cert), [cert, "no PEM private key"]),
        (("--tls-cert", cert, "--tls-key", key, "--tls-client-ca", str(garbage)), [str(garbage), "--tls-client-ca"]),
        (("--tls-cert", cert), ["`--tls-cert` and `--tls-key` go together"]),
        (("--tls-client-ca", str(certs.ca.cert)), ["needs `--tls-cert`"]),
    ]
    for args, needles in cases:
        err = _serve_fails(tmp_path, *args)
        for n in needles:
            assert n in err, (args, err)
    assert not (tmp_path / "c.db").exists(), "the database was opened before the TLS files were checked"


def test_client_tls_files_are_checked(tmp_path, certs):
    noise = tmp_path / "noise.pem"
    noise.write_text("hello")
    with pytest.raises(ConfigError, match="go together"):
        ClientTls(client_cert=certs.client("admin").cert)
    with pytest.raises(ConfigError, match=r"CA file \(`--ca-file`\) `.*noise.pem` holds no PEM certificate"):
        ClientTls(ca_file=noise).credentials()
    with pytest.raises(ConfigError, match="does not belong"):
        ClientTls(client_cert=certs.client("admin").cert, client_key=certs.client("box-a").key).credentials()
