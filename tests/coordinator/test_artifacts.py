"""The artifact store as a hostile provider meets it: a real coordinator process, real gRPC streams.

Each case from issue 14's probing: squatting on another attempt's names, the `file://`
oracle (test_hostile), quotas, oversize and short uploads, sha mismatch, concurrent
uploads of one name, a slow-loris upload, a full disk. Nothing partial is visible,
nothing is lost, honest work still lands.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import threading
import time

import grpc
import pytest
from coordinator_helpers import Provider, run_spec
from launchers import wait_until

from dflash_worker.coordinator.artifacts.blobs import blob_key
from dflash_worker.proto.dflash.v1 import admin_pb2, provider_pb2

C = grpc.StatusCode


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code()


def _details(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details()


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _leased(coord, name="run", **kw):
    with coord.admin() as admin:
        run = admin.create_run(run_spec(name, **kw))
        p = Provider(coord.address, admin.create_provider(f"p-{name}"))
    p.register()
    return run, p, p.acquire().lease


def _visible(coord) -> list[str]:
    """Blob files in the local store (what a download could serve)."""
    return sorted(str(p.relative_to(coord.workdir)) for p in (coord.workdir / "artifacts").rglob("*") if p.is_file())


def test_a_failed_attempt_cannot_squat_on_the_succeeded_attempts_export(start_coordinator):
    coord = start_coordinator(lease_ttl=30, warm=True)
    run, liar, lease1 = _leased(coord)
    garbage = b"not a model"
    liar.upload(lease1.lease_id, "run/export/model.safetensors", garbage, kind="export")
    liar.finish(lease1.lease_id, provider_pb2.ATTEMPT_OUTCOME_RETRYABLE, "oops")
    with coord.admin() as admin:
        honest = Provider(coord.address, admin.create_provider("honest"))
    honest.register()
    lease2 = honest.acquire().lease
    assert lease2.attempt == 2
    real = os.urandom(50_000)
    rec = honest.upload(lease2.lease_id, "run/export/model.safetensors", real, kind="export")
    assert rec.sha256 == _sha(real)
    assert honest.finish(lease2.lease_id) == "succeeded"
    with coord.admin() as admin:
        (job,) = admin.get_run(run.run_id).jobs
        assert job.export.sha256 == _sha(real), "the succeeded attempt's export is the job's"
        finals = admin.list_artifacts(run.run_id)
        assert [(a.attempt, a.artifact.sha256) for a in finals] == [(2, _sha(real))]
        every = admin.list_artifacts(run.run_id, all_attempts=True)
        assert [(a.attempt, a.attempt_state, a.artifact.sha256) for a in every] == [(2, "succeeded", _sha(real)), (1, "retryable", _sha(garbage))]
        # No evaluation report: the regression gate held the export back; published by override.
        assert not job.publication.published and "no evaluation report" in job.publication.reason
        admin.publish_run(run.run_id, override=True, note="test: no evaluation")
        got = admin.download(run.run_id, "run/export/model.safetensors", coord.workdir / "got.bin")
        assert got.sha256 == _sha(real) and (coord.workdir / "got.bin").read_bytes() == real


def test_quotas_refuse_with_resource_exhausted_naming_the_limit(start_coordinator):
    coord = start_coordinator("--quota-attempt-records", "5", "--quota-attempt-bytes", "100000", "--quota-run-bytes", "150000", warm=True)
    run, p, lease = _leased(coord)
    for i in range(5):
        p.upload(lease.lease_id, f"r/{i}.json", b"{}")
    code, msg = _details(lambda: p.upload(lease.lease_id, "r/5.json", b"{}"))
    assert code == C.RESOURCE_EXHAUSTED and "attempt quota is 5 records" in msg and "--quota-attempt-records" in msg, msg
    # Idempotent repeats of recorded artifacts are not new records.
    assert p.upload(lease.lease_id, "r/0.json", b"{}").name == "r/0.json"
    p.finish(lease.lease_id, provider_pb2.ATTEMPT_OUTCOME_RETRYABLE, "next")
    lease2 = p.acquire().lease
    # Bytes: refused at the header, before a byte is staged.
    code, msg = _details(lambda: p.upload(lease2.lease_id, "big.bin", b"x" * 100_001))
    assert code == C.RESOURCE_EXHAUSTED and "attempt quota is 100000 bytes" in msg, msg
    p.upload(lease2.lease_id, "a.bin", b"x" * 90_000)
    p.finish(lease2.lease_id, provider_pb2.ATTEMPT_OUTCOME_RETRYABLE, "next")
    lease3 = p.acquire().lease
    # The retryable attempts' records no longer hold the run's quota (issue 34; the run quota's refusals:
    # test_hostile_names_quota.py): the next attempt's upload lands.
    assert p.upload(lease3.lease_id, "b.bin", b"y" * 70_000).size_bytes == 70_000
    assert not list((coord.workdir / "staging").rglob("*.part"))
    with coord.admin() as admin:
        # GetRun stays small whatever the records: artifacts are listed by ListArtifacts, paged.
        resp = admin.get_run(run.run_id)
        assert resp.ByteSize() < 2000
        assert len(admin.list_artifacts(run.run_id, all_attempts=True)) == 7


def test_many_records_page_and_runs_page(start_coordinator):
    coord = start_coordinator(warm=True)
    run, p, lease = _leased(coord)
    for i in range(250):
        p.upload(lease.lease_id, f"m/{i:03d}.json", b"{}", kind="metrics")
    with coord.admin() as admin:
        rows = admin.list_artifacts(run.run_id, all_attempts=True)
        assert [r.artifact.name for r in rows] == [f"m/{i:03d}.json" for i in range(250)]
        first = admin._call("ListArtifacts", admin_pb2.ListArtifactsRequest(run_id=run.run_id, all_attempts=True, page_size=7))
        assert len(first.artifacts) == 7 and first.next_page_token
        for i in range(120):
            admin.create_run(run_spec(f"r{i}"))
        assert len(admin.list_runs()) == 121
        code = _code_admin(lambda: admin._call("ListRuns", admin_pb2.ListRunsRequest(page_token="s-1; DROP")))
        assert code == C.INVALID_ARGUMENT


def _code_admin(fn):
    from dflash_worker.errors import DflashError

    with pytest.raises(DflashError) as e:
        fn()
    return e.value.grpc_code


def test_oversize_short_and_wrong_hash_uploads_leave_nothing_visible(start_coordinator):
    coord = start_coordinator(warm=True)
    run, p, lease = _leased(coord)
    data = os.urandom(3 << 20)
    before = _visible(coord)
    # Past the declared size: refused as soon as the excess arrives; the staged bytes go.
    code, msg = _details(lambda: p.upload(lease.lease_id, "x.bin", data, size=len(data) - 1))
    assert code == C.INVALID_ARGUMENT and "more bytes arrived" in msg
    # A chunk over 1 MiB is refused.
    code, _ = _details(lambda: p.upload(lease.lease_id, "y.bin", data, chunk=(1 << 20) + 1))
    assert code == C.INVALID_ARGUMENT
    # Wrong sha256: refused at commit, nothing recorded.
    code, msg = _details(lambda: p.upload(lease.lease_id, "z.bin", data, sha256=_sha(b"other")))
    assert code == C.INVALID_ARGUMENT and _sha(data) in msg  # the caller's own bytes' digest, nothing else
    # Short: the stream ends early; the bytes are kept for a resume and are invisible.
    half = len(data) // 2
    code, msg = _details(lambda: p.upload(lease.lease_id, "w.bin", data, messages=[provider_pb2.UploadArtifactRequest(chunk=data[i : min(i + (1 << 20), half)]) for i in range(0, half, 1 << 20)]))
    assert code == C.FAILED_PRECONDITION and f"resume from offset {half}" in msg
    assert _visible(coord) == before
    off = p.upload_offset(lease.lease_id, "w.bin", data)
    assert (off.offset, off.committed) == (half, False)
    # Resuming from the wrong offset is refused, naming the right one.
    code, msg = _details(lambda: p.upload(lease.lease_id, "w.bin", data, offset=half - 10))
    assert code == C.FAILED_PRECONDITION and f"resume from offset {half}" in msg
    rec = p.upload(lease.lease_id, "w.bin", data, offset=half)
    assert rec.sha256 == _sha(data)
    off = p.upload_offset(lease.lease_id, "w.bin", data)
    assert (off.offset, off.committed) == (len(data), True)
    with coord.admin() as admin:
        assert [a.artifact.name for a in admin.list_artifacts(run.run_id, all_attempts=True)] == ["w.bin"]
    header, body = p.download(lease.lease_id, "w.bin", _sha(data))
    assert body == data and header.size_bytes == len(data)
    # Download resumes by offset too.
    assert p.download(lease.lease_id, "w.bin", _sha(data), offset=len(data) - 5)[1] == data[-5:]


def test_a_checkpoint_must_list_only_uploaded_files_and_old_ones_are_collected(start_coordinator):
    coord = start_coordinator("--keep-checkpoints", "2", warm=True)
    run, p, lease = _leased(coord)
    w = {s: os.urandom(1000 + s) for s in range(1, 5)}
    manifest = json.dumps({"files": {"w.pt": {"sha256": _sha(w[1]), "size": len(w[1])}}}).encode()
    code, msg = _details(lambda: p.upload(lease.lease_id, "ck/1/manifest.json", manifest, kind="checkpoint", step=1))
    assert code == C.FAILED_PRECONDITION and "ck/1/w.pt" in msg
    for bad in (b"not json", b"[]", json.dumps({"files": {"../x": {"sha256": _sha(b""), "size": 0}}}).encode(), json.dumps({"files": {"w.pt": {"size": -1}}}).encode()):
        assert _code(lambda: p.upload(lease.lease_id, "ck/1/manifest.json", bad, kind="checkpoint", step=1)) == C.INVALID_ARGUMENT, bad
    for s in range(1, 5):
        p.checkpoint(lease.lease_id, f"ck/{s}", {"w.pt": w[s]}, step=s)
    with coord.admin() as admin:
        names = sorted(a.artifact.name for a in admin.list_artifacts(run.run_id, all_attempts=True))
    assert names == ["ck/3/manifest.json", "ck/3/w.pt", "ck/4/manifest.json", "ck/4/w.pt"]
    # The rotated checkpoints' bytes are deleted by the janitor; every record's blob is there.
    blob = lambda b: coord.workdir / "artifacts" / blob_key(_sha(b))  # noqa: E731
    wait_until(lambda: not blob(w[1]).exists() and not blob(w[2]).exists(), timeout=15)
    assert blob(w[3]).exists() and blob(w[4]).exists()
    p.finish(lease.lease_id, provider_pb2.ATTEMPT_OUTCOME_RETRYABLE, "crash")
    lease2 = p.acquire().lease
    assert lease2.resume_checkpoint.name == "ck/4/manifest.json" and lease2.resume_checkpoint.step == 4


def test_concurrent_uploads_of_one_name_one_lands(start_coordinator):
    coord = start_coordinator(warm=True)
    run, p, lease = _leased(coord)
    data = os.urandom(2 << 20)
    gate = threading.Event()

    def slow():
        yield provider_pb2.UploadArtifactRequest(chunk=data[: 1 << 20])
        gate.wait(10)
        yield provider_pb2.UploadArtifactRequest(chunk=data[1 << 20 :])

    result = {}

    def first():
        try:
            result["a"] = p.upload(lease.lease_id, "same.bin", data, messages=slow())
        except grpc.RpcError as exc:
            result["a"] = exc

    t = threading.Thread(target=first)
    t.start()
    time.sleep(0.5)
    code, msg = _details(lambda: p.upload(lease.lease_id, "same.bin", data))
    assert code == C.FAILED_PRECONDITION and "in progress" in msg
    gate.set()
    t.join(20)
    assert result["a"].sha256 == _sha(data)
    assert p.upload(lease.lease_id, "same.bin", data).sha256 == _sha(data)  # idempotent afterwards


def test_a_slow_loris_upload_is_cut_and_cleaned_up(start_coordinator):
    coord = start_coordinator("--upload-idle-timeout", "1", warm=True)
    run, p, lease = _leased(coord)
    stop = threading.Event()

    def trickle():
        yield provider_pb2.UploadArtifactRequest(chunk=b"x" * 1000)
        stop.wait(30)

    t0 = time.monotonic()
    code, msg = _details(lambda: p.upload(lease.lease_id, "loris.bin", b"x" * 100_000, messages=trickle()))
    stop.set()
    assert code == C.DEADLINE_EXCEEDED and "nothing arrived" in msg
    assert time.monotonic() - t0 < 15
    # The staged bytes are swept once idle (here: twice the limit, at least 60 s -> the attempt's end).
    p.finish(lease.lease_id, provider_pb2.ATTEMPT_OUTCOME_RETRYABLE, "gone")
    wait_until(lambda: not list((coord.workdir / "staging").rglob("*.part")), timeout=15)
    lease2 = p.acquire().lease
    assert p.upload(lease2.lease_id, "honest.bin", b"ok").sha256 == _sha(b"ok")


def test_a_damaged_database_or_schema_version_is_refused_at_start(tmp_path):
    import sqlite3
    import sys

    from coordinator_helpers import subprocess_env

    db = tmp_path / "c.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    con.execute("INSERT INTO meta VALUES ('schema_version', 'three')")
    con.commit()
    con.close()
    serve = [sys.executable, "-m", "dflash_worker.coordinator", "serve", "--db", str(db), "--listen", "127.0.0.1:0"]
    r = subprocess.run(serve, capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert r.returncode != 0 and "malformed schema version `three`" in r.stderr and "Traceback" not in r.stderr, r.stderr
    db2 = tmp_path / "d.db"
    con = sqlite3.connect(db2)
    con.execute("CREATE TABLE t (x)")
    con.executemany("INSERT INTO t VALUES (?)", [(os.urandom(500),) for _ in range(200)])
    con.commit()
    con.close()
    raw = bytearray(db2.read_bytes())
    raw[4096:8192] = os.urandom(4096)  # the second page (the table's root) is garbage
    db2.write_bytes(bytes(raw))
    r = subprocess.run([*serve[:-4], "--db", str(db2), "--listen", "127.0.0.1:0"], capture_output=True, text=True, env=subprocess_env(), timeout=60)
    err = r.stderr.lower()
    assert r.returncode != 0 and ("damaged" in err or "malformed" in err) and "traceback" not in err, r.stderr


def test_register_refuses_control_characters_in_the_name(coordinator, provider_factory):
    p = provider_factory()
    assert _code(lambda: p.register(name="box\x1b[2J")) == C.INVALID_ARGUMENT
    assert _code(lambda: p.register(name="box\u009b31m")) == C.INVALID_ARGUMENT
    assert p.register(name="box").provider_id


def _mount_tmpfs(path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode == 0


def test_a_full_disk_is_unavailable_and_the_work_lands_once_space_is_freed(start_coordinator, tmp_path):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "8m"):
        pytest.skip("needs root and `mount -t tmpfs` to make a small real filesystem (CI here runs as root)")
    try:
        coord = start_coordinator(workdir=disk, warm=True)
        run, p, lease = _leased(coord)
        hb = p.heartbeats()
        hb.send(lease.lease_id, step=1)
        filler = disk / "filler"
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (64 << 10))
                    f.flush()
            except OSError:
                pass
        export = os.urandom(1 << 20)
        code, msg = _details(lambda: p.upload(lease.lease_id, "run/export/model.safetensors", export, kind="export"))
        # Refused at admission when the declared size is past the free space (issue 34), else when a write fails.
        assert code == C.UNAVAILABLE and ("bytes free" in msg or "disk may be full" in msg), (code, msg)
        # Heartbeats go on (or are UNAVAILABLE, never INTERNAL) while the disk is full.
        try:
            hb.send(lease.lease_id, step=2)
        except grpc.RpcError as exc:
            assert exc.code() == C.UNAVAILABLE, exc
            hb = p.heartbeats()
        filler.unlink()
        rec = p.upload(lease.lease_id, "run/export/model.safetensors", export, kind="export")
        assert rec.sha256 == _sha(export)
        assert p.finish(lease.lease_id) == "succeeded"
        with coord.admin() as admin:
            assert admin.get_run(run.run_id).jobs[0].export.sha256 == _sha(export)
        coord.stop()
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_admin_get_resumes_a_partial_download_refuses_bad_bytes_and_fetches_the_whole_export(start_coordinator, tmp_path, capsys):
    from dflash_worker.coordinator.cli import main as cli_main

    coord = start_coordinator(warm=True)
    run, p, lease = _leased(coord)
    model, config = os.urandom(3 << 20), b'{"model_type": "dflash"}'
    p.upload(lease.lease_id, "run/export/model.safetensors", model, kind="export")
    p.upload(lease.lease_id, "run/export/config.json", config, kind="export")
    p.upload(lease.lease_id, "eval/report.json", b"{}")
    assert p.finish(lease.lease_id) == "succeeded"

    def cli(*argv):
        rc = cli_main([*argv, "--server", coord.address, "--admin-token-file", coord.info["admin_token_file"]])
        return rc, *capsys.readouterr()

    # The report is empty, so the regression gate held the export back: publish it by override.
    rc, out, err = cli("runs", "publish", run.run_id, "--override", "--note", "test")
    assert rc == 0 and "export published" in out, err
    dest = tmp_path / "m.safetensors"
    part = tmp_path / "m.safetensors.part"
    # An interrupted earlier fetch left the first MiB: the next call asks only for the rest.
    part.write_bytes(model[: 1 << 20])
    rc, out, err = cli("artifacts", "get", run.run_id, "run/export/model.safetensors", "-o", str(dest))
    assert rc == 0, err
    assert dest.read_bytes() == model and not part.exists() and "(verified)" in out
    # A `.part` whose bytes are not the artifact's: refused, nothing kept at PATH, the bad bytes gone.
    dest.unlink()
    part.write_bytes(b"\0" * 1000)
    rc, out, err = cli("artifacts", "get", run.run_id, "run/export/model.safetensors", "-o", str(dest))
    assert rc != 0 and "nothing was kept" in err and not dest.exists() and not part.exists(), err
    rc, out, err = cli("artifacts", "get", run.run_id, "run/export/model.safetensors", "-o", str(dest))
    assert rc == 0 and dest.read_bytes() == model, err
    # The whole export in one command: every `export` record of the succeeded attempt.
    rc, out, err = cli("artifacts", "get", run.run_id, "--export", "-o", str(tmp_path / "export"), "--json")
    assert rc == 0, err
    assert sorted(d["name"] for d in json.loads(out)) == ["run/export/config.json", "run/export/model.safetensors"]
    assert (tmp_path / "export" / "model.safetensors").read_bytes() == model and (tmp_path / "export" / "config.json").read_bytes() == config
    # A name the run does not have: NOT_FOUND, and the message names only what was asked.
    rc, out, err = cli("artifacts", "get", run.run_id, "run/export/nope.bin", "-o", str(tmp_path / "x"))
    assert rc != 0 and "no artifact `run/export/nope.bin`" in err, err
    rc, out, err = cli("artifacts", "list", run.run_id)
    assert rc == 0 and "run/export/model.safetensors" in out and "eval/report.json" in out
