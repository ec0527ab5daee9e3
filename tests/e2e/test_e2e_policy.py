"""What a CPU provider in native mode must refuse, through the CLI surface a run admin uses
(`dflash-coordinator runs create / versions approve`) and the real run-manager: another client
version (exit 10, unless approved for that run), a multi-rank run, an ephemeral-checkpoint run;
and a malformed job spec, which fails its own attempt and nothing else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from e2e_helpers import client_version, local_path, pipeline_spec, sha256_file

pytestmark = pytest.mark.slow


def _cheap_spec(world) -> dict:
    """A real stage that finishes in about a second: `prepare` of the world's rows."""
    return pipeline_spec(world, stages=["prepare"])


def _job(coord, run_id: str) -> dict:
    (job,) = coord.show(run_id)["jobs"]
    return job


def _join(coord, token: str, *extra: str) -> tuple[str, ...]:
    return ("--coordinator", coord.address, "--token", token, *extra)


def _jobs_started(work: Path) -> list[str]:
    d = work / "jobs"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


@pytest.mark.real_process("native_client")  # the client's version is the native client's
def test_other_client_version_exits_10_and_the_job_never_starts(tmp_path, procs, world):
    coord = procs.coordinator(tmp_path / "coord", lease_ttl=10, warm=True)
    run_id = coord.create_run("needs-9.9.9", _cheap_spec(world), client_version="9.9.9")
    rm = procs.run_manager(tmp_path / "work", *_join(coord, coord.provider_token("box")))
    rc = rm.wait()
    err = rm.text()
    assert rc == 10, err
    assert "upgrade required" in err and "`9.9.9`" in err and f"`{client_version()}`" in err and "hint:" in err, err
    job = _job(coord, run_id)
    assert (job["state"], job["attempts"]) == ("queued", 0), job
    assert _jobs_started(tmp_path / "work") == []


@pytest.mark.real_process("native_client")
def test_native_client_version_runs_only_where_the_admin_approved_it(tmp_path, procs, world):
    coord = procs.coordinator(tmp_path / "coord", lease_ttl=10, warm=True)
    version = client_version()
    # B is older, so the coordinator looks at it first: its refusal must not hide A.
    run_b = coord.create_run("run-b-not-approved", _cheap_spec(world), client_version="9.9.9")
    run_a = coord.create_run("run-a-approved", _cheap_spec(world), client_version="9.9.9")
    approved = coord.cli_json("versions", "approve", run_a, version)
    assert approved["approved_native_versions"] == [version], approved

    work = tmp_path / "work"
    rm = procs.run_manager(work, *_join(coord, coord.provider_token("box"), "--native-client-version", version))
    rc = rm.wait()
    err = rm.text()
    # A ran to the end; then only B was left, which this version may not take: exit 10 naming B.
    assert rc == 10, err
    assert "upgrade required" in err and "run-b-not-approved" in err and "is not approved for this run" in err, err
    job_a, job_b = _job(coord, run_a), _job(coord, run_b)
    assert (job_a["state"], job_a["attempts"]) == ("succeeded", 1), job_a
    assert (job_b["state"], job_b["attempts"]) == ("queued", 0), job_b
    assert _jobs_started(work) == [job_a["job_id"]]
    spec_doc = json.loads((work / "jobs" / job_a["job_id"] / "spec.json").read_text())
    assert spec_doc["lease"]["required_client_version"] == "9.9.9" and spec_doc["lease"]["run_id"] == run_a


@pytest.mark.real_process("native_client")
def test_multi_rank_run_is_not_started_on_a_cpu_provider(tmp_path, procs, world):
    spec_file = tmp_path / "run.json"
    spec_file.write_text(json.dumps({"name": "two-ranks", "spec": _cheap_spec(world), "max_local_ranks": 2}))
    work = tmp_path / "work"
    rm = procs.run_manager(work, "--local", "--json", "--spec", str(spec_file), "--idle-timeout", "3")
    rc = rm.wait()
    err = rm.text()
    assert rc == 1, err
    assert "this provider cannot take them" in err and "max_local_ranks" in err, err
    assert not any(v.get("message") == "lease acquired" for v in rm.messages()), err
    assert _jobs_started(work) == []


@pytest.mark.real_process("native_client")  # a native provider
def test_ephemeral_checkpoint_run_is_not_leased_to_a_native_provider(tmp_path, procs, world):
    coord = procs.coordinator(tmp_path / "coord", lease_ttl=10, warm=True)
    run_id = coord.create_run("ephemeral", _cheap_spec(world), "--checkpoint-policy", "ephemeral", client_version=client_version())
    work = tmp_path / "work"
    rm = procs.run_manager(work, *_join(coord, coord.provider_token("box"), "--idle-timeout", "3"))
    rc = rm.wait()
    err = rm.text()
    assert rc == 0, err
    assert any("no work within `--idle-timeout`" in str(v.get("message")) for v in rm.messages()), err
    assert not any(v.get("message") == "lease acquired" for v in rm.messages()), err
    job = _job(coord, run_id)
    assert (job["state"], job["attempts"]) == ("queued", 0), job
    assert _jobs_started(work) == []


def test_malformed_specs_fail_their_attempt_and_another_run_still_completes(tmp_path, procs, world):
    coord = procs.coordinator(tmp_path / "coord", lease_ttl=10, warm=True)
    version = client_version()
    bad_stage = _cheap_spec(world) | {"stages": ["prepare", "trian"]}
    no_recipe = {k: v for k, v in pipeline_spec(world, stages=["prepare", "check"]).items() if k != "recipe"}
    good = pipeline_spec(world, stages=["prepare", "check"])
    runs = {name: coord.create_run(name, s, client_version=version) for name, s in (("bad-stage", bad_stage), ("no-recipe", no_recipe), ("good", good))}

    work = tmp_path / "work"
    rm = procs.run_manager(work, *_join(coord, coord.provider_token("box"), "--max-jobs", "3"), warm=True)
    rc = rm.wait()
    err = rm.text()
    assert rc == 0, err

    jobs = {name: _job(coord, run_id) for name, run_id in runs.items()}
    expect = {
        "bad-stage": "unknown stage(s) `trian`; known: prepare, check",
        "no-recipe": "`spec.recipe` must be an object",
    }
    for name, words in expect.items():
        job = jobs[name]
        assert (job["state"], job["attempts"]) == ("failed", 1), (name, job)
        # The reason is in the coordinator's attempt record and in the run-manager's output.
        ((number, state, message),) = coord.attempt_messages(job["job_id"])
        assert state == "failed" and words in message, (name, message)
        assert any(v.get("job_id") == job["job_id"] and words in str(v.get("message")) for v in rm.messages()), err
        # A spec error is not retried: one worker start for the job.
        starts = [v for v in rm.messages() if str(v.get("message", "")).startswith("worker started") and v.get("job_id") == job["job_id"]]
        assert len(starts) == 1, starts

    good_job = jobs["good"]
    assert (good_job["state"], good_job["attempts"]) == ("succeeded", 1), good_job
    (manifest,) = [a for a in good_job["artifacts"] if a["name"] == "data/manifest.json"]
    path = local_path((work / "jobs" / good_job["job_id"]).resolve(), manifest)
    assert path == (work / "jobs" / good_job["job_id"] / "data" / "manifest.json").resolve()
    assert sha256_file(path) == manifest["sha256"]
