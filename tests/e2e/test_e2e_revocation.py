"""Revocation mid-lease, with the real coordinator and two real run-managers: provider A is running a job
when the admin revokes it; A's worker is stopped, A's run-manager exits, provider B takes the job over
from A's last checkpoint and it ends `succeeded`."""

from __future__ import annotations

import json

import pytest
from e2e_helpers import client_version, is_checkpoint_report, pid_alive
from launchers import wait_until

pytestmark = pytest.mark.slow

# About 10 s of work with a checkpoint every 0.25 s: long enough to revoke mid-job. B resumes from A's
# checkpoint only because the run trusts any provider's (`trust_inputs`; the default, `own`, would start B fresh).
NOOP_SPEC = {"stages": ["noop"], "noop": {"steps": 200, "step_seconds": 0.05, "checkpoint_every": 5}, "trust_inputs": "any"}


def _started(v: dict) -> bool:
    return str(v.get("message", "")).startswith("worker started")


@pytest.mark.real_process("native_client")  # the revoked provider's worker is watched until it stops
def test_revoked_provider_is_stopped_and_its_job_completes_elsewhere(tmp_path, procs, binaries):
    coord = procs.coordinator(tmp_path / "coord", lease_ttl=10, warm=True)
    a = coord.cli_json("providers", "create", "box-a")
    b = coord.cli_json("providers", "create", "box-b")
    run_id = coord.create_run("revocation", NOOP_SPEC, client_version=client_version())

    # A has no --max-jobs: after its lease is gone it asks for more work with its revoked token.
    rm_a = procs.run_manager(tmp_path / "work-a", "--coordinator", coord.address, "--token", a["token"], "--name", "box-a")
    started = rm_a.wait_for("A's worker to start", _started)
    job_id, worker = started["job_id"], int(started["pid"])
    rm_a.wait_for("A's first committed checkpoint", is_checkpoint_report)
    # B is polling before the revocation: it must get the job only because A lost it.
    rm_b = procs.run_manager(tmp_path / "work-b", "--coordinator", coord.address, "--token", b["token"], "--name", "box-b", "--max-jobs", "1")
    rm_b.wait_for("B to register", lambda v: v.get("message") == "registered with the coordinator")
    assert coord.job_state(job_id) == "leased"

    revoked = coord.cli_json("providers", "revoke", a["provider_id"])
    assert revoked["aborted_leases"] == 1, revoked

    # A's worker is stopped and A's run-manager exits 1. The revocation reaches A one of two ways: its open
    # Heartbeat stream's next answer is ABORTED (then the AcquireLease after the abandoned attempt is refused),
    # or a new call (a checkpoint's UploadOffset or UploadArtifact) is refused UNAUTHENTICATED first (then A stops at once).
    wait_until(lambda: not pid_alive(worker), timeout=60, what=f"A's worker {worker} to stop")
    rc_a = rm_a.wait()
    err_a = rm_a.text()
    assert rc_a == 1, f"exit {rc_a}:\n{err_a}"
    if any("ABORTED" in str(v.get("message", "")) and "revoked" in str(v.get("message", "")) for v in rm_a.messages()):
        assert "error: coordinator call `AcquireLease` failed: this provider's token was revoked" in err_a and "(Unauthenticated)" in err_a, err_a
    else:
        assert rm_a.messages(lambda v: v.get("message") == "the coordinator refused this provider's token: killing the worker"), err_a
        want = [
            f"error: job `{job_id}` abandoned and its worker stopped: coordinator call `{call}` refused this provider: this provider's token was revoked (Unauthenticated)"
            for call in ("UploadOffset", "UploadArtifact")
        ]
        assert any(w in err_a for w in want) and "hint: check the provider token (`--token`, `--token-file`" in err_a, err_a
    assert not rm_a.messages(lambda v: v.get("message") == "attempt finished"), err_a

    # B takes the job over (attempt 2, from A's last checkpoint) and finishes it.
    rc_b = rm_b.wait()
    assert rc_b == 0, f"stdout:\n{rm_b.stdout}\nstderr:\n{rm_b.text()}"
    lease = rm_b.wait_for("B's lease", lambda v: v.get("message") == "lease acquired")
    assert (lease["job_id"], lease["attempt"]) == (job_id, 2), lease
    assert any(str(v.get("message", "")).startswith("resuming from") for v in rm_b.messages()), rm_b.text()

    (job,) = coord.show(run_id)["jobs"]
    assert (job["state"], job["attempts"]) == ("succeeded", 2), json.dumps(job, indent=1)
    (n1, s1, m1), (n2, s2, _) = coord.attempt_messages(job_id)
    assert (n1, s1, n2, s2) == (1, "revoked", 2, "succeeded") and a["provider_id"] in m1
    providers = {p["provider_id"]: p for p in coord.cli_json("providers", "list")}
    assert int(providers[a["provider_id"]]["revoked_unix"]) > 0 and int(providers[b["provider_id"]]["revoked_unix"]) == 0
