"""`coordinator.cli_output`: how the admin subcommands print runs, jobs and publications (no server needed)."""

from __future__ import annotations

import json

from dflash_worker.coordinator import cli_output
from dflash_worker.proto.dflash.v1 import admin_pb2, provider_pb2


def test_job_label_names_graph_jobs_and_their_shards_only():
    assert cli_output.job_label(admin_pb2.JobInfo(kind="pipeline")) == ""
    assert cli_output.job_label(admin_pb2.JobInfo(kind="")) == ""
    assert cli_output.job_label(admin_pb2.JobInfo(kind="train", shard_count=1)) == "train  "
    assert cli_output.job_label(admin_pb2.JobInfo(kind="capture", shard_index=1, shard_count=4)) == "capture 2/4  "


def test_waits_says_what_a_queued_job_waits_for():
    assert cli_output.waits(admin_pb2.JobInfo(state="queued")) == ""
    assert cli_output.waits(admin_pb2.JobInfo(state="leased", waiting_for=["job-a"])) == ""
    assert cli_output.waits(admin_pb2.JobInfo(state="queued", waiting_for=["job-a"], needs=["job-a"])) == "  waits for job-a"
    two = admin_pb2.JobInfo(state="queued", waiting_for=["job-a", "job-b"], needs=["job-a", "job-b", "job-c"])
    assert cli_output.waits(two) == "  waits for 2 of 3 jobs it needs"


def test_publication_line_names_the_override_when_there_is_one():
    held = admin_pb2.Publication(published=False, reason="regressed")
    assert cli_output.publication_line(held) == "    export NOT published: regressed"
    forced = admin_pb2.Publication(published=True, reason="regressed", override_unix=1, override_peer="ipv4:10.0.0.1:5", override_note="ok")
    first, second = cli_output.publication_line(forced).split("\n")
    assert first == "    export published: regressed"
    assert second.startswith("    published by override ") and second.endswith(" from ipv4:10.0.0.1:5: ok")


def test_print_run_details_shows_jobs_reasons_and_artifacts(capsys):
    run = admin_pb2.Run(run_id="run-1", spec=admin_pb2.RunSpec(name="r", required_client_version="0.1.0", checkpoint_policy="durable"),
                        job_states={"succeeded": 1, "queued": 1}, failure="")  # fmt: skip
    art = provider_pb2.Artifact(name="run/export/model.safetensors", kind="export", sha256="ab" * 32, size_bytes=3, step=4)
    jobs = [
        admin_pb2.JobInfo(job_id="job-t", state="succeeded", attempts=1, kind="train", export=art),
        admin_pb2.JobInfo(job_id="job-e", state="queued", kind="evaluate", waiting_for=["job-t"], needs=["job-t"], waiting_reason="no provider fits"),
    ]
    cli_output.print_run_details(admin_pb2.GetRunResponse(run=run, jobs=jobs), {"job-t": [art], "job-e": []})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "run-1  r  client 0.1.0  durable  [queued 1, succeeded 1]"
    assert out[1] == "  job-t  train  succeeded  attempts 1"
    assert out[2].startswith("    export not decided yet")
    assert out[3] == f"    export          run/export/model.safetensors  step 4  3 B  sha256 {'ab' * 8}..."
    assert out[4:] == ["  job-e  evaluate  queued  attempts 0  waits for job-t", "    no provider fits"]


def test_emit_json_and_msg_dict_keep_proto_names_and_defaults(capsys):
    cli_output.emit_json(cli_output.msg_dict(admin_pb2.JobInfo(job_id="j")))
    doc = json.loads(capsys.readouterr().out)
    assert doc["job_id"] == "j" and doc["shard_index"] == 0 and doc["waiting_for"] == []
