"""Helpers for the coordinator tests: gRPC clients for a coordinator process (started by `launchers.Coordinator`,
through the `start_coordinator` fixture) and store helpers."""

from __future__ import annotations

import json
import os
import queue
from pathlib import Path

import grpc

from dflash_worker.coordinator.store import Registration, RunSpecData, Store
from dflash_worker.proto.dflash.v1 import admin_pb2, provider_pb2, provider_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
CLIENT_VERSION = "0.1.0"
SPEC = json.dumps({"stages": ["train"], "recipe": {"steps": 4}, "data": "file:///data/x.jsonl", "target": "tiny-qwen3"})


def registration(name: str = "box", **kw) -> Registration:
    """A cpu provider's registration as the run-manager sends it; `kw` overrides fields."""
    fields = dict(client_version=CLIENT_VERSION, native_client_version="", launch_mode=1, native=False, backend="cpu",
                  device_count=1, features=(), capabilities=b"", name=name)  # fmt: skip
    return Registration(**(fields | kw))


def register_provider(store: Store, name: str = "box", **kw) -> str:
    """Create a provider in `store` and register it (`registration(name, **kw)`); returns its id."""
    pid, _ = store.credentials.create_provider(name)
    store.providers.register(pid, registration(name, **kw))
    return pid


def store_lease(store: Store, *, num_jobs: int = 1):
    """One provider, one run of `num_jobs` jobs, and the provider's lease on its first: `(pid, run, grant, live lease)`."""
    pid = register_provider(store)
    run = store.runs.create_run(RunSpecData(name="r", spec_json="{}", required_client_version=CLIENT_VERSION, num_jobs=num_jobs))
    g = store.leases.acquire(pid)
    return pid, run, g, store.leases.live_lease(pid, g.lease_id)


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    # Works whether or not the package is installed editable into the venv.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("DFLASH_ADMIN_TOKEN", None)
    return env


class HeartbeatStream:
    """A live bidirectional Heartbeat stream: `send()` one message, get its response."""

    def __init__(self, stub, metadata):
        self._q: queue.Queue = queue.Queue()
        self._responses = stub.Heartbeat(iter(self._q.get, None), metadata=metadata, timeout=30)

    def send(self, lease_id: str, *, phase=provider_pb2.PHASE_TRAIN, step=0, committed_step=0, metrics=None):
        self._q.put(provider_pb2.HeartbeatRequest(lease_id=lease_id, phase=phase, step=step, total_steps=10, committed_step=committed_step, metrics=metrics or {"loss": 1.5}))
        return next(self._responses)

    def send_raw(self, request):
        self._q.put(request)
        return next(self._responses)

    def close(self):
        self._q.put(None)
        self._responses.cancel()


