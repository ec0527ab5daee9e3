"""A small synchronous admin client for the coordinator (used by the CLI and tests).

`https://HOST:PORT` connects with TLS (`ClientTls`: a CA file or the system
roots, and a client certificate for mutual TLS); `HOST:PORT` and
`http://HOST:PORT` are plaintext.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import grpc

from ..errors import ConfigError
from ..manifest import update_with_file
from ..proto.dflash.v1 import admin_pb2, admin_pb2_grpc, provider_pb2
from .artifacts.directio import AppendFile, BackgroundWriter
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
        """Every run, page by page."""
        out, token = [], ""
        while True:
            resp = self._call("ListRuns", admin_pb2.ListRunsRequest(page_token=token))
            out.extend(resp.runs)
            if not (token := resp.next_page_token):
                return out

    def get_run(self, run_id: str) -> admin_pb2.GetRunResponse:
        """The run with all its jobs (the pages joined into one response)."""
        first = self._call("GetRun", admin_pb2.GetRunRequest(run_id=run_id))
        token = first.next_page_token
        while token:
            resp = self._call("GetRun", admin_pb2.GetRunRequest(run_id=run_id, page_token=token))
            first.jobs.extend(resp.jobs)
            token = resp.next_page_token
        first.next_page_token = ""
        return first

    def list_artifacts(self, run_id: str, job_id: str = "", *, all_attempts: bool = False) -> list[admin_pb2.ArtifactInfo]:
        """A job's final artifacts (or every attempt's), page by page."""
        out, token = [], ""
        while True:
            resp = self._call("ListArtifacts", admin_pb2.ListArtifactsRequest(run_id=run_id, job_id=job_id, all_attempts=all_attempts, page_token=token))
            out.extend(resp.artifacts)
            if not (token := resp.next_page_token):
                return out

    def download(self, run_id: str, name: str, dest: Path, *, job_id: str = "", sha256: str = "", progress: bool = False) -> provider_pb2.Artifact:
        """Fetch an artifact to `dest`: resumable (`dest` + `.part` holds what arrived), sha256-verified, renamed into place."""
        dest = Path(dest)
        part = dest.with_name(dest.name + ".part")
        dest.parent.mkdir(parents=True, exist_ok=True)
        offset = part.stat().st_size if part.exists() else 0
        request = admin_pb2.AdminDownloadRequest(run_id=run_id, job_id=job_id, name=name, sha256=sha256, offset=offset)
        try:
            record = receive_download(self._stub.DownloadArtifact(request, metadata=self._metadata, timeout=None), part, name=name, progress=progress)
        except grpc.RpcError as exc:
            raise error_for(exc.code(), f"coordinator refused `DownloadArtifact` ({exc.code().name}): {exc.details()}\nhint: run the same command again to resume from {part}") from None
        os.replace(part, dest)
        return record

    def approve_version(self, run_id: str, version: str) -> admin_pb2.Run:
        return self._call("ApproveVersion", admin_pb2.ApproveVersionRequest(run_id=run_id, version=version)).run

    def create_provider(self, name: str) -> str:
        return self.create_provider_full(name).token

    def create_provider_full(self, name: str) -> admin_pb2.CreateProviderResponse:
        """The new provider's token and id."""
        return self._call("CreateProvider", admin_pb2.CreateProviderRequest(name=name))

    def revoke_provider(self, provider_id: str) -> admin_pb2.RevokeProviderResponse:
        return self._call("RevokeProvider", admin_pb2.RevokeProviderRequest(provider_id=provider_id))

    def unquarantine_provider(self, provider_id: str, reason: str) -> admin_pb2.UnquarantineProviderResponse:
        return self._call("UnquarantineProvider", admin_pb2.UnquarantineProviderRequest(provider_id=provider_id, reason=reason))

    def rotate_token(self, provider_id: str, grace_seconds: int) -> admin_pb2.RotateProviderTokenResponse:
        return self._call("RotateProviderToken", admin_pb2.RotateProviderTokenRequest(provider_id=provider_id, grace_seconds=grace_seconds))

    def list_providers(self) -> list[admin_pb2.ProviderInfo]:
        return list(self._call("ListProviders", admin_pb2.ListProvidersRequest()).providers)

    def cancel_job(self, job_id: str) -> str:
        return self._call("CancelJob", admin_pb2.CancelJobRequest(job_id=job_id)).job_state

    def request_checkpoint(self, job_id: str) -> str:
        return self._call("RequestCheckpoint", admin_pb2.RequestCheckpointRequest(job_id=job_id)).job_state

    def publish_run(self, run_id: str, job_id: str = "", *, override: bool = False, note: str = "") -> admin_pb2.PublishRunResponse:
        return self._call("PublishRun", admin_pb2.PublishRunRequest(run_id=run_id, job_id=job_id, override=override, note=note))


def receive_download(messages, part: Path, *, name: str, progress: bool = False) -> provider_pb2.Artifact:
    """Append a `DownloadArtifact` stream to `part` (requested from its length) and verify the whole file.

    The stream's first message is the artifact's record, then its bytes from
    `part`'s length on. They are written (O_DIRECT where possible) and hashed
    on a thread of their own while the next ones arrive, after the bytes
    `part` already held were hashed; nothing is read twice. Returns the
    record when `part` holds exactly its bytes; deletes `part` and raises
    ConfigError when the size or sha256 differ. A cut stream leaves in `part`
    what arrived (grpc.RpcError), for the next call to resume from.
    """
    part = Path(part)
    offset = part.stat().st_size if part.exists() else 0
    it = iter(messages)
    first = next(it, None)
    if first is None:
        raise ConfigError(f"the coordinator sent no artifact header for `{name}`")
    if first.WhichOneof("msg") != "artifact":
        raise ConfigError(f"the coordinator sent bytes of `{name}` before its artifact header")
    record = first.artifact
    if offset > record.size_bytes:
        raise ConfigError(f"`{part}` holds {offset} bytes, more than `{name}` has ({record.size_bytes}); delete it and retry")
    h = update_with_file(hashlib.sha256(), part) if offset else hashlib.sha256()
    f = AppendFile(part, offset)

    def write(chunk: bytes) -> None:
        f.write(chunk)
        h.update(chunk)

    writer = BackgroundWriter(write, lambda sync: f.close(sync=sync), name="download-writer")
    bar, got = None, offset
    try:
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=record.size_bytes, initial=offset, unit="B", unit_scale=True, desc=name.rsplit("/", 1)[-1], file=sys.stderr)
        for msg in it:
            if msg.WhichOneof("msg") == "artifact":
                raise ConfigError(f"the coordinator sent a second artifact header for `{name}`")
            got += len(msg.chunk)
            if got > record.size_bytes:
                break  # more than the record says: refused below, nothing more is written
            writer.put(msg.chunk)
            if bar is not None:
                bar.update(len(msg.chunk))
    finally:
        if bar is not None:
            bar.close()
        # Written out and fsynced when the stream ended; kept for a resume when it was cut.
        writer.finish(sync=True)
    size = part.stat().st_size
    if got != record.size_bytes or size != record.size_bytes or h.hexdigest() != record.sha256:
        part.unlink()
        shown = f"{got} bytes" if got != size else f"{size} bytes with sha256 `{h.hexdigest()}`"
        raise ConfigError(f"`{name}`: received {shown}, the coordinator recorded {record.size_bytes} bytes with `{record.sha256}`; nothing was kept")
    return record
