"""What the status page shows, read from the coordinator's database in a few bounded queries.

`snapshot(store)` returns plain JSON-able data: the newest `MAX_RUNS` runs (each with up to
`MAX_JOBS` jobs: state, attempts, the live attempt's progress and ETA, the export's
publication and evaluation, and the final attempt's artifacts, up to `MAX_ARTIFACTS`), and
up to `MAX_PROVIDERS` providers, newest first (device, versions, last heartbeat, current lease), and
the audit log's newest `audit.MAX_SHOWN` entries (quarantines, and admins lifting them).
The bounds keep one page refresh a fixed amount of work however large the history; the
coordinator builds it in a process of its own (`snapshot_proc`), off its event loop. A job
graph's train job (its export) and evaluate shard 0 (its report) are always among the jobs
shown, however many capture shards come before them.

ETA is the current phase's: steps left times the seconds per step since the phase began
(`attempts.phase_started_unix`), so a fast `prepare` does not make `train` look quick.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from typing import Any

from ...proto.dflash.v1 import provider_pb2
from ..artifacts.publish import PLOT_NAME, REPORT_NAME
from ..store import StoreReader
from ..store.audit import recent

MAX_RUNS = 50
MAX_JOBS = 50
MAX_PROVIDERS = 200
MAX_ARTIFACTS = 40
_PHASES = {v: provider_pb2.Phase.Name(v).removeprefix("PHASE_").lower() for v in provider_pb2.Phase.values()}


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _progress(row: tuple, now: float) -> dict[str, Any]:
    phase, step, total, committed, metrics_json, last_hb, phase_t0, phase_step0, lease_expires, provider_id = row
    m = json.loads(metrics_json or "{}")
    eta = None
    if phase_t0 is not None and last_hb is not None and total and step > phase_step0 and last_hb > phase_t0:
        eta = (total - step) * (last_hb - phase_t0) / (step - phase_step0)
    return {
        "phase": _PHASES.get(phase, str(phase)),
        "step": step,
        "total_steps": total,
        "committed_step": committed,
        "loss": _num(m.get("loss")),
        "tokens_per_s": _num(m.get("tokens_per_s")),
        "eta_seconds": eta,
        "last_heartbeat_unix": last_hb,
        "heartbeat_age_seconds": None if last_hb is None else max(0.0, now - last_hb),
        "lease_expires_unix": lease_expires,
        "provider_id": provider_id,
    }


def _job(
    store: StoreReader, run_id: str, job_id: str, state: str, attempts: int, current: str | None, kind: str, shard_index: int, shard_count: int, now: float
) -> dict[str, Any]:
    db = store.db
    job: dict[str, Any] = {
        "job_id": job_id, "state": state, "attempts": attempts, "progress": None, "publication": None, "artifacts": [],
        "kind": kind, "shard_index": shard_index, "shard_count": shard_count, "pending_gate": False,
    }  # fmt: skip
    if current is not None:
        r = db.execute(
            "SELECT phase, step, total_steps, committed_step, metrics_json, last_heartbeat_unix, phase_started_unix, phase_started_step,"
            " lease_expires_unix, provider_id FROM attempts WHERE attempt_id=?",
            (current,),
        ).fetchone()
        if r is not None:
            job["progress"] = _progress(r, now)
    if state == "succeeded":
        final = db.execute("SELECT attempt_id FROM attempts WHERE job_id=? AND state='succeeded' ORDER BY number DESC LIMIT 1", (job_id,)).fetchone()
        pub = store.publication(job_id)
        if pub is not None:
            job["publication"] = {
                "published": pub.published,
                "verdict": pub.verdict,
                "reason": pub.reason,
                "evaluation": pub.evaluation,
                "override_unix": pub.override_unix,
                "override_note": pub.override_note,
            }
        if final is not None:
            rows = db.execute(
                "SELECT name, kind, size_bytes, sha256 FROM records WHERE attempt_id=? AND kind IN ('export', 'report')"
                " ORDER BY kind, name LIMIT ?",
                (final[0], MAX_ARTIFACTS),
            ).fetchall()
            exports_ok = pub is not None and pub.published
            # A graph's train job: the gate decides on its export when evaluate shard 0 succeeds.
            job["pending_gate"] = pub is None and kind == "train" and any(r[1] == "export" for r in rows)
            for name, kind, size, sha in rows:
                job["artifacts"].append(
                    {"name": name, "kind": kind, "size_bytes": size, "sha256": sha, "downloadable": kind != "export" or exports_ok}
                )
            job["has_plot"] = any(a["name"] == PLOT_NAME for a in job["artifacts"])
            job["has_report"] = any(a["name"] == REPORT_NAME for a in job["artifacts"])
    return job


def _providers(store: StoreReader, now: float) -> Iterator[None | list[dict[str, Any]]]:
    db = store.db
    rows = db.execute(
        "SELECT provider_id, identity, name, client_version, native_client_version, backend, device_count, capabilities, last_seen_unix, revoked_unix,"
        " quarantined_unix, quarantine_reason FROM providers ORDER BY seq DESC LIMIT ?",
        (MAX_PROVIDERS,),
    ).fetchall()
    out = []
    for i, (pid, identity, name, version, native_version, backend, count, caps, last_seen, revoked, quarantined, why) in enumerate(rows):
        if i % 25 == 24:
            yield None
        lease = db.execute(
            "SELECT a.job_id, j.run_id, a.last_heartbeat_unix, a.lease_expires_unix FROM attempts a JOIN jobs j ON j.job_id=a.job_id"
            " WHERE a.provider_id=? AND a.state='live' LIMIT 1",
            (pid,),
        ).fetchone()
        c = provider_pb2.DeviceCapabilities.FromString(caps) if caps else provider_pb2.DeviceCapabilities()
        hb = lease[2] if lease else None
        seen = max(x for x in (last_seen, hb, 0.0) if x is not None) or None
        out.append(
            {
                "provider_id": pid,
                "identity": identity,
                "name": name,
                "client_version": version,
                "native_client_version": native_version,
                "device": {"backend": backend, "count": count, "memory_bytes": c.memory_bytes, "platform": c.platform, "bf16": c.supports_bf16},
                "last_heartbeat_unix": hb,
                "last_seen_unix": seen,
                "revoked": revoked is not None,
                # Why a verify job quarantined it (None while it is not quarantined).
                "quarantined": None if quarantined is None else why,
                "lease": None if lease is None else {"job_id": lease[0], "run_id": lease[1], "expires_unix": lease[3]},
            }
        )
    yield out


def _steps(store: StoreReader, now: float) -> Iterator[None | dict[str, Any]]:
    """The snapshot's work in slices: yields None between slices (a job, or 25 providers), the result last."""
    db = store.db
    runs = []
    for run_id, name, version, policy, num_jobs, created in db.execute(
        "SELECT run_id, name, required_client_version, checkpoint_policy, num_jobs, created_unix FROM runs ORDER BY seq DESC LIMIT ?", (MAX_RUNS,)
    ).fetchall():
        states = dict(db.execute("SELECT state, COUNT(*) FROM jobs WHERE run_id=? GROUP BY state", (run_id,)).fetchall())
        jobs = []
        cols = "seq, job_id, state, attempts, current_attempt_id, kind, shard_index, shard_count"
        rows = db.execute(f"SELECT {cols} FROM jobs WHERE run_id=? ORDER BY seq LIMIT ?", (run_id, MAX_JOBS)).fetchall()
        if len(rows) == MAX_JOBS:
            # The jobs a graph's result is in, past the first MAX_JOBS (index `jobs_by_kind`).
            last = rows[-1][0]
            rows += db.execute(
                f"SELECT {cols} FROM jobs WHERE run_id=? AND kind=? AND shard_index=0 AND seq > ? UNION ALL"
                f" SELECT {cols} FROM jobs WHERE run_id=? AND kind=? AND shard_index=0 AND seq > ? ORDER BY seq",
                (run_id, "train", last, run_id, "evaluate", last),
            ).fetchall()
        for r in rows:
            jobs.append(_job(store, run_id, *r[1:], now))
            yield None
        total = sum(states.values())
        done = sum(states.get(s, 0) for s in ("succeeded", "failed", "cancelled"))
        state = "finished" if total and done == total else "running" if states.get("leased") or states.get("cancelling") else "queued"
        runs.append(
            {
                "run_id": run_id,
                "name": name,
                "client_version": version,
                "checkpoint_policy": policy,
                "num_jobs": num_jobs,
                "created_unix": created,
                "state": state,
                "job_states": states,
                "jobs": jobs,
                "jobs_shown": len(jobs),
            }
        )
    providers: list = []
    for step in _providers(store, now):
        if step is None:
            yield None
        else:
            providers = step
    total_runs = db.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
    entries = [
        {"created_unix": a.created_unix, "action": a.action, "provider_id": a.provider_id, "provider": who, "reason": a.reason, "peer": a.peer, "detail": a.detail}
        for a, who in recent(db)
    ]
    yield {"now_unix": now, "runs": runs, "runs_total": total_runs, "providers": providers, "audit": entries}


def snapshot(store: StoreReader, *, now: float | None = None) -> dict[str, Any]:
    """The status page's data (bounded; see the module docstring), in one go."""
    *_, result = _steps(store, time.time() if now is None else now)
    return result
