"""Lease expiry, stale holders and a coordinator killed with SIGKILL and restarted on the same database."""

from __future__ import annotations

import hashlib
import json
import time

import grpc
import pytest
from coordinator_helpers import SPEC, Provider, code_of, run_spec
from launchers import wait_until

from dflash_worker.proto.dflash.v1 import provider_pb2

TTL = 0.6
# These tests hand a lost provider's checkpoint to another provider, which only `trust_inputs = "any"`
# allows (the default, `own`, hands a provider only its own: tests/coordinator/test_trust_inputs.py).
SPEC_TRUST_ANY = json.dumps({**json.loads(SPEC), "trust_inputs": "any"})


def _expect_aborted(fn):
    with pytest.raises(grpc.RpcError) as e:
        fn()
    assert code_of(e) == grpc.StatusCode.ABORTED, e.value.details()
    return e.value.details()


def test_expiry_requeues_with_resume_checkpoint_and_aborts_the_stale_holder(start_coordinator):
    coord = start_coordinator(lease_ttl=TTL, warm=True)
    with coord.admin() as admin:
        run = admin.create_run(run_spec("expire", spec_json=SPEC_TRUST_ANY))
        a = Provider(coord.address, admin.create_provider("a"))
        b = Provider(coord.address, admin.create_provider("b"))
    a.register()
    b.register()
    lease1 = a.acquire().lease
    assert lease1.attempt == 1
    hb = a.heartbeats()
    hb.send(lease1.lease_id, step=5)
    ck5 = a.checkpoint(lease1.lease_id, "ckpt/5", {"w.pt": b"five" * 10}, step=5)
    a.upload(lease1.lease_id, "metrics.json", b"{}", kind="metrics", step=7)
    ck10 = a.checkpoint(lease1.lease_id, "ckpt/10", {"w.pt": b"ten" * 10}, step=10)
    assert ck5.step == 5

    # Heartbeats keep it alive past several TTLs.
    for _ in range(4):
        time.sleep(TTL / 3)
        assert hb.send(lease1.lease_id).directive == provider_pb2.DIRECTIVE_CONTINUE

    # `a` goes silent; the expiry timer requeues the job.
    with coord.admin() as admin:
        wait_until(lambda: dict(admin.get_run(run.run_id).run.job_states) == {"queued": 1}, timeout=10)
    resp = b.acquire()
    lease2 = resp.lease
    assert lease2.job_id == lease1.job_id and lease2.attempt == 2
    assert lease2.HasField("resume_checkpoint")
    assert lease2.resume_checkpoint == ck10  # highest committed step, not the latest report of any kind

    # The stale holder is refused on every write.
    _expect_aborted(lambda: hb.send(lease1.lease_id))
    _expect_aborted(lambda: a.upload(lease1.lease_id, "ckpt/11.pt", b"x", step=11))
    _expect_aborted(lambda: a.upload(lease1.lease_id, "ckpt/12.pt", b"x", step=12))
    # The new holder may fetch the checkpoint and the files it lists; the stale one may not.
    header, body = b.download(lease2.lease_id, "ckpt/10/w.pt", hashlib.sha256(b"ten" * 10).hexdigest())
    assert body == b"ten" * 10 and header.size_bytes == 30
    _expect_aborted(lambda: a.download(lease1.lease_id, "ckpt/10/w.pt", hashlib.sha256(b"ten" * 10).hexdigest()))
    _expect_aborted(lambda: a.finish(lease1.lease_id))
    # ... and its refusals changed nothing for the live holder.
    b.heartbeat_once(lease2.lease_id)
    assert b.finish(lease2.lease_id) == "succeeded"
    with coord.admin() as admin:
        (job,) = admin.get_run(run.run_id).jobs
        assert job.state == "succeeded" and job.attempts == 2
        names = [x.artifact.name for x in admin.list_artifacts(run.run_id, all_attempts=True)]
        assert "ckpt/11.pt" not in names and "ckpt/12.pt" not in names and "ckpt/10/manifest.json" in names
    a.close()
    b.close()


def test_expiry_is_also_checked_on_access(start_coordinator):
    # Sweeps an hour apart: only the on-access check can notice the expiry.
    coord = start_coordinator("--expiry-interval", "3600", lease_ttl=0.5, warm=True)
    with coord.admin() as admin:
        run = admin.create_run(run_spec("onaccess"))
        p = Provider(coord.address, admin.create_provider("p"))
        q = Provider(coord.address, admin.create_provider("q"))
    p.register()
    q.register()
    lease = p.acquire().lease
    time.sleep(0.7)
    _expect_aborted(lambda: p.heartbeat_once(lease.lease_id))
    with coord.admin() as admin:
        assert dict(admin.get_run(run.run_id).run.job_states) == {"queued": 1}
    assert q.acquire().lease.attempt == 2
    p.close()
    q.close()


def test_restart_after_sigkill_keeps_state_and_requeues(start_coordinator, tmp_path):
    workdir = tmp_path / "restart"
    coord = start_coordinator(lease_ttl=1.0, workdir=workdir, warm=True)
    with coord.admin() as admin:
        run = admin.create_run(run_spec("survive", num_jobs=2, spec_json=SPEC_TRUST_ANY))
        admin.approve_version(run.run_id, "0.2.0")
        token_a = admin.create_provider("a")
        token_b = admin.create_provider("b")
    a = Provider(coord.address, token_a)
    a.register()
    lease1 = a.acquire().lease
    ck = a.checkpoint(lease1.lease_id, "ckpt/3", {}, step=3)
    a.heartbeat_once(lease1.lease_id, step=3, committed_step=3)
    a.close()
    old_admin_token = coord.admin_token

    coord.kill()
    assert coord.proc.returncode == -9
    coord.start()  # same --db, new port
    assert coord.info["admin_token"] == "file" and coord.admin_token == old_admin_token

    # Tokens, runs, jobs, approvals and artifacts survived.
    with coord.admin() as admin:
        shown = admin.get_run(run.run_id)
        assert list(shown.run.approved_native_versions) == ["0.2.0"]
        assert sorted(j.state for j in shown.jobs) in (["leased", "queued"], ["queued", "queued"])
        job1 = next(j for j in shown.jobs if j.job_id == lease1.job_id)
        assert [x.artifact.sha256 for x in admin.list_artifacts(run.run_id, job1.job_id, all_attempts=True)] == [ck.sha256]

    b = Provider(coord.address, token_b)
    b.register()
    # The first job's lease expires (no heartbeats while the coordinator was
    # down) and the job comes back with its checkpoint. The second job is
    # queued too; take leases until we see the first job again.
    seen = {}
    deadline = time.monotonic() + 10
    while lease1.job_id not in seen and time.monotonic() < deadline:
        resp = b.acquire(wait=2)
        if resp.WhichOneof("result") == "lease":
            seen[resp.lease.job_id] = resp.lease
    again = seen[lease1.job_id]
    assert again.attempt == 2 and again.resume_checkpoint == ck
    # The pre-restart holder is stale after the restart too.
    a2 = Provider(coord.address, token_a)
    _expect_aborted(lambda: a2.heartbeat_once(lease1.lease_id))
    assert b.finish(again.lease_id) == "succeeded"
    a2.close()
    b.close()
    # Clean shutdown exits 0.
    assert coord.stop() == 0
