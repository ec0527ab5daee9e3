"""Test certificates made at test time with `cryptography` (nothing is committed).

Shared by the coordinator tests (Python) and the run-manager TLS e2e tests, so
this API is kept stable. `tests/` is not a package: put it on `sys.path` first
(`sys.path.insert(0, str(REPO / "tests"))`; tests/coordinator/conftest.py does).

    from tls_certs import make_ca, tls_world

    ca = make_ca(tmp_path / "ca")                        # CertAuthority: ca.cert, ca.key (PEM paths)
    server = ca.server_cert(tmp_path / "srv")            # CertFiles: .cert, .key; SANs 127.0.0.1, ::1, localhost
    client = ca.client_cert(tmp_path / "cli", "box-a")   # subject CN = `box-a`, clientAuth
    old = ca.client_cert(tmp_path / "old", "box-a", expired=True)

    w = tls_world(tmp_path / "tls", clients=("box-a", "box-b"))
    w.ca, w.server, w.clients["box-a"], w.expired_client("box-a"), w.other_ca, w.foreign_client("box-a")

Every file is PEM: certificates as `NAME.pem`, private keys (unencrypted
PKCS#8, mode 0600) as `NAME.key`. Keys are ECDSA P-256 (fast to make; accepted
by BoringSSL in grpcio and by rustls/webpki). Certificates are X.509 v3 with
the extensions webpki insists on: a CA with `basicConstraints CA:TRUE` and
`keyCertSign`; leaves with `CA:FALSE`, a subject alternative name (servers)
and the matching extended key usage (`serverAuth` / `clientAuth`).

`CertFiles.chain` gives the leaf followed by its CA (the form grpc's
`ssl_server_credentials` also accepts).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVER_HOSTS = ("127.0.0.1", "::1", "localhost")
VALID_DAYS = 7


@dataclass(frozen=True)
class CertFiles:
    """A certificate and its private key, as PEM files."""

    cert: Path
    key: Path
    # The issuing CA's certificate (the leaf's trust anchor).
    ca: Path

    def chain(self, directory: Path | None = None) -> Path:
        """A PEM file with the leaf and then its CA certificate (written next to `cert` unless `directory`)."""
        out = (directory or self.cert.parent) / f"{self.cert.stem}-chain.pem"
        out.write_bytes(self.cert.read_bytes() + self.ca.read_bytes())
        return out


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _validity(expired: bool, days: int) -> tuple[dt.datetime, dt.datetime]:
    now = dt.datetime.now(dt.UTC)
    if expired:
        return now - dt.timedelta(days=2), now - dt.timedelta(days=1)
    # Backdated a little so a clock a few minutes behind still accepts it.
    return now - dt.timedelta(minutes=10), now + dt.timedelta(days=days)


@dataclass
class CertAuthority:
    """A self-signed test CA that issues server and client certificates."""

    name: str
    cert: Path
    key: Path
    _cert: x509.Certificate = field(repr=False)
    _key: ec.EllipticCurvePrivateKey = field(repr=False)

    def _issue(self, directory: Path, stem: str, subject_cn: str, *, san: list | None, usage, expired: bool, days: int) -> CertFiles:
        directory.mkdir(parents=True, exist_ok=True)
        key = _key()
        not_before, not_after = _validity(expired, days)
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False)
        )
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = b.sign(self._key, hashes.SHA256())
        files = CertFiles(cert=directory / f"{stem}.pem", key=directory / f"{stem}.key", ca=self.cert)
        _write_cert(files.cert, cert)
        _write_key(files.key, key)
        return files

    def server_cert(self, directory: Path, *, hosts: tuple[str, ...] = SERVER_HOSTS, stem: str = "server", expired: bool = False, days: int = VALID_DAYS) -> CertFiles:
        """A serverAuth certificate for `hosts` (IP addresses become IP SANs, the rest DNS SANs)."""
        san = []
        for h in hosts:
            try:
                san.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                san.append(x509.DNSName(h))
        return self._issue(directory, stem, hosts[0], san=san, usage=ExtendedKeyUsageOID.SERVER_AUTH, expired=expired, days=days)

    def client_cert(self, directory: Path, common_name: str, *, stem: str | None = None, expired: bool = False, days: int = VALID_DAYS) -> CertFiles:
        """A clientAuth certificate whose subject CN is `common_name` (a provider's name under mTLS)."""
        stem = stem or f"client-{common_name}" + ("-expired" if expired else "")
        return self._issue(directory, stem, common_name, san=None, usage=ExtendedKeyUsageOID.CLIENT_AUTH, expired=expired, days=days)


def make_ca(directory: Path, name: str = "dflash test CA", *, stem: str = "ca", days: int = VALID_DAYS) -> CertAuthority:
    """A new self-signed CA; writes `directory/STEM.pem` and `directory/STEM.key`."""
    directory.mkdir(parents=True, exist_ok=True)
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    not_before, not_after = _validity(False, days)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    ca = CertAuthority(name=name, cert=directory / f"{stem}.pem", key=directory / f"{stem}.key", _cert=cert, _key=key)
    _write_cert(ca.cert, cert)
    _write_key(ca.key, key)
    return ca


@dataclass
class TlsWorld:
    """A CA, a server certificate for loopback, client certificates by CN, and a second (untrusted) CA."""

    root: Path
    ca: CertAuthority
    server: CertFiles
    clients: dict[str, CertFiles]
    other_ca: CertAuthority

    def client(self, common_name: str) -> CertFiles:
        """A client certificate from `ca` for `common_name` (made on first use)."""
        if common_name not in self.clients:
            self.clients[common_name] = self.ca.client_cert(self.root / "clients", common_name)
        return self.clients[common_name]

    def expired_client(self, common_name: str) -> CertFiles:
        """A client certificate from `ca` for `common_name` whose validity ended yesterday."""
        return self.ca.client_cert(self.root / "expired", common_name, expired=True)

    def foreign_client(self, common_name: str) -> CertFiles:
        """A client certificate for `common_name` issued by `other_ca` (not trusted by the server)."""
        return self.other_ca.client_cert(self.root / "foreign", common_name)


def tls_world(directory: Path, *, clients: tuple[str, ...] = ()) -> TlsWorld:
    """Everything a TLS/mTLS test needs under `directory` (`ca/`, `server/`, `clients/`, `other-ca/`)."""
    ca = make_ca(directory / "ca")
    other = make_ca(directory / "other-ca", "dflash other test CA")
    server = ca.server_cert(directory / "server")
    world = TlsWorld(root=directory, ca=ca, server=server, clients={}, other_ca=other)
    for cn in clients:
        world.client(cn)
    return world
