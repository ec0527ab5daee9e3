"""`dflash-coordinator providers unquarantine ID --reason TEXT` against a real coordinator process (issue 57 item 2).

A hostile producer is quarantined the real way (scripted providers on the gRPC API: a forged capture, recomputed
by honest verifiers). The admin lifts the quarantine through the CLI: the provider is leased work again, and the
lifting is audited: a row in the database's `audit_log` (after the quarantine's own row) with the admin's reason,
address and the quarantine lifted, in `providers list` (text and JSON), on the status page and in its JSON. Bad
input is refused with the field named and nothing recorded: an unknown id, a provider that is not quarantined, an
empty reason, control characters, an over-long reason; the CLI requires `--reason`.
"""

from __future__ import annotations

import json

import pytest
from coordinator_helpers import Provider, run_spec
from test_status_page import get
from test_tokens import cli
from test_verify_replay import SHARD, SIDECAR, _capture, _prepare, _providers, _spec


@pytest.fixture
def coordinator(start_coordinator):
    """With the status page."""
    return start_coordinator("--http-listen", "127.0.0.1:0", warm=True)


def _quarantine_by_verify(admin, hostile: Provider, verifiers: list[Provider]) -> None:
    """Quarantine `hostile` the real way: it captures a forged shard, honest `verifiers` recompute the honest one
    (as many as it takes to settle the disagreement)."""
    admin.create_run(run_spec("forged", spec_json=_spec(verify_fraction=1), capture_shards=1))
    _prepare(hostile)
    _capture(hostile, shard=b"forged features " * 64)
    for v in verifiers:
        if any(p.quarantined_unix for p in admin.list_providers()):
            break
        lease = v.acquire().lease
        assert lease.kind == "verify", lease
        v.upload(lease.lease_id, "verify/capture/shard-00000.safetensors", SHARD, kind="capture")
        v.upload(lease.lease_id, "verify/capture/shard-00000.json", SIDECAR, kind="capture")
        v.finish(lease.lease_id)
    (q,) = [p for p in admin.list_providers() if p.quarantined_unix]
    assert q.provider_id == hostile.provider_id


def _audit_rows(coord) -> list[tuple]:
    return coord._query("SELECT action, provider_id, reason, peer, detail FROM audit_log ORDER BY seq")


def test_unquarantine_lifts_the_quarantine_and_is_audited(coordinator, provider_factory, capsys):
    hostile, v1, v2 = _providers(provider_factory, "hostile", "v1", "v2")
    with coordinator.admin() as admin:
        _quarantine_by_verify(admin, hostile, [v1, v2])
        assert hostile.acquire().WhichOneof("result") == "no_work"
        quarantine_reason = next(p.quarantine_reason for p in admin.list_providers() if p.provider_id == hostile.provider_id)
    assert _audit_rows(coordinator) == [("quarantine", hostile.provider_id, quarantine_reason, "", "")]

    reason = "checked by hand: <b>the shard</b> was a disk fault, not a lie"
    rc, out, err = cli(capsys, coordinator, "providers", "unquarantine", hostile.provider_id, "--reason", reason, "--json")
    assert rc == 0, err
    resp = json.loads(out)
    assert int(resp["provider"]["quarantined_unix"]) == 0 and resp["provider"]["quarantine_reason"] == ""
    got = resp["audit"]
    assert (got["action"], got["provider_id"], got["reason"]) == ("unquarantine", hostile.provider_id, reason)
    assert got["peer"] and quarantine_reason in got["detail"] and int(got["created_unix"]) > 0
    assert resp["provider"]["last_unquarantine"] == got

    # Recorded in the database, after the quarantine's own entry.
    rows = _audit_rows(coordinator)
    assert [r[0] for r in rows] == ["quarantine", "unquarantine"]
    assert rows[1][1:3] == (hostile.provider_id, reason) and rows[1][3] == got["peer"] and quarantine_reason in rows[1][4]

    # Leased work again: the forged capture's redo is queued.
    lease = hostile.acquire().lease
    assert lease.kind == "capture" and lease.attempt == 2

    # `providers list` (text and JSON) shows the last unquarantine.
    rc, out, err = cli(capsys, coordinator, "providers", "list")
    assert rc == 0, err
    lines = out.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith(hostile.provider_id))
    assert "QUARANTINED" not in lines[i] and lines[i + 1].startswith("    last unquarantined ") and lines[i + 1].endswith(reason), lines
    rc, out, err = cli(capsys, coordinator, "providers", "list", "--json")
    (shown,) = [p for p in json.loads(out) if p["provider_id"] == hostile.provider_id]
    assert shown["last_unquarantine"]["reason"] == reason

    # The status page: its JSON and its HTML (escaped).
    snap = json.loads(get(coordinator, "/api/status", token=coordinator.admin_token)[2])
    assert [(a["action"], a["provider"], a["reason"]) for a in snap["audit"]] == [("unquarantine", "hostile", reason), ("quarantine", "hostile", quarantine_reason)]
    page = get(coordinator, "/status.html", token=coordinator.admin_token)[2].decode()
    assert '<table id="audit">' in page and "&lt;b&gt;the shard&lt;/b&gt;" in page and "<b>the shard</b>" not in page
    assert f'data-action="unquarantine" data-provider-id="{hostile.provider_id}"' in page


def test_unquarantine_refuses_bad_input_and_records_nothing(coordinator, provider_factory, capsys):
    hostile, v1, v2 = _providers(provider_factory, "hostile", "v1", "v2")
    with coordinator.admin() as admin:
        _quarantine_by_verify(admin, hostile, [v1, v2])
    before = _audit_rows(coordinator)

    def refused(*argv: str) -> str:
        rc, out, err = cli(capsys, coordinator, "providers", "unquarantine", *argv)
        assert rc == 1 and out == "", (rc, out, err)
        return err

    assert "no provider `prov-nope`" in refused("prov-nope", "--reason", "why not")
    assert f"provider `{v1.provider_id}` is not quarantined" in refused(v1.provider_id, "--reason", "it never was")
    assert "`reason` is empty" in refused(hostile.provider_id, "--reason", "")
    assert "`reason` is empty" in refused(hostile.provider_id, "--reason", "  \t ")
    assert "control character (U+001B at position 3)" in refused(hostile.provider_id, "--reason", "ok \x1b[2Jcleared")
    assert "control character (U+000A at position 3)" in refused(hostile.provider_id, "--reason", "two\nlines")
    assert "at most 1000" in refused(hostile.provider_id, "--reason", "x" * 1001)
    with pytest.raises(SystemExit) as e:  # argparse: --reason is required
        cli(capsys, coordinator, "providers", "unquarantine", hostile.provider_id)
    assert e.value.code == 2 and "--reason" in capsys.readouterr().err
    assert _audit_rows(coordinator) == before
    with coordinator.admin() as admin:
        assert next(p for p in admin.list_providers() if p.provider_id == hostile.provider_id).quarantined_unix

    # Lifted once; a second call is refused (not quarantined) and records nothing more.
    rc, _, err = cli(capsys, coordinator, "providers", "unquarantine", hostile.provider_id, "--reason", "cleared")
    assert rc == 0, err
    assert f"provider `{hostile.provider_id}` is not quarantined" in refused(hostile.provider_id, "--reason", "again")
    assert [r[0] for r in _audit_rows(coordinator)] == ["quarantine", "unquarantine"]
