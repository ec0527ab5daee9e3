"""Issue 34, the artifact store's admission: names that read as other names, disk space and quotas.

A real coordinator process and real gRPC streams where the behaviour is a status code a provider
sees; the store (real SQLite) where it is a race the network cannot time.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil

import grpc
import pytest
from coordinator_helpers import Provider, code_of, run_spec, store_lease

from dflash_worker.coordinator.artifacts import staging as staging_mod
from dflash_worker.coordinator.artifacts.names import Claim, check_name, escape_name
from dflash_worker.coordinator.artifacts.staging import Staging
from dflash_worker.coordinator.store import Quotas, Store
from dflash_worker.errors import InvalidRequestError, QuotaError, StorageError
from dflash_worker.proto.dflash.v1 import provider_pb2

C = grpc.StatusCode

# Bidirectional overrides and isolates, directional marks, zero-width characters, BOM (issue 34's list).
INVISIBLE = [*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C, 0x200B, 0x200C, 0x200D, 0x2060, 0xFEFF]


def _details(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return code_of(e), e.value.details()


def _leased(coord, name="run"):
    with coord.admin() as admin:
        run = admin.create_run(run_spec(name))
        p = Provider(coord.address, admin.create_provider(f"p-{name}"))
    p.register()
    return run, p, p.acquire().lease


def _names(coord, run_id) -> list[tuple[int, str]]:
    with coord.admin() as admin:
        return sorted((a.attempt, a.artifact.name) for a in admin.list_artifacts(run_id, all_attempts=True))


@pytest.mark.parametrize("cp", INVISIBLE, ids=lambda cp: f"U+{cp:04X}")
def test_check_name_refuses_invisible_characters_naming_them_escaped(cp):
    name = f"run/export/model{chr(cp)}.safetensors"
    with pytest.raises(InvalidRequestError) as e:
        check_name(name)
    msg = str(e.value)
    assert f"U+{cp:04X}" in msg and f"model\\u{cp:04x}.safetensors" in msg, msg
    assert chr(cp) not in msg, "the message must not carry the character itself"


def test_invisible_characters_are_refused_before_a_byte_is_staged(coordinator):
    run, p, lease = _leased(coordinator)
    for cp in (0x202E, 0x2067, 0x200B, 0xFEFF, 0x061C):
        name = f"exe{chr(cp)}nib.json"
        for send in (p.upload_offset, p.upload):  # a unary call and a stream
            code, msg = _details(lambda: send(lease.lease_id, name, b"{}"))
            assert code == C.INVALID_ARGUMENT and f"exe\\u{cp:04x}nib.json" in msg, (hex(cp), code, msg)
    assert not list((coordinator.workdir / "staging").rglob("*.part"))
    assert _names(coordinator, run.run_id) == []
    # Visible non-ASCII names are still names.
    assert p.upload(lease.lease_id, "données/é.json", b"{}").name == "données/é.json"


def test_case_and_normalisation_twins_within_a_job_are_refused_naming_both(coordinator):
    run, p, lease = _leased(coordinator)
    p.upload(lease.lease_id, "ckpt/Model.bin", b"one")
    code, msg = _details(lambda: p.upload(lease.lease_id, "ckpt/model.bin", b"two"))
    assert code == C.INVALID_ARGUMENT and "`ckpt/model.bin`" in msg and "`ckpt/Model.bin`" in msg and "case" in msg, msg
    nfc, nfd = "caf\u00e9.json", "cafe\u0301.json"
    p.upload(lease.lease_id, nfc, b"{}")
    code, msg = _details(lambda: p.upload(lease.lease_id, nfd, b"{}"))
    assert code == C.INVALID_ARGUMENT and f"`{escape_name(nfd)}`" in msg and "`caf\\u00e9.json`" in msg, msg
    # A non-ASCII name folding to an ASCII one (LATIN SMALL LETTER LONG S, KELVIN SIGN).
    p.upload(lease.lease_id, "state.json", b"{}")
    assert _details(lambda: p.upload(lease.lease_id, "\u017ftate.json", b"{}"))[0] == C.INVALID_ARGUMENT
    assert _details(lambda: p.upload(lease.lease_id, "STATE.JSON", b"{}"))[0] == C.INVALID_ARGUMENT
    p.upload(lease.lease_id, "\u212a.json", b"{}")
    assert _details(lambda: p.upload(lease.lease_id, "k.json", b"{}"))[0] == C.INVALID_ARGUMENT
    # The same name again is the same artifact (idempotent), not a twin.
    assert p.upload(lease.lease_id, "ckpt/Model.bin", b"one").sha256 == hashlib.sha256(b"one").hexdigest()
    # A later attempt of the same job meets the earlier attempt's names; it may reuse them exactly.
    p.finish(lease.lease_id, provider_pb2.ATTEMPT_OUTCOME_RETRYABLE, "retry")
    lease2 = p.acquire().lease
    assert lease2.attempt == 2
    code, msg = _details(lambda: p.upload(lease2.lease_id, "CKPT/MODEL.BIN", b"three"))
    assert code == C.INVALID_ARGUMENT and "`ckpt/Model.bin`" in msg, msg
    p.upload(lease2.lease_id, "ckpt/Model.bin", b"three")
    # Another job is another namespace.
    run_b, p_b, lease_b = _leased(coordinator, "other")
    p_b.upload(lease_b.lease_id, "ckpt/model.bin", b"two")
    assert (1, "ckpt/model.bin") in _names(coordinator, run_b.run_id)
    assert _names(coordinator, run.run_id) == [
        (1, "caf\u00e9.json"),
        (1, "ckpt/Model.bin"),
        (1, "state.json"),
        (1, "\u212a.json"),
        (2, "ckpt/Model.bin"),
    ]


def test_twins_admitted_together_are_refused_when_the_second_is_recorded(tmp_path):
    """Two uploads in flight at once both pass admission; the record that would make twins is refused."""
    store = Store(tmp_path / "c.db")
    try:
        *_, lease = store_lease(store)
        store.records.record(lease, Claim(name="Out.json", kind="report", sha256="a" * 64, size_bytes=2, step=0))
        with pytest.raises(InvalidRequestError, match="`out.json` differs from this job's artifact `Out.json`"):
            store.records.record(lease, Claim(name="out.json", kind="report", sha256="b" * 64, size_bytes=2, step=0))
        assert [r[0] for r in store.db.execute("SELECT name FROM records")] == ["Out.json"]
    finally:
        store.close()


# --- disk space -------------------------------------------------------------------------------


def test_an_upload_larger_than_the_disk_is_refused_naming_both_numbers(start_coordinator):
    coord = start_coordinator("--quota-attempt-bytes", str(1 << 62), "--quota-run-bytes", str(1 << 62), warm=True)
    run, p, lease = _leased(coord)
    usage = shutil.disk_usage(coord.workdir)
    # Past the free space: UNAVAILABLE, so the provider retries (and lands once the admin frees space).
    declared = usage.free + (1 << 30)
    code, msg = _details(lambda: p.upload(lease.lease_id, "huge.bin", b"", size=declared, sha256="0" * 64))
    assert code == C.UNAVAILABLE and f"`huge.bin` declares {declared} bytes" in msg and "retry later" in msg, msg
    free = int(re.search(r"has (\d+) bytes free", msg).group(1))
    assert free < declared and str(coord.workdir / "staging") in msg, msg
    # Past the whole disk: RESOURCE_EXHAUSTED, retrying cannot help.
    declared = usage.total + 1
    code, msg = _details(lambda: p.upload(lease.lease_id, "huger.bin", b"", size=declared, sha256="0" * 64))
    assert code == C.RESOURCE_EXHAUSTED and f"declares {declared} bytes" in msg and f"holds {usage.total} bytes in all" in msg, msg
    assert not list((coord.workdir / "staging").rglob("*.part"))
    # What fits still lands.
    assert p.upload(lease.lease_id, "small.bin", b"x" * 1000).size_bytes == 1000


def test_a_local_blob_store_on_another_disk_is_checked_too(tmp_path, monkeypatch):
    staging_dir, blob_dir = tmp_path / "staging", tmp_path / "blobs"
    blob_dir.mkdir()
    monkeypatch.setattr(staging_mod, "_device", lambda path: 2 if "blobs" in str(path) else 1)
    monkeypatch.setattr(staging_mod, "disk_space", lambda path: (500, 1000) if "blobs" in str(path) else (1 << 40, 1 << 41))
    staging = Staging(staging_dir, blob_dir=blob_dir)
    claim = Claim(name="m.bin", kind="export", sha256="a" * 64, size_bytes=600, step=0)
    # The whole blob is copied there at commit, however much of it is staged already.
    with pytest.raises(StorageError, match=f"declares 600 bytes; the coordinator's blob store disk \\(`{blob_dir}`\\) has 500 bytes free"):
        staging.check_space(claim, 500)
    staging.check_space(Claim(name="m.bin", kind="export", sha256="a" * 64, size_bytes=500, step=0), 0)


# --- quotas -----------------------------------------------------------------------------------


def _stop_short(p, lease_id, name, data, sent):
    """An upload that declares all of `data` and stops after `sent` bytes (FAILED_PRECONDITION, the bytes kept)."""
    code, msg = _details(lambda: p.upload(lease_id, name, data, messages=iter([provider_pb2.UploadArtifactRequest(chunk=data[:sent])])))
    assert code == C.FAILED_PRECONDITION and f"after {sent} of {len(data)} bytes" in msg, msg


def test_uploads_that_stop_short_count_against_the_attempt_quota(start_coordinator):
    """Issue 34: uploads that each declare 16 KB and stop at 15 KB used to leave their bytes staged, uncounted."""
    coord = start_coordinator("--quota-attempt-bytes", "40000", warm=True)
    with coord.admin() as admin:
        admin.create_run(run_spec("stops"))
        token = admin.create_provider("stopper")
    p = Provider(coord.address, token)
    p.register()
    lease = p.acquire().lease
    a, b, c = (os.urandom(16_000) for _ in range(3))
    _stop_short(p, lease.lease_id, "a.bin", a, 15_000)
    _stop_short(p, lease.lease_id, "b.bin", b, 15_000)
    code, msg = _details(lambda: p.upload(lease.lease_id, "c.bin", c))
    assert code == C.RESOURCE_EXHAUSTED and "already stores 0 bytes (+32000 declared by uploads staged or in progress)" in msg, msg
    assert "attempt quota is 40000 bytes" in msg, msg
    # Resuming a stopped upload is not a second one: it lands, and its share is now a record's.
    assert p.upload(lease.lease_id, "a.bin", a, offset=15_000).sha256 == hashlib.sha256(a).hexdigest()
    code, msg = _details(lambda: p.upload(lease.lease_id, "c.bin", c))
    assert code == C.RESOURCE_EXHAUSTED and "already stores 16000 bytes (+16000 declared" in msg, msg
    # A restarted coordinator finds b's staged bytes on its disk and counts them (their length: 15000).
    coord.kill()
    coord.start()
    pid, p = p.provider_id, Provider(coord.address, token)
    p.provider_id = pid
    code, msg = _details(lambda: p.upload(lease.lease_id, "c.bin", c))
    assert code == C.RESOURCE_EXHAUSTED and "already stores 16000 bytes (+15000 declared" in msg, msg
    assert p.upload(lease.lease_id, "b.bin", b, offset=15_000).size_bytes == 16_000
    # The attempt's end drops what it staged; the next attempt starts from nothing staged.
    p.finish(lease.lease_id, provider_pb2.ATTEMPT_OUTCOME_RETRYABLE, "again")
    lease2 = p.acquire().lease
    assert p.upload(lease2.lease_id, "c.bin", c).size_bytes == 16_000


def test_retryable_attempts_do_not_hold_the_run_quota_and_live_ones_do(start_coordinator):
    """Issue 34: three RETRYABLE attempts' records used to fill the run's bytes and refuse the honest attempt."""
    coord = start_coordinator("--quota-run-bytes", "100000", "--max-attempts", "5", warm=True)
    run, p, lease = _leased(coord)
    for i in range(3):
        p.upload(lease.lease_id, f"junk-{i}.bin", os.urandom(30_000))
        p.finish(lease.lease_id, provider_pb2.ATTEMPT_OUTCOME_RETRYABLE, "lying")
        lease = p.acquire().lease
    assert lease.attempt == 4
    honest = os.urandom(60_000)
    assert p.upload(lease.lease_id, "run/export/model.safetensors", honest, kind="export").sha256 == hashlib.sha256(honest).hexdigest()
    # The retryable attempts' records stay listed.
    assert [n for _, n in _names(coord, run.run_id)] == ["junk-0.bin", "junk-1.bin", "junk-2.bin", "run/export/model.safetensors"]
    # A live attempt's records count: 60000 + 50000 is past the run's 100000.
    code, msg = _details(lambda: p.upload(lease.lease_id, "more.bin", os.urandom(50_000)))
    assert code == C.RESOURCE_EXHAUSTED and "run already stores 60000 bytes in its live and succeeded attempts" in msg, msg
    assert "run quota is 100000 bytes" in msg, msg


def test_a_succeeded_attempt_holds_the_run_quota_for_the_other_jobs(tmp_path):
    store = Store(tmp_path / "c.db", quotas=Quotas(run_bytes=100))
    try:
        pid, _, g, lease = store_lease(store, num_jobs=3)
        store.records.record(lease, Claim(name="x.bin", kind="report", sha256="a" * 64, size_bytes=90, step=0))
        store.leases.finish(pid, g.lease_id, "retryable", "")
        g = store.leases.acquire(pid)
        store.records.record(store.leases.live_lease(pid, g.lease_id), Claim(name="y.bin", kind="report", sha256="b" * 64, size_bytes=60, step=0))
        store.leases.finish(pid, g.lease_id, "succeeded", "")
        g = store.leases.acquire(pid)
        lease = store.leases.live_lease(pid, g.lease_id)
        with pytest.raises(QuotaError, match="run already stores 60 bytes in its live and succeeded attempts"):
            store.records.record(lease, Claim(name="z.bin", kind="report", sha256="c" * 64, size_bytes=50, step=0))
        store.records.record(lease, Claim(name="z.bin", kind="report", sha256="c" * 64, size_bytes=40, step=0))
    finally:
        store.close()
