"""`/metrics` scraped while a real run-manager runs a real job (the native client's `noop` stage, heartbeats
every 0.3 s): the lease, heartbeat and upload counters move while it runs, the job's progress gauge follows
it, and at the end the job is counted `succeeded`. The status page's JSON sees the same job live."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from e2e_helpers import client_version
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

NOOP_SPEC = {"stages": ["noop"], "noop": {"steps": 60, "step_seconds": 0.1, "checkpoint_every": 5}}


def _get(coord, path: str) -> bytes:
    req = urllib.request.Request(coord.info["http_address"] + path, headers={"Authorization": f"Bearer {coord.admin_token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read()


def scrape(coord) -> dict:
    out = {}
    for fam in text_string_to_metric_families(_get(coord, "/metrics").decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_move_while_a_real_job_runs(tmp_path, procs, binaries):
    coord = procs.coordinator(tmp_path / "coord", lease_ttl=10, serve_args=("--http-listen", "127.0.0.1:0"), warm=True)
    token = coord.cli_json("providers", "create", "box")["token"]
    run_id = coord.create_run("metrics-e2e", NOOP_SPEC, client_version=client_version())
    before = scrape(coord)
    assert before[("dflash_leases_granted_total", ())] == 0 and before[("dflash_jobs", (("state", "queued"),))] == 1

    rm = procs.run_manager(tmp_path / "work", "--coordinator", coord.address, "--token", token, "--max-jobs", "1", warm=True)
    started = rm.wait_for("the worker to start", lambda v: str(v.get("message", "")).startswith("worker started"))
    job_id = started["job_id"]
    labels = tuple(sorted({"run_id": run_id, "job_id": job_id}.items()))
    samples = []
    while rm.proc.poll() is None and len(samples) < 40:
        s = scrape(coord)
        if ("dflash_job_progress_ratio", labels) in s:
            samples.append(s)
        time.sleep(0.25)
    assert rm.wait() == 0, rm.text()
    assert len(samples) >= 3, f"only {len(samples)} scrapes saw the job live:\n{rm.text()}"
    first, last = samples[0], samples[-1]
    assert first[("dflash_leases_granted_total", ())] == 1 and first[("dflash_jobs", (("state", "leased"),))] == 1
    hbs = [s[("dflash_heartbeats_total", ())] for s in samples]
    assert hbs == sorted(hbs) and hbs[-1] > hbs[0], hbs
    assert last[("dflash_heartbeat_latency_seconds_count", ())] >= hbs[-1]
    progress = [s[("dflash_job_progress_ratio", labels)] for s in samples]
    assert progress[-1] > progress[0], progress
    # Checkpoints are uploaded as the job runs.
    assert last[("dflash_artifact_bytes_received_total", ())] > first[("dflash_artifact_bytes_received_total", ())], (first, last)

    end = scrape(coord)
    assert end[("dflash_jobs", (("state", "succeeded"),))] == 1 and end[("dflash_attempts_ended_total", (("state", "succeeded"),))] == 1
    assert end[("dflash_artifact_bytes_received_total", ())] > 0 and ("dflash_job_progress_ratio", labels) not in end
    status = json.loads(_get(coord, "/api/status"))
    (run,) = status["runs"]
    assert run["run_id"] == run_id and run["state"] == "finished" and run["jobs"][0]["state"] == "succeeded"
