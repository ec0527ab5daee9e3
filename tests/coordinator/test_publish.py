"""The regression gate through a real coordinator on loopback: an export is published only when its
evaluation did not regress against the released draft on the held-out split (the recipe's tolerance);
otherwise the job still succeeds, `published: false` with the reason, and only `runs publish --override`
(recorded, surviving a restart) makes `artifacts get` serve it.

The reports are evaluate's own format, built with evaluate's own functions (`step_stats`, `summarize`,
`verdict`) from per-step acceptance lengths; the "worse on purpose" draft is one whose acceptance
lengths are the released draft's shuffled and cut to 1 (no draft token accepted), as a draft trained on
shuffled labels scores. `tests/evaluate/test_evaluate_gate.py` feeds a report of a real evaluation.
"""

from __future__ import annotations

import hashlib
import json
import subprocess

import pytest
from coordinator_helpers import Provider, run_spec, subprocess_env
from prewarmed import coordinator_cli

from dflash_worker.coordinator.artifacts.publish import REPORT_NAME, decide, held_out
from dflash_worker.evaluate.report import VERDICTS, step_stats, summarize, verdict
from dflash_worker.proto.dflash.v1 import provider_pb2

BLOCK = 4
RELEASED = [[3, 2, 4, 1, 3], [2, 2, 3], [4, 1, 2, 3]]


def report(trained: list[list[int]], released: list[list[int]] = RELEASED, *, split: str = "test", lie: str | None = None) -> bytes:
    """An evaluate report.json (the fields evaluate writes that the gate reads), from acceptance lengths."""
    rows = []
    for i, (b, t) in enumerate(zip(released, trained, strict=True)):
        row = {"id": f"p{i}", "baseline": {"acceptance_lengths": b, **step_stats(b, BLOCK)}, "trained": {"acceptance_lengths": t, **step_stats(t, BLOCK)}}
        row["verdict"] = verdict(row["trained"]["tau"], row["baseline"]["tau"], 0.02)
        rows.append(row)
    base, tr = summarize(rows, "baseline", BLOCK), summarize(rows, "trained", BLOCK)
    doc = {
        "split": split, "prompts": len(rows), "block_size": BLOCK, "tie_tolerance": 0.02,
        "baseline": base, "trained": tr,
        "verdict": lie or verdict(tr["tau_pooled"], base["tau_pooled"], 0.02),
        "verdict_counts": {v: sum(1 for r in rows if r["verdict"] == v) for v in VERDICTS},
        "per_prompt": rows,
    }  # fmt: skip
    return json.dumps(doc).encode()


WORSE = [[1] * len(r) for r in RELEASED]  # accepts nothing: what a draft trained on shuffled labels does
BETTER = [[a + 1 if a < BLOCK else a for a in r] for r in RELEASED]


def spec_json(tolerance: float | None = None, split: str = "test") -> str:
    recipe: dict = {"evaluate": {"max_new_tokens": 8}}
    if tolerance is not None:
        recipe["evaluate"]["tie_tolerance"] = tolerance
    return json.dumps({"stages": ["train", "evaluate"], "recipe": recipe, "evaluate": {"split": split}})


