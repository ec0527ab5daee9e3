"""Provider token lifecycle against a real coordinator process: revoke (leases aborted, token refused), rotate
(old token valid for the grace period only), both surviving a restart; failed authentications rate-limited per peer."""

from __future__ import annotations

import json
import time

import grpc
import pytest
from coordinator_helpers import Provider, code_of, run_spec
from launchers import wait_until

from dflash_worker.coordinator.cli import main as cli_main
from dflash_worker.errors import NotFoundError, PolicyError
from dflash_worker.proto.dflash.v1 import provider_pb2


def _new_provider(coord, name: str) -> tuple[Provider, str]:
    with coord.admin() as admin:
        resp = admin.create_provider_full(name)
    p = Provider(coord.address, resp.token)
    p.register(name=f"{name}-host")
    assert p.provider_id == resp.provider_id
    return p, resp.token


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def cli(capsys, coord, *argv) -> tuple[int, str, str]:
    rc = cli_main([*argv, "--server", coord.address, "--admin-token-file", coord.info["admin_token_file"]])
    out, err = capsys.readouterr()
    return rc, out, err


def test_revoke_aborts_live_leases_and_refuses_the_token(coordinator, capsys):
    with coordinator.admin() as admin:
        admin.create_run(run_spec("rev", num_jobs=1))
    a, a_token = _new_provider(coordinator, "box-a")
    b, _ = _new_provider(coordinator, "box-b")
    lease = a.acquire(wait=1).lease
    hb = a.heartbeats()
    assert hb.send(lease.lease_id, step=1).directive == provider_pb2.DIRECTIVE_CONTINUE

    rc, out, err = cli(capsys, coordinator, "providers", "revoke", a.provider_id, "--json")
    assert rc == 0, err
    resp = json.loads(out)
    assert resp["aborted_leases"] == 1 and int(resp["provider"]["revoked_unix"]) > 0

    # The open heartbeat stream (authenticated before the revocation): its next beat is ABORTED.
    e = _refused(lambda: hb.send(lease.lease_id, step=2))
    assert e.code() == grpc.StatusCode.ABORTED and "revoked" in e.details()
    hb.close()
    # Every new call with the token is UNAUTHENTICATED and says why.
    for call in (a.register, lambda: a.acquire(wait=0), lambda: a.finish(lease.lease_id), lambda: a.upload(lease.lease_id, "x.bin", b"x")):
        e = _refused(call)
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in e.details(), e.details()

    # The job went back to the queue and another provider takes it from there.
    lease_b = b.acquire(wait=1).lease
    assert (lease_b.job_id, lease_b.attempt) == (lease.job_id, 2)
    assert b.finish(lease_b.lease_id) == "succeeded"

    # Revoking again changes nothing; unknown ids are NOT_FOUND; a revoked provider cannot rotate.
    with coordinator.admin() as admin:
        assert admin.revoke_provider(a.provider_id).aborted_leases == 0
        with pytest.raises(NotFoundError):
            admin.revoke_provider("prov-nope")
        with pytest.raises(PolicyError, match="revoked"):
            admin.rotate_token(a.provider_id, 60)
    rc, out, err = cli(capsys, coordinator, "providers", "list")
    assert rc == 0 and "REVOKED" in next(line for line in out.splitlines() if line.startswith(a.provider_id))

    # Still revoked after a restart (the database is the source of truth).
    coordinator.stop()
    coordinator.start()
    a2 = Provider(coordinator.address, a_token)
    try:
        assert _refused(a2.register).code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        a2.close()
    for p in (a, b):
        p.close()


def test_rotate_keeps_the_old_token_for_the_grace_period_only(coordinator, capsys):
    a, old = _new_provider(coordinator, "box-a")
    rc, out, err = cli(capsys, coordinator, "providers", "rotate", a.provider_id, "--grace", "3")
    assert rc == 0, err
    new = out.strip()
    assert len(new) >= 40 and new != old and "the token is shown once" in err and "old token works until" in err
    fresh = Provider(coordinator.address, new)
    stale = Provider(coordinator.address, old)
    try:
        assert fresh.register().provider_id == a.provider_id
        assert stale.register().provider_id == a.provider_id  # within the grace period
        # The grace period survives a restart.
        coordinator.stop()
        coordinator.start()
        fresh.close()
        stale.close()
        fresh, stale = Provider(coordinator.address, new), Provider(coordinator.address, old)
        assert stale.register().provider_id == a.provider_id

        def refused_after_grace():
            try:
                stale.register()
            except grpc.RpcError as e:
                return e
            return None

        e = wait_until(refused_after_grace, timeout=15, interval=0.2)
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "grace period has ended" in e.details()
        assert fresh.register().provider_id == a.provider_id
    finally:
        fresh.close()
        stale.close()
        a.close()


def test_rotate_with_no_grace_refuses_the_old_token_at_once(coordinator, capsys):
    a, old = _new_provider(coordinator, "box-a")
    rc, out, err = cli(capsys, coordinator, "providers", "rotate", a.provider_id, "--grace", "0", "--json")
    assert rc == 0, err
    assert set(json.loads(out)) == {"provider_id", "token", "old_token_expires_unix"}
    e = _refused(a.register)
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "grace period has ended" in e.details()
    a.close()
    for bad in ("-1", "2592001", "soon"):
        with pytest.raises(SystemExit):
            cli_main(["providers", "rotate", "prov-x", "--grace", bad])
    assert "--grace" in capsys.readouterr().err


def test_failed_authentications_are_rate_limited_per_peer(start_coordinator):
    coord = start_coordinator("--auth-failure-limit", "5", "--auth-failure-window", "3", warm=True)
    with coord.admin() as admin:
        good_token = admin.create_provider("box-a")
    good = Provider(coord.address, good_token)
    bad = Provider(coord.address, "x" * 43)
    try:
        good.register()
        for _ in range(5):
            assert _refused(bad.register).code() == grpc.StatusCode.UNAUTHENTICATED
        # Past the limit: refused before the token is looked at, with a retry hint.
        e = _refused(bad.register)
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry after" in e.details() and "127.0.0.1" in e.details()
        # The same peer with a good token is refused too (documented: a throttle a right guess
        # could pass would not slow guessing); so is a call without a token.
        assert code_of(pytest.raises(grpc.RpcError, good.register)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Until the window ends.
        time.sleep(3.2)
        assert good.register().provider_id.startswith("prov-")
        assert _refused(bad.register).code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        good.close()
        bad.close()
    assert "failed authentication 5 times" in coord.stderr_path.read_text()


def test_a_wrong_service_is_not_an_authentication_failure(start_coordinator):
    # PERMISSION_DENIED (a valid token on the wrong service) does not count towards the limit.
    coord = start_coordinator("--auth-failure-limit", "2", warm=True)
    with coord.admin() as admin:
        admin_as_provider = Provider(coord.address, coord.admin_token)
        try:
            for _ in range(4):
                assert _refused(admin_as_provider.register).code() == grpc.StatusCode.PERMISSION_DENIED
            assert admin.list_providers() == []
        finally:
            admin_as_provider.close()
