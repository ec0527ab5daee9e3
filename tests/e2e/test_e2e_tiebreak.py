"""A lying verifier against an honest producer, end to end (issue 57 item 2): the disagreement is settled, not believed.

A graph run with `verify_fraction` 1 and two capture shards. An honest scripted client (`test_e2e_verify.Scripted`: the
real worker for each lease, in a pre-warmed fork) prepares and captures both shards. A hostile one takes the first
capture's verify job, recomputes it with the real worker and then forges what it recomputed (the features scaled by
0.5, the sidecar rewritten to hash right) before uploading it. Its word alone quarantines nobody: the verify attempt is
`disputed`, the capture stays unverified (train waits), and with no provider that is neither of the two the run says
so (`runs show`). An honest run-manager then joins: it replays the unit as the tie-break, recomputes the producer's
bytes, and the liar is quarantined (outvoted), never the producer; the rest of the run goes on (the honest run-manager
and the honest scripted client), and the export an admin fetches is byte-identical to the clean one-job run's.
Then the admin lifts the liar's quarantine with `providers unquarantine` (the real CLI): audited in the database and on
the status page; an unknown id and a provider that is not quarantined are refused.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from e2e_helpers import client_version, sha256_file
from test_e2e_graph import _finish, _kinds, _provider
from test_e2e_verify import Scripted

pytestmark = pytest.mark.slow

N_CAPTURE = 2


def _get(coord, path: str) -> str:
    req = urllib.request.Request(coord.info["http_address"] + path, headers={"Authorization": f"Bearer {coord.admin_token}"})
    return urllib.request.urlopen(req, timeout=10).read().decode()


def test_a_lying_verifier_is_outvoted_quarantined_and_the_export_unchanged(tmp_path, procs, spec, baseline):
    coord = procs.coordinator(tmp_path / "coord", lease_ttl=10, serve_args=("--http-listen", "127.0.0.1:0"), warm=True)
    run_id = coord.create_run("tiebreak", {**spec, "verify_fraction": 1}, "--capture-shards", str(N_CAPTURE), client_version=client_version())
    kinds = _kinds(coord, run_id)
    producer = Scripted(coord, tmp_path / "producer", "producer", tamper=None, kinds=None)
    liar = Scripted(coord, tmp_path / "liar", "liar", tamper="verify", kinds=None)
    producer.next("prepare")
    producer.next("capture")
    producer.next("capture")
    lie = liar.next("verify")
    assert liar.forged == [lie.job_id]

    # Disputed, not believed: nobody quarantined, the capture not handed on, and the run says why it waits.
    assert not [p for p in coord.cli_json("providers", "list") if int(p["quarantined_unix"])]
    assert [s for _, s, _ in coord.attempt_messages(lie.job_id)] == ["disputed"]
    shown = {j["job_id"]: j for j in coord.show(run_id)["jobs"]}
    (train_id,) = [j for j, (k, _) in kinds.items() if k == "train"]
    assert shown[train_id]["state"] == "queued" and lie.job_id in shown[train_id]["waiting_for"]
    why = shown[lie.job_id]["waiting_reason"]
    assert why.startswith("waiting for a tie-break") and "backend `cpu`" in why and "no live provider is one" in why, why
    assert producer.p.acquire().WhichOneof("result") == "no_work"  # (the liar could verify the other shard: it is not asked)

    # An honest run-manager joins and breaks the tie; the honest scripted client takes its share of the rest.
    producer.thread.start()
    rms = [_provider(procs, coord, tmp_path, "honest")]
    try:
        _finish(coord, run_id, rms)
    finally:
        producer.stop.set()
        producer.thread.join(60)
    assert not producer.errors, producer.errors

    providers = {p["identity"]: p for p in coord.cli_json("providers", "list")}
    bad = providers["liar"]
    assert int(bad["quarantined_unix"]) > 0 and "was outvoted" in bad["quarantine_reason"] and "recomputed the producer's bytes" in bad["quarantine_reason"], bad
    assert int(providers["producer"]["quarantined_unix"]) == int(providers["honest"]["quarantined_unix"]) == 0
    assert liar.p.acquire().WhichOneof("result") == "no_work"
    # The liar's attempt was overruled and the tie-break (the honest run-manager) succeeded; the producer's captures stand.
    assert [s for _, s, _ in coord.attempt_messages(lie.job_id)] == ["overruled", "succeeded"]
    ((tie_breaker,),) = coord._query(
        "SELECT p.identity FROM attempts a JOIN providers p USING (provider_id) WHERE a.job_id=? AND a.state='succeeded'", lie.job_id
    )
    assert tie_breaker == "honest"
    for job_id, (kind, _) in kinds.items():
        if kind == "capture":
            assert [s for _, s, _ in coord.attempt_messages(job_id)] == ["succeeded"], coord.attempt_messages(job_id)

    # The export, as an admin fetches it, is the clean one-job run's.
    out = tmp_path / "admin" / "export"
    coord.cli("artifacts", "get", run_id, "--export", "-o", str(out))
    (got,) = out.rglob("model.safetensors")
    assert sha256_file(got) == baseline.export_sha256
    metrics = _get(coord, "/metrics")
    assert 'dflash_providers{state="quarantined"} 1.0' in metrics
    assert "dflash_verifiers_overruled_total 1.0" in metrics and "dflash_verify_mismatches_total 0.0" in metrics

    # The admin lifts the quarantine: audited in the database and on the status page.
    liar_id = bad["provider_id"]
    lifted = coord.cli_json("providers", "unquarantine", liar_id, "--reason", "outvoted once; watching it")
    assert int(lifted["provider"]["quarantined_unix"]) == 0 and lifted["audit"]["reason"] == "outvoted once; watching it"
    assert bad["quarantine_reason"] in lifted["audit"]["detail"]
    rows = coord._query("SELECT action, provider_id, reason FROM audit_log ORDER BY seq")
    assert rows == [("quarantine", liar_id, bad["quarantine_reason"]), ("unquarantine", liar_id, "outvoted once; watching it")]
    snap = json.loads(_get(coord, "/api/status"))
    assert [(a["action"], a["provider"]) for a in snap["audit"]] == [("unquarantine", "liar"), ("quarantine", "liar")]
    assert "outvoted once; watching it" in _get(coord, "/status.html")
    # Bad input: refused, nothing recorded.
    p = coord.cli("providers", "unquarantine", "prov-nope", "--reason", "x", check=False)
    assert p.returncode == 1 and "no provider `prov-nope`" in p.stderr, p.stderr
    p = coord.cli("providers", "unquarantine", providers["producer"]["provider_id"], "--reason", "x", check=False)
    assert p.returncode == 1 and "is not quarantined" in p.stderr, p.stderr
    assert len(coord._query("SELECT 1 FROM audit_log")) == 2
