"""Verification by replay end to end (issue 34 item 2): a graph run with `verify_fraction` 1 and three
providers, one hostile. The hostile one is a scripted client on the real gRPC API that runs the real
worker for its leases, but forges every capture shard it produces (the first shard's features scaled by
0.5, its sidecar rewritten to hash right, so the capture's own checks accept it). Two honest run-managers
take the rest. A verify job, on an honest provider, recomputes the forged capture: the hostile provider is
quarantined (leased nothing more, `providers list` says so, /metrics counts it), its capture is redone by
an honest provider and verified again, and the run's export is byte-identical to the clean one-job run's."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from pathlib import Path

import pytest
from e2e_helpers import client_version, sha256_file, wait_until
from test_e2e_graph import _finish, _job_dir, _kinds, _provider

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "coordinator"))
from coordinator_helpers import Provider  # noqa: E402

from dflash_worker.proto.dflash.v1 import provider_pb2  # noqa: E402

pytestmark = pytest.mark.slow

N_CAPTURE = 2


def _forge(job_dir: Path, names: list[str]) -> None:
    """Scale the first capture shard's features by 0.5 and rewrite its sidecar to match, in place."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shard = job_dir / sorted(n for n in names if n.endswith(".safetensors"))[0]
    with safe_open(str(shard), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        meta = f.metadata()
    tensors["features"] = tensors["features"] * 0.5
    save_file(tensors, str(shard), metadata=meta)
    sidecar = shard.with_suffix(".json")
    side = json.loads(sidecar.read_text())
    side["sha256"] = sha256_file(shard)
    sidecar.write_text(json.dumps(side))


class Hostile:
    """A provider that runs the real worker for each lease it takes and forges the capture shards it uploads."""

    def __init__(self, coord, root: Path):
        self.p = Provider(coord.address, coord.provider_token("hostile"))
        self.p.register(name="hostile", client_version=client_version(), backend="cpu", features=("job_graph",), memory_bytes=8 << 30)
        self.root = root
        self.leases: list[provider_pb2.Lease] = []
        self.forged: list[str] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        try:
            while not self.stop.is_set():
                resp = self.p.acquire(wait=1)
                if resp.WhichOneof("result") != "lease":
                    continue
                lease = resp.lease
                self.leases.append(lease)
                if lease.kind not in ("prepare", "capture"):  # it came for the captures; the rest is left to others
                    self.p.finish(lease.lease_id, provider_pb2.ATTEMPT_OUTCOME_RETRYABLE, "not this one")
                    time.sleep(5)
                    continue
                self._run(lease)
        except BaseException:  # noqa: BLE001 (reported by the test)
            self.errors.append(traceback.format_exc())

    def _run(self, lease) -> None:
        job_dir = self.root / f"{lease.job_id}-{lease.attempt}"
        job_dir.mkdir(parents=True)
        inputs = []
        for a in lease.inputs:
            _, body = self.p.download(lease.lease_id, a.name, a.sha256)
            dest = job_dir / a.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(body)
            inputs.append({"name": a.name, "kind": a.kind, "sha256": a.sha256, "size_bytes": a.size_bytes, "uri": a.uri, "path": str(dest)})
        graph = {"kind": lease.kind, "shard_index": lease.shard_index, "shard_count": lease.shard_count, "inputs": inputs}
        (job_dir / "spec.json").write_text(json.dumps({"schema_version": 1, "spec": json.loads(lease.spec_json), "graph": graph}))
        done = threading.Event()

        def beat() -> None:  # the lease lives while the worker runs
            while not done.wait(2.0):
                self.p.heartbeat_once(lease.lease_id, phase=provider_pb2.PHASE_CAPTURE)

        beats = threading.Thread(target=beat, daemon=True)
        beats.start()
        try:
            out = subprocess.run([sys.executable, "-m", "dflash_worker.job", "--job-dir", str(job_dir)], capture_output=True, text=True, timeout=600,
                                 env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})  # fmt: skip
        finally:
            done.set()
            beats.join(30)
        assert out.returncode == 0, out.stderr[-3000:]
        arts = [json.loads(line) for line in out.stdout.splitlines()]
        arts = [e for e in arts if e["event"] == "artifact"]
        if lease.kind == "capture":
            _forge(job_dir, [a["name"] for a in arts])
            self.forged.append(lease.job_id)
        for a in arts:
            self.p.upload(lease.lease_id, a["name"], (job_dir / a["name"]).read_bytes(), kind=a["kind"], step=a.get("step", 0))
        self.p.finish(lease.lease_id)


