"""TLS material for the coordinator's server and its admin client, checked before it is used.

grpc takes PEM bytes and reports a bad file only when a handshake fails (or as
an opaque error when the port is added), so every file is read and checked
here first with the standard library's `ssl` module: the certificates parse,
the private key parses, is not encrypted and belongs to the certificate. Every
error names the file and the flag it came from.

Plaintext is for loopback: `is_loopback` says whether a listen host is one
(127.0.0.0/8, ::1, `localhost`); anything else needs TLS or `--insecure`.
"""

from __future__ import annotations

import ipaddress
import re
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from ..errors import ConfigError

_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----\s.*?-----END CERTIFICATE-----", re.S)


def is_loopback(host: str) -> bool:
    """Whether a listen/connect host (`127.0.0.1`, `[::1]`, `localhost`, ...) is this machine only."""
    h = host.strip().strip("[]").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def _read(path: Path, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} `{path}`: {exc.strerror or exc}") from None
    if not data.strip():
        raise ConfigError(f"{what} `{path}` is empty")
    return data


def read_certificates(path: Path, what: str) -> bytes:
    """PEM certificate(s) from `path`, checked to parse; ConfigError naming `what` and the file otherwise."""
    data = _read(path, what)
    blocks = _PEM_CERT.findall(data)
    if not blocks:
        raise ConfigError(f"{what} `{path}` holds no PEM certificate (`-----BEGIN CERTIFICATE-----`)\nhint: pass the certificate file, not a key or a DER file")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    for i, block in enumerate(blocks):
        try:
            ctx.load_verify_locations(cadata=block.decode("ascii"))
        except (ssl.SSLError, UnicodeDecodeError, ValueError) as exc:
            raise ConfigError(f"{what} `{path}`: certificate {i + 1} of {len(blocks)} does not parse: {getattr(exc, 'reason', None) or exc}") from None
    return data


def read_private_key(path: Path, what: str) -> bytes:
    """An unencrypted PEM private key from `path` (parsed together with its certificate by `load_server_tls`)."""
    data = _read(path, what)
    if b"PRIVATE KEY-----" not in data:
        raise ConfigError(f"{what} `{path}` holds no PEM private key (`-----BEGIN ... PRIVATE KEY-----`)")
    if b"ENCRYPTED" in data:
        raise ConfigError(f"{what} `{path}` is encrypted; grpc needs an unencrypted key\nhint: `openssl pkey -in {path} -out KEY.pem` and keep it mode 0600")
    return data


def _check_pair(cert: Path, key: Path, what: str) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # A password callback keeps OpenSSL from prompting on a terminal.
        ctx.load_cert_chain(str(cert), str(key), password=lambda: b"")
    except ssl.SSLError as exc:
        reason = exc.reason or str(exc)
        if reason == "KEY_VALUES_MISMATCH":
            raise ConfigError(f"{what}: the private key `{key}` does not belong to the certificate `{cert}`") from None
        raise ConfigError(f"{what}: private key `{key}` does not parse ({reason})") from None


@dataclass(frozen=True)
class ServerTls:
    """What `grpc.ssl_server_credentials` takes; `client_ca` set means mutual TLS."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None = None

    @property
    def mtls(self) -> bool:
        return self.client_ca is not None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)], root_certificates=self.client_ca, require_client_auth=self.client_ca is not None
        )


def load_server_tls(cert: Path, key: Path, client_ca: Path | None = None) -> ServerTls:
    """Read and check `--tls-cert`, `--tls-key` and (for mutual TLS) `--tls-client-ca`."""
    chain = read_certificates(cert, "TLS certificate (`--tls-cert`)")
    private_key = read_private_key(key, "TLS private key (`--tls-key`)")
    _check_pair(cert, key, "`--tls-cert`/`--tls-key`")
    ca = read_certificates(client_ca, "client CA (`--tls-client-ca`)") if client_ca is not None else None
    return ServerTls(cert_chain=chain, private_key=private_key, client_ca=ca)


@dataclass(frozen=True, kw_only=True)
class ClientTls:
    """The admin client's TLS settings: a CA file (None: the system roots) and, for mTLS, a certificate and key."""

    ca_file: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None

    def __post_init__(self):
        if (self.client_cert is None) != (self.client_key is None):
            raise ConfigError("`--client-cert` and `--client-key` go together\nhint: pass both for mutual TLS, or neither")

    def credentials(self) -> grpc.ChannelCredentials:
        root = read_certificates(self.ca_file, "CA file (`--ca-file`)") if self.ca_file is not None else None
        if self.client_cert is None:
            return grpc.ssl_channel_credentials(root_certificates=root)
        chain = read_certificates(self.client_cert, "client certificate (`--client-cert`)")
        key = read_private_key(self.client_key, "client key (`--client-key`)")
        _check_pair(self.client_cert, self.client_key, "`--client-cert`/`--client-key`")
        return grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)