class Provider:
    """A provider's side of `dflash.v1.ProviderService` over a real channel."""

    def __init__(self, address: str, token: str, *, max_message_bytes: int = 64 << 20, credentials: grpc.ChannelCredentials | None = None):
        options = [("grpc.max_send_message_length", max_message_bytes), ("grpc.max_receive_message_length", max_message_bytes)]
        self.channel = grpc.secure_channel(address, credentials, options=options) if credentials else grpc.insecure_channel(address, options=options)
        self.stub = provider_pb2_grpc.ProviderServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.provider_id = ""

    def register(
        self, *, client_version=CLIENT_VERSION, native=False, native_client_version="", backend="cuda", device_count=1, features=("flash_attention_2",),
        name="box", memory_bytes=8 << 30,
    ):  # fmt: skip
        resp = self.stub.Register(
            provider_pb2.RegisterRequest(
                client_version=client_version,
                protocol_version="dflash.v1",
                launch_mode=provider_pb2.LAUNCH_MODE_NATIVE if native else provider_pb2.LAUNCH_MODE_DOCKER,
                capabilities=provider_pb2.DeviceCapabilities(
                    backend=backend, device_count=device_count, memory_bytes=memory_bytes, supports_bf16=True, features=list(features), platform="linux-x86_64"
                ),
                name=name,
                native_client_version=native_client_version,
            ),
            metadata=self.metadata,
            timeout=10,
        )
        self.provider_id = resp.provider_id
        return resp

    def acquire(self, wait: int = 0) -> provider_pb2.AcquireLeaseResponse:
        return self.stub.AcquireLease(provider_pb2.AcquireLeaseRequest(provider_id=self.provider_id, wait_seconds=wait), metadata=self.metadata, timeout=30)

    def heartbeats(self) -> HeartbeatStream:
        return HeartbeatStream(self.stub, self.metadata)

    def heartbeat_once(self, lease_id: str, **kw) -> provider_pb2.HeartbeatResponse:
        s = self.heartbeats()
        try:
            return s.send(lease_id, **kw)
        finally:
            s.close()

    def upload(
        self, lease_id: str, name: str, content: bytes, *, kind="report", step=0, sha256=None, size=None, uri="", offset=0, chunk=1 << 20, messages=None,
        timeout=30,
    ):  # fmt: skip
        """UploadArtifact: a header, then `content[offset:]` in chunks (or the given raw `messages` after the header)."""
        art = artifact(name, content, kind=kind, step=step, sha256=sha256, size=size, uri=uri)

        def requests():
            yield provider_pb2.UploadArtifactRequest(header=provider_pb2.UploadHeader(lease_id=lease_id, artifact=art, offset=offset))
            if messages is not None:
                yield from messages
                return
            for i in range(offset, len(content), chunk):
                yield provider_pb2.UploadArtifactRequest(chunk=content[i : i + chunk])

        return self.stub.UploadArtifact(requests(), metadata=self.metadata, timeout=timeout).artifact

    def upload_offset(self, lease_id: str, name: str, content: bytes, *, kind="report", step=0, sha256=None, size=None) -> provider_pb2.UploadOffsetResponse:
        art = artifact(name, content, kind=kind, step=step, sha256=sha256, size=size)
        return self.stub.UploadOffset(provider_pb2.UploadOffsetRequest(lease_id=lease_id, artifact=art), metadata=self.metadata, timeout=10)

    def checkpoint(self, lease_id: str, directory: str, files: dict[str, bytes], *, step: int) -> provider_pb2.Artifact:
        """Upload a checkpoint the way run-manager does: each listed file, then `DIR/manifest.json`."""
        import hashlib

        for fname, data in files.items():
            self.upload(lease_id, f"{directory}/{fname}", data, kind="checkpoint_file", step=step)
        manifest = json.dumps({"step": step, "files": {f: {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d)} for f, d in files.items()}}).encode()
        return self.upload(lease_id, f"{directory}/manifest.json", manifest, kind="checkpoint", step=step)

    def download(self, lease_id: str, name: str, sha256: str, *, offset: int = 0) -> tuple[provider_pb2.Artifact, bytes]:
        header, body = None, []
        for msg in self.stub.DownloadArtifact(provider_pb2.DownloadArtifactRequest(lease_id=lease_id, name=name, sha256=sha256, offset=offset), metadata=self.metadata, timeout=30):
            if msg.WhichOneof("msg") == "artifact":
                header = msg.artifact
            else:
                body.append(msg.chunk)
        return header, b"".join(body)

    def finish(self, lease_id: str, outcome=provider_pb2.ATTEMPT_OUTCOME_SUCCEEDED, message="") -> str:
        return self.stub.FinishAttempt(provider_pb2.FinishAttemptRequest(lease_id=lease_id, outcome=outcome, message=message), metadata=self.metadata, timeout=10).job_state

    def close(self):
        self.channel.close()


def artifact(name: str, content: bytes, *, kind="report", step=0, sha256=None, size=None, uri="") -> provider_pb2.Artifact:
    import hashlib

    return provider_pb2.Artifact(
        name=name, kind=kind, sha256=sha256 or hashlib.sha256(content).hexdigest(), size_bytes=len(content) if size is None else size, uri=uri, step=step
    )


def run_spec(name: str, **kw) -> admin_pb2.RunSpec:
    base = dict(name=name, spec_json=SPEC, required_client_version=CLIENT_VERSION, checkpoint_policy="durable", max_local_ranks=1, image="ghcr.io/x/dflash-worker:0.1.0", num_jobs=1)
    base.update(kw)
    return admin_pb2.RunSpec(**base)


def code_of(excinfo) -> grpc.StatusCode:
    return excinfo.value.code()