def test_a_forged_capture_is_caught_its_provider_quarantined_and_the_export_unchanged(tmp_path, procs, spec, baseline):
    coord = procs.coordinator(tmp_path / "coord", lease_ttl=10, serve_args=("--http-listen", "127.0.0.1:0"))
    run_id = coord.create_run("verified", {**spec, "verify_fraction": 1}, "--capture-shards", str(N_CAPTURE), client_version=client_version())
    kinds = _kinds(coord, run_id)
    assert sorted(k for k, _ in kinds.values()) == ["capture", "capture", "evaluate", "prepare", "train", "verify", "verify"]
    hostile = Hostile(coord, tmp_path / "hostile")
    hostile.thread.start()
    # The honest providers join once the hostile one holds a capture lease (so it surely forges one).
    wait_until(lambda: hostile.errors or any(le.kind == "capture" for le in hostile.leases), timeout=300, interval=0.2, what="the hostile capture")
    assert not hostile.errors, hostile.errors
    rms = [_provider(procs, coord, tmp_path, f"p{i}") for i in range(2)]
    try:
        shown = _finish(coord, run_id, rms)
    finally:
        hostile.stop.set()
        hostile.thread.join(30)
    assert not hostile.errors, hostile.errors
    assert hostile.forged, "the hostile provider captured nothing"

    # Quarantined, with the verify job and capture job named; leased nothing more.
    providers = {p["identity"]: p for p in coord.cli_json("providers", "list")}
    bad = providers["hostile"]
    assert int(bad["quarantined_unix"]) > 0 and "recomputed capture job" in bad["quarantine_reason"], bad
    assert int(providers["p0"]["quarantined_unix"]) == int(providers["p1"]["quarantined_unix"]) == 0
    assert "QUARANTINED" in coord.cli("providers", "list").stdout
    assert hostile.p.acquire().WhichOneof("result") == "no_work"

    # Its forged capture was discarded and redone by an honest provider, then verified again.
    forged = hostile.forged[0]
    states = [s for _, s, _ in coord.attempt_messages(forged)]
    assert states[0] == "discarded" and states[-1] == "succeeded", coord.attempt_messages(forged)
    ((redo_by,),) = coord._query("SELECT p.identity FROM attempts a JOIN providers p USING (provider_id) WHERE a.job_id=? AND a.state='succeeded'", forged)
    assert redo_by in ("p0", "p1")
    verify_states = [s for j, (k, _) in kinds.items() if k == "verify" for _, s, _ in coord.attempt_messages(j)]
    assert "mismatch" in verify_states and verify_states.count("succeeded") == N_CAPTURE, verify_states
    assert all(j["state"] == "succeeded" for j in shown["jobs"]), shown["jobs"]

    # The export equals the clean one-job run's.
    (train_id,) = [j for j, (k, _) in kinds.items() if k == "train"]
    assert sha256_file(_job_dir(rms, train_id) / "run" / "export" / "model.safetensors") == baseline.export_sha256
    out = tmp_path / "admin" / "export"
    coord.cli("artifacts", "get", run_id, "--export", "-o", str(out))
    (got,) = out.rglob("model.safetensors")
    assert sha256_file(got) == baseline.export_sha256

    req = urllib.request.Request(coord.info["http_address"] + "/metrics", headers={"Authorization": f"Bearer {coord.admin_token}"})
    metrics = urllib.request.urlopen(req, timeout=10).read().decode()
    assert 'dflash_providers{state="quarantined"} 1.0' in metrics
    assert "dflash_verify_mismatches_total 1.0" in metrics
