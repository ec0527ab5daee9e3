"""`/metrics` of a real coordinator on loopback, parsed with `prometheus_client.parser`: the counters move
with real gRPC calls (leases, heartbeats, uploads, downloads, an expiry), the gauges follow the jobs, and
the endpoint wants the admin or viewer token."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from coordinator_helpers import Provider, run_spec
from launchers import wait_until
from prometheus_client.parser import text_string_to_metric_families

from dflash_worker.proto.dflash.v1 import provider_pb2


def scrape(coord, token: str | None = None) -> dict[tuple[str, tuple], float]:
    """Every sample of `/metrics` as {(sample name, sorted labels): value}."""
    req = urllib.request.Request(coord.info["http_address"] + "/metrics", headers={"Authorization": f"Bearer {token or coord.admin_token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4"), r.headers["Content-Type"]
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def v(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def coord(start_coordinator):
    return start_coordinator("--http-listen", "127.0.0.1:0", lease_ttl=2.0, warm=True)


def test_counters_move_with_real_calls(coord):
    before = scrape(coord)
    assert v(before, "dflash_leases_granted_total") == 0 and v(before, "dflash_heartbeats_total") == 0
    assert v(before, "dflash_heartbeat_latency_seconds_count") == 0
    with coord.admin() as admin:
        p = Provider(coord.address, admin.create_provider("box"))
        run = admin.create_run(run_spec("metrics", num_jobs=2))
    p.register()
    assert v(scrape(coord), "dflash_jobs", state="queued") == 2

    lease = p.acquire().lease
    s = scrape(coord)
    assert v(s, "dflash_leases_granted_total") == 1 and v(s, "dflash_jobs", state="leased") == 1 and v(s, "dflash_jobs", state="queued") == 1

    hb = p.heartbeats()
    for step in range(1, 6):
        hb.send(lease.lease_id, step=step, metrics={"loss": 2.0 / step, "tokens_per_s": 1000.0 + step})
    s = scrape(coord)
    assert v(s, "dflash_heartbeats_total") == 5 and v(s, "dflash_heartbeat_latency_seconds_count") == 5
    assert 0 < v(s, "dflash_heartbeat_latency_seconds_sum") < 5
    # The histogram's buckets are cumulative and end with +Inf holding every observation.
    assert v(s, "dflash_heartbeat_latency_seconds_bucket", le="+Inf") == 5
    assert v(s, "dflash_job_training_loss", run_id=run.run_id, job_id=lease.job_id) == pytest.approx(0.4)
    assert v(s, "dflash_job_tokens_per_second", run_id=run.run_id, job_id=lease.job_id) == 1005.0
    assert v(s, "dflash_job_progress_ratio", run_id=run.run_id, job_id=lease.job_id) == pytest.approx(0.5)

    data = b"x" * 300_000
    p.upload(lease.lease_id, "eval/blob.bin", data, chunk=65536)
    s = scrape(coord)
    assert v(s, "dflash_artifact_bytes_received_total") == len(data)
    p.download(lease.lease_id, "eval/blob.bin", __import__("hashlib").sha256(data).hexdigest())
    assert v(scrape(coord), "dflash_artifact_bytes_sent_total") == len(data)
    hb.close()
    assert p.finish(lease.lease_id) == "succeeded"

    # The second job's lease expires (TTL 2 s without a heartbeat): counted, requeued.
    lease2 = p.acquire().lease
    assert lease2.lease_id
    wait_until(lambda: v(scrape(coord), "dflash_leases_expired_total") == 1, timeout=15, interval=0.3)
    s = scrape(coord)
    assert v(s, "dflash_attempts_ended_total", state="expired") == 1 and v(s, "dflash_attempts_ended_total", state="succeeded") == 1
    assert v(s, "dflash_jobs", state="succeeded") == 1 and v(s, "dflash_leases_granted_total") == 2
    # A finished job's gauges are gone (only live attempts are labelled).
    assert (("dflash_job_training_loss", tuple(sorted({"run_id": run.run_id, "job_id": lease.job_id}.items())))) not in s
    assert v(s, "dflash_providers", state="registered") == 1
    p.close()


def test_metrics_wants_a_token_and_the_viewer_token_works(coord):
    url = coord.info["http_address"] + "/metrics"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url, timeout=10)
    assert e.value.code == 401
    with coord.admin() as admin:
        provider_token = admin.create_provider("box")
    for bad in ("wrong-token-" * 3, provider_token):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": f"Bearer {bad}"}), timeout=10)
        assert e.value.code == 401 and b"token refused" in e.value.read()
    viewer = Path(coord.info["viewer_token_file"]).read_text().strip()
    assert "dflash_heartbeats_total" in {name for name, _ in scrape(coord, viewer)}


def test_a_long_job_moves_the_counters_between_scrapes(coord):
    """Scraped while a job runs: every scrape sees more heartbeats than the one before."""
    with coord.admin() as admin:
        p = Provider(coord.address, admin.create_provider("box"))
        admin.create_run(run_spec("long"))
    p.register()
    lease = p.acquire().lease
    hb = p.heartbeats()
    seen = []
    for step in range(1, 16):
        hb.send(lease.lease_id, phase=provider_pb2.PHASE_TRAIN, step=step, metrics={"loss": 1.0 / step})
        if step % 5 == 0:
            seen.append(v(scrape(coord), "dflash_heartbeats_total"))
        time.sleep(0.01)
    assert seen == [5, 10, 15]
    hb.close()
    p.close()
