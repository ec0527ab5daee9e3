"""A job's whole life through real gRPC against a real coordinator process and SQLite file."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import stat
from pathlib import Path

import grpc
import pytest
from coordinator_helpers import code_of, run_spec

from dflash_worker.coordinator.artifacts.blobs import blob_key
from dflash_worker.coordinator.cli import main as cli_main
from dflash_worker.proto.dflash.v1 import provider_pb2


def cli(capsys, coord, *argv) -> tuple[int, str, str]:
    rc = cli_main([*argv[:2], *argv[2:], "--server", coord.address, "--admin-token-file", coord.info["admin_token_file"]])
    out, err = capsys.readouterr()
    return rc, out, err


def test_full_lifecycle(coordinator, provider_factory, capsys, tmp_path):
    # Admin: create a run through the CLI, a provider token through the API.
    rc, out, err = cli(capsys, coordinator, "runs", "create", "--name", "adapt-1", "--spec-json", run_spec("x").spec_json, "--client-version", "0.1.0", "--feature", "cuda", "--jobs", "1", "--json")
    assert rc == 0, err
    run = json.loads(out)
    run_id = run["run_id"]
    assert run["job_states"] == {"queued": 1}
    assert run["spec"]["checkpoint_policy"] == "durable"

    prov = provider_factory("gpu-box-1")
    reg = prov.register(backend="cuda", features=("flash_attention_2",), name="rig-a")
    assert reg.provider_id.startswith("prov-") and reg.lease_ttl_seconds == 30

    resp = prov.acquire(wait=1)
    assert resp.WhichOneof("result") == "lease"
    lease = resp.lease
    assert (lease.run_id, lease.attempt, lease.checkpoint_policy, lease.local_ranks) == (run_id, 1, "durable", 1)
    assert json.loads(lease.spec_json)["recipe"] == {"steps": 4}
    assert not lease.HasField("resume_checkpoint")
    assert list(lease.required_features) == ["cuda"] and lease.required_client_version == "0.1.0"

    # Nothing left for a second provider.
    other = provider_factory("gpu-box-2")
    other.register()
    assert other.acquire(wait=0).WhichOneof("result") == "no_work"

    hb = prov.heartbeats()
    r1 = hb.send(lease.lease_id, step=1, metrics={"loss": 2.0})
    assert r1.directive == provider_pb2.DIRECTIVE_CONTINUE and r1.lease_expires_unix > 0

    # CHECKPOINT_NOW through the admin CLI, delivered once on the same stream.
    rc, out, err = cli(capsys, coordinator, "jobs", "checkpoint", lease.job_id, "--json")
    assert rc == 0, err and json.loads(out)["job_state"] == "leased"
    assert hb.send(lease.lease_id, step=2).directive == provider_pb2.DIRECTIVE_CHECKPOINT_NOW
    assert hb.send(lease.lease_id, step=3).directive == provider_pb2.DIRECTIVE_CONTINUE

    # A checkpoint: its file, then its manifest; stored content-addressed, idempotent.
    content = b"checkpoint-bytes-" * 1000
    ck = prov.checkpoint(lease.lease_id, "ckpt/step-3", {"model.safetensors": content}, step=3)
    assert ck.uri == f"dflash-artifact://{run_id}/{lease.job_id}/1/ckpt/step-3/manifest.json"
    blob = coordinator.workdir / "artifacts" / blob_key(hashlib.sha256(content).hexdigest())
    assert blob.read_bytes() == content
    assert not [p for p in (coordinator.workdir / "staging").rglob("*") if p.is_file()], "the staged copy is gone after commit"
    again = prov.upload(lease.lease_id, "ckpt/step-3/model.safetensors", content, kind="checkpoint_file", step=3)
    assert again.sha256 == hashlib.sha256(content).hexdigest()
    with pytest.raises(grpc.RpcError) as e:
        prov.upload(lease.lease_id, "ckpt/step-3/model.safetensors", content + b"x", kind="checkpoint_file", step=3)
    assert code_of(e) == grpc.StatusCode.ALREADY_EXISTS
    # A name not yet recorded, with a hash its bytes do not have: the bytes are checked, not the claim.
    with pytest.raises(grpc.RpcError) as e:
        prov.upload(lease.lease_id, "ckpt/step-3/other.bin", content[::-1], kind="checkpoint_file", step=3, sha256=hashlib.sha256(content).hexdigest())
    assert code_of(e) == grpc.StatusCode.INVALID_ARGUMENT
    assert blob.read_bytes() == content  # the refused uploads changed nothing

    # The export, streamed in small chunks; a `file://` URI is refused (providers do not vouch for bytes).
    export = b"export" * 1000
    art2 = prov.upload(lease.lease_id, "export/draft.safetensors", export, kind="export", chunk=1000)
    assert art2.sha256 == hashlib.sha256(export).hexdigest()
    with pytest.raises(grpc.RpcError) as e:
        prov.upload(lease.lease_id, "export/other.bin", b"", kind="export", uri=(coordinator.workdir / "coordinator.db").as_uri())
    assert code_of(e) == grpc.StatusCode.INVALID_ARGUMENT

    hb.send(lease.lease_id, phase=provider_pb2.PHASE_FINISHING, step=10, committed_step=3)
    hb.close()
    assert prov.finish(lease.lease_id) == "succeeded"

    # `runs show` reflects it (human and JSON forms).
    rc, out, err = cli(capsys, coordinator, "runs", "show", run_id, "--json")
    assert rc == 0, err
    shown = json.loads(out)
    assert shown["run"]["job_states"] == {"succeeded": 1}
    (job,) = shown["jobs"]
    assert job["state"] == "succeeded" and job["attempts"] == 1
    assert [a["name"] for a in job["artifacts"]] == ["ckpt/step-3/model.safetensors", "ckpt/step-3/manifest.json", "export/draft.safetensors"]
    assert job["artifacts"][0]["sha256"] == hashlib.sha256(content).hexdigest()
    assert job["export"]["name"] == "export/draft.safetensors" and job["artifact_count"] == 3

    # No evaluation was uploaded, so the regression gate held the export back: `get` refuses it
    # until the admin publishes it by override.
    assert job["publication"]["published"] is False and "no evaluation report" in job["publication"]["reason"], job
    out_path = tmp_path / "got" / "draft.safetensors"
    rc, out, err = cli(capsys, coordinator, "artifacts", "get", run_id, "export/draft.safetensors", "-o", str(out_path))
    assert rc == 1 and "is not published" in err, err
    rc, out, err = cli(capsys, coordinator, "runs", "publish", run_id, "--override", "--note", "lifecycle test")
    assert rc == 0 and "published by override" in out, err
    # The admin fetches the export: verified, written whole.
    rc, out, err = cli(capsys, coordinator, "artifacts", "get", run_id, "export/draft.safetensors", "-o", str(out_path))
    assert rc == 0, err
    assert out_path.read_bytes() == export and not out_path.with_name("draft.safetensors.part").exists()
    rc, out, _ = cli(capsys, coordinator, "runs", "show", run_id)
    assert "succeeded" in out and "ckpt/step-3/model.safetensors" in out

    rc, out, _ = cli(capsys, coordinator, "providers", "list", "--json")
    names = {p["name"]: p for p in json.loads(out)}
    # Register's machine name replaces the name the token was created with.
    assert names["rig-a"]["capabilities"]["backend"] == "cuda"
    assert names["rig-a"]["launch_mode"] == "LAUNCH_MODE_DOCKER"
    assert names["rig-a"]["provider_id"] == reg.provider_id

    # The finished lease is dead: every further write is ABORTED.
    with pytest.raises(grpc.RpcError) as e:
        prov.heartbeat_once(lease.lease_id)
    assert code_of(e) == grpc.StatusCode.ABORTED


def test_cancel_directive_and_queued_cancel(coordinator, provider_factory, capsys):
    with coordinator.admin() as admin:
        run = admin.create_run(run_spec("two", num_jobs=2))
    prov = provider_factory()
    prov.register()
    lease = prov.acquire().lease
    hb = prov.heartbeats()
    assert hb.send(lease.lease_id).directive == provider_pb2.DIRECTIVE_CONTINUE
    rc, out, err = cli(capsys, coordinator, "jobs", "cancel", lease.job_id)
    assert rc == 0, err
    assert "cancelling" in out
    # CANCEL keeps coming until the worker stops.
    assert hb.send(lease.lease_id).directive == provider_pb2.DIRECTIVE_CANCEL
    assert hb.send(lease.lease_id).directive == provider_pb2.DIRECTIVE_CANCEL
    hb.close()
    assert prov.finish(lease.lease_id, provider_pb2.ATTEMPT_OUTCOME_CANCELLED) == "cancelled"

    with coordinator.admin() as admin:
        jobs = admin.get_run(run.run_id).jobs
        queued = [j.job_id for j in jobs if j.state == "queued"]
        assert len(queued) == 1
        assert admin.cancel_job(queued[0]) == "cancelled"
        assert dict(admin.get_run(run.run_id).run.job_states) == {"cancelled": 2}
    assert prov.acquire().WhichOneof("result") == "no_work"


def test_retryable_is_bounded_and_failed_is_final(start_coordinator):
    coord = start_coordinator("--max-attempts", "3", warm=True)
    with coord.admin() as admin:
        token = admin.create_provider("p")
        admin.create_run(run_spec("retry"))
        admin.create_run(run_spec("fail"))
    from coordinator_helpers import Provider

    prov = Provider(coord.address, token)
    prov.register()
    states, runs_seen = [], []
    for _ in range(4):
        lease = prov.acquire().lease
        runs_seen.append((lease.run_id, lease.attempt))
        states.append(prov.finish(lease.lease_id, provider_pb2.ATTEMPT_OUTCOME_RETRYABLE, "oom"))
    # Three attempts of the first run (queued, queued, failed), then the second run.
    assert states == ["queued", "queued", "failed", "queued"]
    assert [a for _, a in runs_seen] == [1, 2, 3, 1]
    lease = prov.acquire().lease
    assert prov.finish(lease.lease_id, provider_pb2.ATTEMPT_OUTCOME_FAILED, "bad data") == "failed"
    assert prov.acquire().WhichOneof("result") == "no_work"
    prov.close()


def test_long_poll_wakes_when_work_arrives(coordinator, provider_factory):
    import threading
    import time

    prov = provider_factory()
    prov.register()
    result = {}

    def poll():
        t = time.monotonic()
        result["resp"] = prov.acquire(wait=10)
        result["s"] = time.monotonic() - t

    th = threading.Thread(target=poll)
    th.start()
    time.sleep(0.3)
    with coordinator.admin() as admin:
        admin.create_run(run_spec("late"))
    th.join(15)
    assert result["resp"].WhichOneof("result") == "lease"
    # Woken by the new run, not by the (server-capped, 2 s) wait running out.
    assert result["s"] < 1.9


def test_admin_token_file_is_private_and_db_is_wal(coordinator):
    token_file = Path(coordinator.info["admin_token_file"])
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    db = sqlite3.connect(coordinator.db)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    # Only hashes of tokens are stored.
    token = coordinator.admin_token
    dump = "\n".join(db.iterdump())
    assert token not in dump
    assert hashlib.sha256(token.encode()).hexdigest() in dump


def test_cli_help_explains_every_flag():
    import argparse

    from dflash_worker.coordinator.cli import build_parser

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, (*path, name))
            elif not isinstance(action, argparse._HelpAction):
                yield path, action

    seen = 0
    for path, action in walk(build_parser(), ()):
        assert action.help and action.help != argparse.SUPPRESS, f"{' '.join(path)}: `{action.dest}` has no help"
        seen += 1
    assert seen > 40


def test_concurrent_pollers_never_share_a_job(coordinator, provider_factory):
    from concurrent.futures import ThreadPoolExecutor

    provs = [provider_factory(f"p{i}") for i in range(16)]
    for p in provs:
        p.register()
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(p.acquire, 3) for p in provs]  # all long-polling on an empty coordinator
        import time

        time.sleep(0.3)
        with coordinator.admin() as admin:
            run = admin.create_run(run_spec("race", num_jobs=10))
        results = [f.result() for f in futures]
    leases = [r.lease for r in results if r.WhichOneof("result") == "lease"]
    assert len(leases) == 10 and len({lz.job_id for lz in leases}) == 10
    assert len({lz.lease_id for lz in leases}) == 10
    assert sum(r.WhichOneof("result") == "no_work" for r in results) == 6
    with coordinator.admin() as admin:
        assert dict(admin.get_run(run.run_id).run.job_states) == {"leased": 10}
