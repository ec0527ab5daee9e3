"""The coordinator's Prometheus metrics (`prometheus-client`), served at ``/metrics`` by `web`.

Counters are plain integers the store and the artifact service already bump (a dict
increment on the hot path, nothing else); the heartbeat latency histogram is observed
per heartbeat message (the time the coordinator spends on it, from the request arriving
to the response being handed to gRPC). Gauges read the database when scraped: jobs by
state, and for every live attempt its last reported training loss and tokens/s (so the
label set is bounded by the jobs running now, not by history).

Every metric is on a registry of its own per server (`Metrics.registry`), so two
coordinators in one process (tests) never share counts.

| metric | type | labels |
| --- | --- | --- |
| `dflash_leases_granted_total` | counter | |
| `dflash_leases_expired_total` | counter | |
| `dflash_attempts_ended_total` | counter | `state` |
| `dflash_verify_mismatches_total` | counter | |
| `dflash_verifiers_overruled_total` | counter | |
| `dflash_heartbeats_total` | counter | |
| `dflash_heartbeat_latency_seconds` | histogram | |
| `dflash_artifact_bytes_received_total` | counter | |
| `dflash_artifact_bytes_sent_total` | counter | |
| `dflash_jobs` | gauge | `state` |
| `dflash_providers` | gauge | `state` (`registered`, `revoked`, `quarantined`) |
| `dflash_job_training_loss` | gauge | `run_id`, `job_id` |
| `dflash_job_tokens_per_second` | gauge | `run_id`, `job_id` |
| `dflash_job_progress_ratio` | gauge | `run_id`, `job_id` (step / total) |
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from ..store import FINAL_JOB_STATES, Store

JOB_STATES = ("queued", "leased", "cancelling", *FINAL_JOB_STATES)
# Heartbeats are a few SQLite statements: most take well under a millisecond.
HEARTBEAT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _StoreCollector(Collector):
    def __init__(self, store: Store, artifacts):
        self.store = store
        self.artifacts = artifacts

    def collect(self) -> Iterator:
        c = self.store.database.counts
        yield CounterMetricFamily("dflash_leases_granted", "Leases handed to providers.", value=c["leases_granted"])
        yield CounterMetricFamily("dflash_leases_expired", "Leases that expired without a heartbeat (their jobs were requeued or failed).", value=c["attempt_expired"])
        ended = CounterMetricFamily("dflash_attempts_ended", "Attempts that ended, by their state.", labels=["state"])
        for state in ("succeeded", "failed", "cancelled", "retryable", "expired", "revoked", "quarantined", "discarded", "disputed", "mismatch"):
            ended.add_metric([state], c[f"attempt_{state}"])
        yield ended
        yield CounterMetricFamily(
            "dflash_verify_mismatches",
            "Disagreements settled against a capture or train attempt: two verifiers recomputed the same other bytes (its provider quarantined).",
            value=c["verify_mismatches"],
        )
        yield CounterMetricFamily(
            "dflash_verifiers_overruled", "Verify attempts outvoted by a tie-break (their providers quarantined).", value=c["verifiers_overruled"]
        )
        yield CounterMetricFamily("dflash_heartbeats", "Heartbeat messages handled.", value=c["heartbeats"])
        yield CounterMetricFamily("dflash_artifact_bytes_received", "Artifact bytes received from providers (staged uploads).", value=self.artifacts.bytes_in)
        yield CounterMetricFamily("dflash_artifact_bytes_sent", "Artifact bytes sent (downloads by providers, admins and the status page).", value=self.artifacts.bytes_out)

        db = self.store.db
        jobs = GaugeMetricFamily("dflash_jobs", "Jobs by state.", labels=["state"])
        counted = dict(db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall())
        for state in JOB_STATES:
            jobs.add_metric([state], counted.get(state, 0))
        yield jobs
        provs = GaugeMetricFamily("dflash_providers", "Providers, registered (not revoked), revoked, and quarantined (by a verify job's mismatch; also counted above).", labels=["state"])
        (live, revoked) = db.execute("SELECT COALESCE(SUM(revoked_unix IS NULL), 0), COALESCE(SUM(revoked_unix IS NOT NULL), 0) FROM providers").fetchone()
        provs.add_metric(["registered"], live)
        provs.add_metric(["revoked"], revoked)
        (quarantined,) = db.execute("SELECT COUNT(*) FROM providers WHERE quarantined_unix IS NOT NULL").fetchone()
        provs.add_metric(["quarantined"], quarantined)
        yield provs

        loss = GaugeMetricFamily("dflash_job_training_loss", "Last training loss a live attempt reported.", labels=["run_id", "job_id"])
        tps = GaugeMetricFamily("dflash_job_tokens_per_second", "Last training tokens/s a live attempt reported.", labels=["run_id", "job_id"])
        prog = GaugeMetricFamily("dflash_job_progress_ratio", "Step / total steps of a live attempt's current phase.", labels=["run_id", "job_id"])
        for run_id, job_id, step, total, metrics_json in db.execute(
            "SELECT j.run_id, j.job_id, a.step, a.total_steps, a.metrics_json FROM attempts a JOIN jobs j ON j.job_id=a.job_id WHERE a.state='live'"
        ):
            m = json.loads(metrics_json or "{}")
            for family, key in ((loss, "loss"), (tps, "tokens_per_s")):
                v = m.get(key)
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    family.add_metric([run_id, job_id], float(v))
            if total:
                prog.add_metric([run_id, job_id], step / total)
        yield loss
        yield tps
        yield prog


class Metrics:
    """A coordinator's metrics: its registry, the heartbeat histogram, and the collector over the store."""

    def __init__(self, store: Store, artifacts):
        self.registry = CollectorRegistry(auto_describe=False)
        self.heartbeat_latency = Histogram(
            "dflash_heartbeat_latency_seconds",
            "Time the coordinator spends on one heartbeat message (request in, response out).",
            buckets=HEARTBEAT_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_StoreCollector(store, artifacts))

    def exposition(self) -> bytes:
        """The text exposition format (what `/metrics` serves)."""
        return generate_latest(self.registry)
