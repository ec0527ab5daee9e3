"""Verification by replay end to end (issue 34 item 2): graph runs with `verify_fraction` 1 and three providers,
one hostile. The hostile one is a scripted client on the real gRPC API that runs the real worker for its leases
(`Scripted`, in a pre-warmed fork: `prewarmed.run_main`), but tampers with what it uploads:

- it forges every capture shard it produces (the first shard's features scaled by 0.5, its sidecar rewritten to
  hash right, so the capture's own checks accept it); two honest run-managers take the rest. A verify job, on
  an honest provider, recomputes the forged capture;
- or it trains honestly and then scales the selected checkpoint's weights by 0.5 (its manifest rewritten to
  hash right) and exports it again (the selection updated to match, so the evaluate jobs would accept it); an
  honest scripted client and an honest run-manager take the rest. The train replay's verify job, on an honest
  provider, replays training from step 0 to the selected step.

Either way the hostile provider is quarantined (leased nothing more, `providers list` says so, /metrics counts
it), its work is redone by an honest provider and verified again, and the run's export is byte-identical to
the clean one-job run's. A third run, all honest, at fraction 1/8: the train replay starts from the producer's
checkpoint, which the verifier's real run-manager downloads as its resume checkpoint."""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
import urllib.request
from pathlib import Path

import pytest
from e2e_helpers import client_version, sha256_file
from launchers import wait_until
from test_e2e_graph import _finish, _job_dir, _kinds, _provider

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "coordinator"))
from coordinator_helpers import Provider  # noqa: E402
from prewarmed import run_main  # noqa: E402

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


