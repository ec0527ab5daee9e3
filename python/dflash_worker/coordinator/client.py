"""A small synchronous admin client for the coordinator (used by the CLI and tests)."""

from __future__ import annotations

import grpc

from ..errors import ConfigError
from ..proto.dflash.v1 import admin_pb2, admin_pb2_grpc
from .status import error_for


def grpc_target(address: str) -> str:
    """`host:port` from `host:port` or `http://host:port` (the run-manager's form)."""
    addr = address.strip()
    if addr.startswith("https://"):
        raise ConfigError(f"coordinator address `{address}` uses https; this coordinator serves plaintext gRPC\nhint: use `http://HOST:PORT`")
    if addr.startswith("http://"):
        addr = addr[len("http://") :]
    addr = addr.rstrip("/")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"coordinator address `{address}` is not HOST:PORT")
    return addr


class AdminClient:
    """Calls `dflash.v1.AdminService` with the admin token; refusals raise `DflashError` subclasses."""

    def __init__(self, address: str, token: str, *, timeout: float = 30.0, max_message_bytes: int = 64 << 20):
        self.address = address
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._channel = grpc.insecure_channel(
            grpc_target(address),
            options=[("grpc.max_receive_message_length", max_message_bytes), ("grpc.max_send_message_length", max_message_bytes)],
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
                raise error_for(
                    code,
                    f"cannot reach the coordinator at `{self.address}` ({code.name}): {exc.details()}\n"
                    "hint: start it with `dflash-coordinator serve` or pass `--server HOST:PORT`",
                ) from None
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
        return self._call("CreateProvider", admin_pb2.CreateProviderRequest(name=name)).token

    def list_providers(self) -> list[admin_pb2.ProviderInfo]:
        return list(self._call("ListProviders", admin_pb2.ListProvidersRequest()).providers)

    def cancel_job(self, job_id: str) -> str:
        return self._call("CancelJob", admin_pb2.CancelJobRequest(job_id=job_id)).job_state

    def request_checkpoint(self, job_id: str) -> str:
        return self._call("RequestCheckpoint", admin_pb2.RequestCheckpointRequest(job_id=job_id)).job_state
