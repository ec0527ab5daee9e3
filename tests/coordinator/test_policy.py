"""Version policy and device policy, decided by the coordinator, over real gRPC."""

from __future__ import annotations

import pytest
from coordinator_helpers import run_spec

from dflash_worker.coordinator.policy import ProviderProfile, RunRequirements, Verdict, decide, local_ranks


def _kind(resp) -> str:
    return resp.WhichOneof("result")


def test_version_mismatch_gets_upgrade_required(coordinator, provider_factory):
    with coordinator.admin() as admin:
        admin.create_run(run_spec("v2", required_client_version="0.2.0"))
    old = provider_factory()
    old.register(client_version="0.1.0")
    resp = old.acquire()
    assert _kind(resp) == "upgrade_required"
    assert resp.upgrade_required.required_client_version == "0.2.0"
    assert "0.1.0" in resp.upgrade_required.message
    # The matching version gets the lease in Docker mode.
    new = provider_factory()
    new.register(client_version="0.2.0")
    assert _kind(new.acquire()) == "lease"


def test_approved_native_version_only_for_that_run_and_only_in_native_mode(coordinator, provider_factory):
    with coordinator.admin() as admin:
        approved = admin.create_run(run_spec("approved", required_client_version="0.2.0"))
        other = admin.create_run(run_spec("other", required_client_version="0.2.0"))
        run = admin.approve_version(approved.run_id, "0.1.5")
        assert list(run.approved_native_versions) == ["0.1.5"]

    # Docker mode with the approved native version: not enough.
    docker = provider_factory()
    docker.register(client_version="0.1.5", native=False, native_client_version="0.1.5")
    assert _kind(docker.acquire()) == "upgrade_required"

    # Native mode with an unapproved native version: upgrade.
    wrong = provider_factory()
    wrong.register(client_version="0.1.4", native=True, native_client_version="0.1.4", backend="mps", features=())
    assert _kind(wrong.acquire()) == "upgrade_required"

    # Native mode with the approved version: a lease for the approved run only.
    native = provider_factory()
    native.register(client_version="0.1.5", native=True, native_client_version="0.1.5", backend="mps", features=())
    resp = native.acquire()
    assert _kind(resp) == "lease" and resp.lease.run_id == approved.run_id
    assert resp.lease.local_ranks == 1
    # The approved run is drained; the other run still needs 0.2.0.
    resp = native.acquire()
    assert _kind(resp) == "upgrade_required" and resp.upgrade_required.required_client_version == "0.2.0"
    assert other.run_id  # (its job stays queued)


def test_ephemeral_runs_are_not_leased_to_native_providers(coordinator, provider_factory):
    with coordinator.admin() as admin:
        admin.create_run(run_spec("eph", checkpoint_policy="ephemeral"))
    native = provider_factory()
    native.register(native=True, backend="mps", features=())
    assert _kind(native.acquire()) == "no_work"
    docker = provider_factory()
    docker.register(native=False)
    resp = docker.acquire()
    assert _kind(resp) == "lease" and resp.lease.checkpoint_policy == "ephemeral"


def test_multi_rank_runs_only_go_to_cuda(coordinator, provider_factory):
    with coordinator.admin() as admin:
        admin.create_run(run_spec("ranks", max_local_ranks=4))
    for backend in ("mps", "cpu"):
        p = provider_factory()
        p.register(backend=backend, native=True, features=())
        assert _kind(p.acquire()) == "no_work", backend
    cuda = provider_factory()
    cuda.register(backend="cuda", device_count=2)
    resp = cuda.acquire()
    assert _kind(resp) == "lease" and resp.lease.local_ranks == 2  # min(max_local_ranks, device_count)


def test_required_features_must_be_offered(coordinator, provider_factory):
    with coordinator.admin() as admin:
        admin.create_run(run_spec("fa2", required_features=["cuda", "flash_attention_2"]))
    lacking = provider_factory()
    lacking.register(backend="cuda", features=("liger",))
    assert _kind(lacking.acquire()) == "no_work"
    has = provider_factory()
    has.register(backend="cuda", features=("flash_attention_2",))  # the backend counts as a feature
    assert _kind(has.acquire()) == "lease"


