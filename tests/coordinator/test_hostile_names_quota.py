"""Issue 34, the artifact store's admission: names that read as other names, disk space and quotas.

A real coordinator process and real gRPC streams where the behaviour is a status code a provider
sees; the store (real SQLite) where it is a race the network cannot time.
"""

from __future__ import annotations

import hashlib

import grpc
import pytest
from coordinator_helpers import Provider, code_of, run_spec

from dflash_worker.coordinator.artifacts import Claim, check_name, escape_name
from dflash_worker.coordinator.store import Registration, RunSpecData, Store
from dflash_worker.errors import InvalidRequestError
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
        for send in (p.report, p.upload):
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
    code, msg = _details(lambda: p.report(lease.lease_id, nfd, b"{}"))
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


def _store_lease(store: Store, *, num_jobs: int = 1):
    pid, _ = store.create_provider("box")
    store.register(
        pid,
        Registration(
            client_version="0.1.0",
            native_client_version="",
            launch_mode=1,
            native=False,
            backend="cpu",
            device_count=1,
            features=(),
            capabilities=b"",
            name="box",
        ),
    )
    run = store.create_run(RunSpecData(name="r", spec_json="{}", required_client_version="0.1.0", num_jobs=num_jobs))
    g = store.acquire(pid)
    return pid, run, store.live_lease(pid, g.lease_id)


def test_twins_admitted_together_are_refused_when_the_second_is_recorded(tmp_path):
    """Two uploads in flight at once both pass admission; the record that would make twins is refused."""
    store = Store(tmp_path / "c.db")
    try:
        _, _, lease = _store_lease(store)
        store.record(lease, Claim(name="Out.json", kind="report", sha256="a" * 64, size_bytes=2, step=0))
        with pytest.raises(InvalidRequestError, match="`out.json` differs from this job's artifact `Out.json`"):
            store.record(lease, Claim(name="out.json", kind="report", sha256="b" * 64, size_bytes=2, step=0))
        assert [r[0] for r in store.db.execute("SELECT name FROM records")] == ["Out.json"]
    finally:
        store.close()
