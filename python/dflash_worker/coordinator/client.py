"""A small synchronous admin client for the coordinator (used by the CLI and tests).

`https://HOST:PORT` connects with TLS (`ClientTls`: a CA file or the system
roots, and a client certificate for mutual TLS); `HOST:PORT` and
`http://HOST:PORT` are plaintext.
"""

from __future__ import annotations

import grpc

from ..errors import ConfigError
from ..proto.dflash.v1 import admin_pb2, admin_pb2_grpc
from .status import error_for
from .tls import ClientTls


def parse_address(address: str) -> tuple[str, bool]:
    """`(host:port, tls)` from `host:port`, `http://host:port` or `https://host:port` (the run-manager's forms)."""
    addr = address.strip()
    tls = addr.startswith("https://")
    for scheme in ("https://", "http://"):
        if addr.startswith(scheme):
            addr = addr[len(scheme) :]
            break
    addr = addr.rstrip("/")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or "://" in host:
        raise ConfigError(f"coordinator address `{address}` is not HOST:PORT, http://HOST:PORT or https://HOST:PORT")
    return addr, tls


def open_channel(address: str, tls: ClientTls | None = None, options: list | None = None) -> grpc.Channel:
    """A channel to `address`: TLS for `https://` (with `tls`, default the system roots), else plaintext."""
    target, secure = parse_address(address)
    if not secure:
        if tls is not None and (tls.ca_file or tls.client_cert):
            raise ConfigError(f"TLS files were given but the coordinator address `{address}` is plaintext\nhint: use `https://{target}`")
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, (tls or ClientTls()).credentials(), options=options)


class AdminClient:
    """Calls `dflash.v1.AdminService` with the admin token; refusals raise `DflashError` subclasses."""

    def __init__(self, address: str, token: str, *, timeout: float = 30.0, max_message_bytes: int = 64 << 20, tls: ClientTls | None = None):
        self.address = address
        self.timeout = timeout
        self._secure = parse_address(address)[1]
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._channel = open_channel(
            address, tls, options=[("grpc.max_receive_message_length", max_message_bytes), ("grpc.max_send_message_length", max_message_bytes)]
        )
        self._stub = admin_pb2_grpc.AdminServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method: str, request):
        try:
            return getattr(self._stub, method)(request, metadata=self._metadata, timeout=self.timeout)
        except grpc.RpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                hint = (
                    "hint: is the TLS certificate valid for this host and signed by `--ca-file`? under mutual TLS pass `--client-cert` and `--client-key`"
                    if self._secure
                    else "hint: start it with `dflash-coordinator serve` or pass `--server HOST:PORT`; a coordinator serving TLS needs `https://HOST:PORT`"
                )
                raise error_for(code, f"cannot reach the coordinator at `{self.address}` ({code.name}): {exc.details()}\n{hint}") from None
            raise error_for(code, f"coordinator refused `{method}` ({code.name}): {exc.details()}") from None

    def create_run(self, spec: admin_pb2.RunSpec) -> admin_pb2.Run:
        return self._call("CreateRun", admin_pb2.CreateRunRequest(spec=spec)).run

    def list_runs(self) -> list[admin_pb2.Run]:
        return list(self._call("ListRuns", admin_pb2.ListRunsRequest()).runs)

    def get_run(self, run_id: str) -> admin_pb2.GetRunResponse:
        return self._call("GetRun", admin_pb2.GetRunRequest(run_id=run_id))

    def approve_version(self, run_id: str, version: str) -> admin_pb2.Run:
        return self._call("ApproveVersion", admin_pb2.ApproveVersionRequest(run_id=run_id, version=version)).run

    def create_provider(self, name: str) -> str:
        return self.create_provider_full(name).token

    def create_provider_full(self, name: str) -> admin_pb2.CreateProviderResponse:
        """The new provider's token and id."""
        return self._call("CreateProvider", admin_pb2.CreateProviderRequest(name=name))

    def revoke_provider(self, provider_id: str) -> admin_pb2.RevokeProviderResponse:
        return self._call("RevokeProvider", admin_pb2.RevokeProviderRequest(provider_id=provider_id))

    def rotate_token(self, provider_id: str, grace_seconds: int) -> admin_pb2.RotateProviderTokenResponse:
        return self._call("RotateProviderToken", admin_pb2.RotateProviderTokenRequest(provider_id=provider_id, grace_seconds=grace_seconds))

    def list_providers(self) -> list[admin_pb2.ProviderInfo]:
        return list(self._call("ListProviders", admin_pb2.ListProvidersRequest()).providers)

    def cancel_job(self, job_id: str) -> str:
        return self._call("CancelJob", admin_pb2.CancelJobRequest(job_id=job_id)).job_state

    def request_checkpoint(self, job_id: str) -> str:
        return self._call("RequestCheckpoint", admin_pb2.RequestCheckpointRequest(job_id=job_id)).job_state