def _profile(**kw):
    base = dict(client_version="1.0.0", native_client_version="", native=False, backend="cuda", device_count=1, features=frozenset())
    base.update(kw)
    return ProviderProfile(**base)


def _run(**kw):
    base = dict(required_client_version="1.0.0", approved_native_versions=frozenset(), checkpoint_policy="durable", max_local_ranks=1, required_features=())
    base.update(kw)
    return RunRequirements(**base)


@pytest.mark.parametrize(
    "run, prov, verdict",
    [
        (_run(), _profile(), Verdict.ELIGIBLE),
        (_run(), _profile(client_version="0.9.0"), Verdict.UPGRADE),
        (_run(approved_native_versions=frozenset({"0.9.0"})), _profile(client_version="0.9.0", native=True, native_client_version="0.9.0"), Verdict.ELIGIBLE),
        (_run(approved_native_versions=frozenset({"0.9.0"})), _profile(client_version="0.9.0", native=False, native_client_version="0.9.0"), Verdict.UPGRADE),
        (_run(approved_native_versions=frozenset({"0.9.0"})), _profile(client_version="0.9.0", native=True, native_client_version=""), Verdict.UPGRADE),
        (_run(checkpoint_policy="ephemeral"), _profile(native=True), Verdict.INCAPABLE),
        # device refusals win over version: no point asking to upgrade for a job the box cannot run
        (_run(max_local_ranks=2), _profile(backend="mps", client_version="0.1.0"), Verdict.INCAPABLE),
        (_run(max_local_ranks=2), _profile(backend="cpu", device_count=2), Verdict.INCAPABLE),
        # `run-manager --cpu-ranks 2`; the feature means nothing on MPS
        (_run(max_local_ranks=2), _profile(backend="cpu", device_count=2, features=frozenset({"cpu_ranks"})), Verdict.ELIGIBLE),
        (_run(max_local_ranks=2), _profile(backend="mps", device_count=2, features=frozenset({"cpu_ranks"})), Verdict.INCAPABLE),
        (_run(required_features=("mps",)), _profile(backend="mps"), Verdict.ELIGIBLE),
    ],
)
def test_decide_table(run, prov, verdict):
    assert decide(run, prov)[0] is verdict


def test_local_ranks():
    assert local_ranks(_run(max_local_ranks=8), _profile(device_count=4)) == 4
    assert local_ranks(_run(max_local_ranks=8), _profile(backend="mps", device_count=4)) == 1
    assert local_ranks(_run(max_local_ranks=1), _profile(device_count=4)) == 1
    assert local_ranks(_run(max_local_ranks=8), _profile(backend="cpu", device_count=2)) == 1
    assert local_ranks(_run(max_local_ranks=8), _profile(backend="cpu", device_count=2, features=frozenset({"cpu_ranks"}))) == 2


def test_sort_kinds_splits_a_runs_job_kinds_by_verdict():
    """`store.leases.sort_kinds`: the kinds a provider fits now, those an upgrade would fit, and why; the
    kinds it cannot run at all are in neither list."""
    from dflash_worker.coordinator.store.leases import sort_kinds

    prof = _profile(client_version="0.9.0", backend="cpu")
    reqs = {
        "prepare": _run(required_client_version="0.9.0"),
        "capture": _run(required_client_version="1.0.0"),
        "train": _run(max_local_ranks=2),  # cpu without `--cpu-ranks`: incapable, not behind
        "evaluate": _run(required_client_version="0.9.0"),
    }
    fits, behind, why = sort_kinds(reqs, prof)
    assert fits == ["prepare", "evaluate"]
    assert behind == ["capture"]
    assert "`1.0.0`" in why and "`0.9.0`" in why
    assert sort_kinds({"train": _run(max_local_ranks=2)}, prof) == ([], [], "")