def _tamper_training(job_dir: Path, spec: dict) -> None:
    """Scale the selected checkpoint's trained weights by 0.5 (its manifest rewritten to hash right) and export it
    again with the real code, the selection updated to match: everything the worker's own checks read agrees."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from dflash_worker.train.export_run import export_run
    from dflash_worker.worker.spec import job_recipe

    run = job_dir / "run"
    selection = json.loads((run / "selection.json").read_text())
    ckpt = run / "checkpoints" / selection["checkpoint"]
    f = ckpt / "trainable.safetensors"
    with safe_open(str(f), "pt") as g:
        tensors = {k: g.get_tensor(k) for k in g.keys()}  # noqa: SIM118
        meta = g.metadata()
    save_file({k: t * 0.5 for k, t in tensors.items()}, str(f), metadata=meta)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["trainable.safetensors"] = {"sha256": sha256_file(f), "size": f.stat().st_size}
    (ckpt / "manifest.json").write_text(json.dumps(manifest, sort_keys=True, indent=1) + "\n")
    out = export_run(run, fmt=selection["export"]["format"], recipe=job_recipe(spec["recipe"], job_dir), selection=selection)
    selection["checkpoint_manifest_sha256"] = sha256_file(ckpt / "manifest.json")
    selection["export"]["manifest_sha256"] = sha256_file(out.out_dir / "manifest.json")
    (run / "selection.json").write_text(json.dumps(selection))


def _assert_clean_export_and_one_quarantine(coord, run_id: str, tmp_path: Path, baseline) -> None:
    """The run's export, as an admin fetches it, is the clean one-job run's; /metrics counts one quarantine."""
    out = tmp_path / "admin" / "export"
    coord.cli("artifacts", "get", run_id, "--export", "-o", str(out))
    (got,) = out.rglob("model.safetensors")
    assert sha256_file(got) == baseline.export_sha256

    req = urllib.request.Request(coord.info["http_address"] + "/metrics", headers={"Authorization": f"Bearer {coord.admin_token}"})
    metrics = urllib.request.urlopen(req, timeout=10).read().decode()
    assert 'dflash_providers{state="quarantined"} 1.0' in metrics
    assert "dflash_verify_mismatches_total 1.0" in metrics


class Scripted:
    """A provider that runs the real worker for each lease it takes and uploads what it wrote, as a run-manager
    does; `tamper` (`capture`: forge its capture shards; `train`: tamper with its training; `verify`: forge what
    it recomputes for a capture's verify job) makes it hostile.
    `kinds`: the lease kinds it works on; it ends any other RETRYABLE and waits."""

    def __init__(self, coord, root: Path, name: str = "hostile", *, tamper: str | None = "capture", kinds: tuple[str, ...] | None = ("prepare", "capture")):
        self.p = Provider(coord.address, coord.provider_token(name))
        self.p.register(name=name, client_version=client_version(), backend="cpu", features=("job_graph",), memory_bytes=8 << 30)
        self.root, self.tamper, self.kinds = root, tamper, kinds
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
                if self.kinds is not None and lease.kind not in self.kinds:  # it came for these; the rest is left to others
                    self.leases.append(lease)
                    self.p.finish(lease.lease_id, provider_pb2.ATTEMPT_OUTCOME_RETRYABLE, "not this one")
                    time.sleep(5)
                    continue
                self.run(lease)
        except BaseException:  # noqa: BLE001 (reported by the test)
            self.errors.append(traceback.format_exc())

    def next(self, kind: str) -> provider_pb2.Lease:
        """Take the next lease, which must be of `kind`, and run it (a test's step)."""
        resp = self.p.acquire(wait=5)
        assert resp.WhichOneof("result") == "lease" and resp.lease.kind == kind, resp
        self.run(resp.lease)
        return resp.lease

    def run(self, lease) -> None:
        self.leases.append(lease)
        job_dir = self.root / f"{lease.job_id}-{lease.attempt}"
        job_dir.mkdir(parents=True)
        inputs = []
        for a in lease.inputs:
            _, body = self.p.download(lease.lease_id, a.name, a.sha256)
            dest = job_dir / a.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(body)
            inputs.append({"name": a.name, "kind": a.kind, "sha256": a.sha256, "size_bytes": a.size_bytes, "uri": a.uri, "path": str(dest)})
        assert not lease.HasField("resume_checkpoint"), lease  # (fraction 1: a replay starts at step 0; no attempt here resumes)
        graph = {"kind": lease.kind, "shard_index": lease.shard_index, "shard_count": lease.shard_count, "inputs": inputs}
        (job_dir / "spec.json").write_text(json.dumps({"schema_version": 1, "spec": json.loads(lease.spec_json), "graph": graph}))
        done = threading.Event()

        def beat() -> None:  # the lease lives while the worker runs
            while not done.wait(2.0):
                self.p.heartbeat_once(lease.lease_id, phase=provider_pb2.PHASE_CAPTURE)

        beats = threading.Thread(target=beat, daemon=True)
        beats.start()
        try:
            # a pre-warmed fork (`prewarmed.run_main`): the honest run-managers start real interpreters
            out = run_main("dflash_worker.job", ["--job-dir", job_dir], timeout=600, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
        finally:
            done.set()
            beats.join(30)
        assert out.returncode == 0, out.stderr[-3000:]
        arts = [json.loads(line) for line in out.stdout.splitlines()]
        arts = [e for e in arts if e["event"] == "artifact"]
        if lease.kind == "capture" and self.tamper == "capture":
            _forge(job_dir, [a["name"] for a in arts])
            self.forged.append(lease.job_id)
        if lease.kind == "verify" and self.tamper == "verify":  # a lying verifier (tests/e2e/test_e2e_tiebreak.py)
            _forge(job_dir, [a["name"] for a in arts])
            self.forged.append(lease.job_id)
        if lease.kind == "train" and self.tamper == "train":
            _tamper_training(job_dir, json.loads(lease.spec_json))
            self.forged.append(lease.job_id)
        for a in arts:
            step = a.get("step", 0)
            if a["kind"] == "checkpoint":  # its files first, then the manifest (as the run-manager uploads one)
                if not (job_dir / a["name"]).is_file():
                    continue  # pruned since
                ckpt = (job_dir / a["name"]).parent
                for f in json.loads((ckpt / "manifest.json").read_text())["files"]:
                    self.p.upload(lease.lease_id, f"{Path(a['name']).parent.as_posix()}/{f}", (ckpt / f).read_bytes(), kind="checkpoint_file", step=step)
            self.p.upload(lease.lease_id, a["name"], (job_dir / a["name"]).read_bytes(), kind=a["kind"], step=step)
        self.p.finish(lease.lease_id)


def test_a_forged_capture_is_caught_its_provider_quarantined_and_the_export_unchanged(tmp_path, procs, spec, baseline):
    coord = procs.coordinator(tmp_path / "coord", lease_ttl=10, serve_args=("--http-listen", "127.0.0.1:0"), warm=True)
    run_id = coord.create_run("verified", {**spec, "verify_fraction": 1}, "--capture-shards", str(N_CAPTURE), client_version=client_version())
    kinds = _kinds(coord, run_id)
    assert sorted(k for k, _ in kinds.values()) == ["capture", "capture", "evaluate", "prepare", "train", "verify", "verify", "verify"]
    hostile = Scripted(coord, tmp_path / "hostile")
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
    assert "mismatch" in verify_states and verify_states.count("succeeded") == N_CAPTURE + 1, verify_states  # (+ the train replay)
    assert all(j["state"] == "succeeded" for j in shown["jobs"]), shown["jobs"]

    # The export equals the clean one-job run's.
    (train_id,) = [j for j, (k, _) in kinds.items() if k == "train"]
    assert sha256_file(_job_dir(rms, train_id) / "run" / "export" / "model.safetensors") == baseline.export_sha256
    _assert_clean_export_and_one_quarantine(coord, run_id, tmp_path, baseline)


def test_a_tampered_training_is_caught_its_provider_quarantined_and_the_export_unchanged(tmp_path, procs, spec, baseline):
    coord = procs.coordinator(tmp_path / "coord", lease_ttl=10, serve_args=("--http-listen", "127.0.0.1:0"), warm=True)
    run_id = coord.create_run("replayed", {**spec, "verify_fraction": 1}, "--capture-shards", str(N_CAPTURE), client_version=client_version())
    kinds = _kinds(coord, run_id)
    hostile = Scripted(coord, tmp_path / "hostile", tamper="train", kinds=None)
    honest = Scripted(coord, tmp_path / "honest", "honest", tamper=None, kinds=None)
    # In turn, so the hostile provider surely trains: it prepares and captures (honestly), the honest scripted
    # provider verifies both captures, then the hostile provider trains and tampers with the result.
    hostile.next("prepare")
    hostile.next("capture")
    hostile.next("capture")
    honest.next("verify")
    honest.next("verify")
    (train_id,) = [j for j, (k, _) in kinds.items() if k == "train"]
    assert hostile.next("train").job_id == train_id and hostile.forged == [train_id]
    # The rest: the honest scripted provider and an honest run-manager.
    honest.thread.start()
    rms = [_provider(procs, coord, tmp_path, "p0")]
    try:
        shown = _finish(coord, run_id, rms)
    finally:
        honest.stop.set()
        honest.thread.join(60)
    assert not honest.errors, honest.errors

    # Quarantined by the train replay, naming the tampered checkpoint; leased nothing more.
    providers = {p["identity"]: p for p in coord.cli_json("providers", "list")}
    bad = providers["hostile"]
    assert int(bad["quarantined_unix"]) > 0 and f"recomputed train job `{train_id}`" in bad["quarantine_reason"], bad
    assert "trainable.safetensors" in bad["quarantine_reason"] or "model.safetensors" in bad["quarantine_reason"], bad
    assert int(providers["honest"]["quarantined_unix"]) == int(providers["p0"]["quarantined_unix"]) == 0
    assert hostile.p.acquire().WhichOneof("result") == "no_work"

    # Its training was discarded and redone by an honest provider, then replayed again; its captures (unused) redone too.
    states = [s for _, s, _ in coord.attempt_messages(train_id)]
    assert states[0] == "discarded" and states[-1] == "succeeded", coord.attempt_messages(train_id)
    ((redo_by,),) = coord._query("SELECT p.identity FROM attempts a JOIN providers p USING (provider_id) WHERE a.job_id=? AND a.state='succeeded'", train_id)
    assert redo_by in ("honest", "p0")
    ((replay,),) = coord._query("SELECT job_id FROM job_deps JOIN jobs USING (job_id) WHERE needs_job_id=? AND kind='verify'", train_id)
    replay_states = [s for _, s, _ in coord.attempt_messages(replay)]
    assert replay_states[0] == "mismatch" and replay_states[-1] == "succeeded", replay_states
    assert all(j["state"] == "succeeded" for j in shown["jobs"]), shown["jobs"]

    # The export equals the clean one-job run's.
    _assert_clean_export_and_one_quarantine(coord, run_id, tmp_path, baseline)


def test_a_partial_replay_starts_from_the_producer_s_checkpoint_on_a_real_run_manager(tmp_path, procs, spec, baseline):
    """Fraction 1/8 of 16 steps (a checkpoint every 2; the coordinator holds the newest two): the train replay
    starts from the producer's step-14 checkpoint, which the verifier's run-manager downloads from the train job
    as its resume checkpoint, replays steps 15-16, and matches; the run succeeds with the clean run's export."""
    coord = procs.coordinator(tmp_path / "coord", lease_ttl=10, warm=True)
    run_id = coord.create_run("partial", {**spec, "verify_fraction": 0.125}, "--capture-shards", str(N_CAPTURE), client_version=client_version())
    rms = [_provider(procs, coord, tmp_path, f"p{i}") for i in range(2)]
    _finish(coord, run_id, rms)
    (train_id,) = [j for j, (k, _) in _kinds(coord, run_id).items() if k == "train"]
    ((replay,),) = coord._query("SELECT job_id FROM job_deps JOIN jobs USING (job_id) WHERE needs_job_id=? AND kind='verify'", train_id)
    assert [s for _, s, _ in coord.attempt_messages(replay)] == ["succeeded"]
    replay_dir = _job_dir(rms, replay)
    assert (replay_dir / "resume" / "run" / "checkpoints" / "step-00000014" / "trainable.safetensors").is_file()
    assert sorted(p.name for p in (replay_dir / "verify" / "run" / "checkpoints").iterdir()) == ["LATEST", "step-00000014", "step-00000016"]
    assert not [p for p in coord.cli_json("providers", "list") if int(p["quarantined_unix"])]
    out = tmp_path / "admin" / "export"
    coord.cli("artifacts", "get", run_id, "--export", "-o", str(out))
    (got,) = out.rglob("model.safetensors")
    assert sha256_file(got) == baseline.export_sha256