def cli(coord, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = coordinator_cli(*args, "--server", coord.address, f"--admin-token={coord.admin_token}", timeout=60, env=subprocess_env())
    if check:
        assert p.returncode == 0, p.stderr
    return p


MODEL = b"trained draft weights " * 100


def finish_job(coord, provider, name: str, *, report_bytes: bytes | None, spec: str | None = None) -> str:
    """A run whose one job uploads an export (and `eval/report.json`) and succeeds; returns the run id."""
    with coord.admin() as admin:
        run = admin.create_run(run_spec(name, spec_json=spec or spec_json()))
    if not provider.provider_id:
        provider.register()
    lease = provider.acquire().lease
    assert lease.run_id == run.run_id
    provider.upload(lease.lease_id, "run/export/model.safetensors", MODEL, kind="export", step=4)
    provider.upload(lease.lease_id, "run/export/config.json", b"{}", kind="export", step=4)
    if report_bytes is not None:
        provider.upload(lease.lease_id, REPORT_NAME, report_bytes, kind="report")
    assert provider.finish(lease.lease_id) == "succeeded"
    return run.run_id


def publication(coord, run_id: str) -> dict:
    shown = json.loads(cli(coord, "runs", "show", run_id, "--json").stdout)
    (job,) = shown["jobs"]
    assert job["state"] == "succeeded", job
    return job["publication"]


def test_a_worse_draft_is_held_back_until_an_override_which_is_recorded(start_coordinator, tmp_path):
    coord = start_coordinator(warm=True)
    with coord.admin() as admin:
        provider = Provider(coord.address, admin.create_provider("box"))
    run_id = finish_job(coord, provider, "worse", report_bytes=report(WORSE))
    pub = publication(coord, run_id)
    assert pub["published"] is False and pub["verdict"] == "regressed", pub
    assert pub["reason"].startswith("regressed: acceptance length 1.0000 trained vs") and "`test`" in pub["reason"] and "tolerance 0.02" in pub["reason"], pub
    assert pub["tau_trained"] == 1.0 and pub["tau_released"] > 2 and pub["split"] == "test"
    assert "export NOT published: regressed" in cli(coord, "runs", "show", run_id).stdout

    # The default download of the export is refused, naming the reason and the way out.
    got = cli(coord, "artifacts", "get", run_id, "--export", "-o", str(tmp_path / "export"), check=False)
    assert got.returncode == 1 and "is not published: regressed" in got.stderr and "runs publish" in got.stderr, got.stderr
    assert not (tmp_path / "export" / "model.safetensors").exists()
    one = cli(coord, "artifacts", "get", run_id, "run/export/model.safetensors", "-o", str(tmp_path / "m"), check=False)
    assert one.returncode == 1 and "FAILED_PRECONDITION" in one.stderr, one.stderr
    # Other artifacts (the report itself) are still served.
    cli(coord, "artifacts", "get", run_id, REPORT_NAME, "-o", str(tmp_path / "report.json"))

    # Publishing needs --override.
    refused = cli(coord, "runs", "publish", run_id, check=False)
    assert refused.returncode == 1 and "--override" in refused.stderr and "regressed" in refused.stderr, refused.stderr
    out = json.loads(cli(coord, "runs", "publish", run_id, "--override", "--note", "known regression; needed for the demo", "--json").stdout)
    p = out["publication"]
    assert p["published"] is True and p["verdict"] == "regressed" and p["reason"].startswith("regressed:"), p
    assert int(p["override_unix"]) > 0 and p["override_note"] == "known regression; needed for the demo" and "127.0.0.1" in p["override_peer"], p

    got = cli(coord, "artifacts", "get", run_id, "--export", "-o", str(tmp_path / "export"))
    assert hashlib.sha256((tmp_path / "export" / "model.safetensors").read_bytes()).digest() == hashlib.sha256(MODEL).digest()

    # The decision and the override are in the database: a restarted coordinator keeps both.
    coord.stop()
    coord.start()
    pub = publication(coord, run_id)
    assert pub["published"] is True and int(pub["override_unix"]) == int(p["override_unix"]) and pub["override_note"] == p["override_note"]
    assert "published by override" in cli(coord, "runs", "show", run_id).stdout
    provider.close()


@pytest.mark.parametrize(
    ("name", "trained", "spec", "published", "verdict_", "reason"),
    [
        ("better", BETTER, spec_json(), True, "improved", "improved: acceptance length"),
        ("same", RELEASED, spec_json(), True, "tied", "tied: acceptance length"),
        # The recipe's tolerance decides: 5% worse is regressed at 0.02 and tied at 0.2.
        ("bit-worse-strict", "5pct", spec_json(0.02), False, "regressed", "regressed:"),
        ("bit-worse-loose", "5pct", spec_json(0.2), True, "tied", "tied:"),
        # Measured on another split than the run's held-out one.
        ("wrong-split", "val", spec_json(), False, "improved", "measured on split `val`; the run's held-out split is `test`"),
        # The report's own verdict field is not trusted: the gate recomputes it from the figures.
        ("liar", "lie", spec_json(), False, "regressed", "regressed:"),
    ],
)
def test_the_gate_decides_from_the_figures_and_the_recipe_tolerance(start_coordinator, provider_factory, name, trained, spec, published, verdict_, reason):
    coord = start_coordinator(warm=True)
    provider = provider_factory(coord=coord)
    if trained == "5pct":
        # released pooled tau 30/12; trained loses one accepted token: 29/12, 3.3% lower
        body = report([[3, 2, 4, 1, 3], [2, 2, 3], [4, 1, 2, 2]])
    elif trained == "val":
        body = report(BETTER, split="val")
    elif trained == "lie":
        body = report(WORSE, lie="improved")
    else:
        body = report(trained)
    run_id = finish_job(coord, provider, name, report_bytes=body, spec=spec)
    pub = publication(coord, run_id)
    assert (pub["published"], pub["verdict"]) == (published, verdict_), pub
    assert reason in pub["reason"], pub


def test_no_report_or_a_malformed_one_is_held_back_naming_why(start_coordinator, provider_factory):
    coord = start_coordinator(warm=True)
    provider = provider_factory(coord=coord)
    run_id = finish_job(coord, provider, "no-eval", report_bytes=None)
    pub = publication(coord, run_id)
    assert pub["published"] is False and pub["verdict"] == "" and f"no evaluation report (`{REPORT_NAME}`)" in pub["reason"], pub
    doc = json.loads(report(BETTER))
    del doc["trained"]["tau_pooled"]
    run_id = finish_job(coord, provider, "broken-eval", report_bytes=json.dumps(doc).encode())
    pub = publication(coord, run_id)
    assert pub["published"] is False and "`trained.tau_pooled` is missing" in pub["reason"], pub
    # An admin can still publish either.
    assert json.loads(cli(coord, "runs", "publish", run_id, "--override", "--json").stdout)["publication"]["published"] is True


def test_jobs_without_an_export_have_no_publication_and_nothing_to_publish(start_coordinator, provider_factory):
    coord = start_coordinator(warm=True)
    provider = provider_factory(coord=coord)
    provider.register()
    with coord.admin() as admin:
        run = admin.create_run(run_spec("noop-like"))
    lease = provider.acquire().lease
    provider.upload(lease.lease_id, "report.json", b"{}", kind="report")
    assert provider.finish(lease.lease_id, provider_pb2.ATTEMPT_OUTCOME_SUCCEEDED) == "succeeded"
    (job,) = json.loads(cli(coord, "runs", "show", run.run_id, "--json").stdout)["jobs"]
    assert "publication" not in job or job["publication"] is None, job
    p = cli(coord, "runs", "publish", run.run_id, "--override", check=False)
    assert p.returncode == 1 and "has no export from a succeeded attempt" in p.stderr, p.stderr


def test_decide_names_the_field_and_the_spec_tolerance_is_checked():
    assert held_out(json.loads(spec_json(0.1, "val"))) == ("val", 0.1)
    assert held_out({}) == ("test", 0.02)
    d = decide(report(BETTER), json.dumps({"recipe": {"evaluate": {"tie_tolerance": 2.0}}}))
    assert not d.published and "tie_tolerance" in d.reason, d
    d = decide(b"[1, 2]", spec_json())
    assert not d.published and "not a JSON object" in d.reason
    doc = json.loads(report(BETTER))
    doc["baseline"]["tau_pooled"] = float("nan")
    d = decide(json.dumps(doc).encode(), spec_json())
    assert not d.published and "`baseline.tau_pooled` must be a finite non-negative number" in d.reason, d
    d = decide(report(BETTER, split="train"), json.dumps({"evaluate": {"split": "train"}}))
    assert not d.published and "`train` is not held out" in d.reason, d
    d = decide(report(BETTER), spec_json())
    assert d.published and d.evaluation["counts"] == {"improved": 3, "tied": 0, "regressed": 0}
    assert len(d.evaluation["per_position_trained"]) == BLOCK - 1 and d.evaluation["tau_trained"] > d.evaluation["tau_released"]


def test_a_job_left_undecided_by_a_stopped_coordinator_is_decided_at_start(start_coordinator, provider_factory):
    """The gate runs after the job's state is committed; a coordinator killed in between decides at its next start."""
    import sqlite3

    coord = start_coordinator(warm=True)
    provider = provider_factory(coord=coord)
    run_id = finish_job(coord, provider, "interrupted", report_bytes=report(WORSE))
    coord.stop()
    db = sqlite3.connect(coord.db, isolation_level=None)
    db.execute("DELETE FROM publications")
    db.close()
    coord.start()
    pub = publication(coord, run_id)
    assert pub["published"] is False and pub["verdict"] == "regressed", pub

