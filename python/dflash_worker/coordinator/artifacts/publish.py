"""The regression gate: a succeeded job's export is published only when it did not regress.

When a job's attempt ends SUCCEEDED with an ``export`` artifact, the coordinator reads
that attempt's evaluation report (``eval/report.json``, what the ``evaluate`` stage
uploads: released draft vs trained draft on held-out prompts) from its own blob store
and decides:

- **published** when the trained draft's pooled acceptance length is not below the
  released draft's by more than the tolerance: the verdict is recomputed here from
  the report's figures (``trained.tau_pooled``, ``baseline.tau_pooled``) with the
  run recipe's ``[evaluate].tie_tolerance`` (default 0.02, relative), the rule
  ``evaluate`` itself uses, so a report whose own ``verdict`` field disagrees
  changes nothing;
- **held back** (``published: false``, with the reason) when the verdict is
  ``regressed``, when there is no report, when it is malformed (the field is named),
  or when it was measured on another split than the run's held-out split
  (``spec.evaluate.split``, else ``[evaluate].split``, default ``test``; ``train``
  is never held out).

In a job graph the export is the train job's and the report evaluate shard 0's (it merges
the other shards' rows): the decision on the train job's export is taken when evaluate shard
0 succeeds, from its report. Until then the export is undecided, so not served (``artifacts
get`` says what it waits for); if the run fails first, it is held back for want of a report.

The job still ends ``succeeded``; only what is served by default changes: an unpublished
export is refused by ``artifacts get`` (FAILED_PRECONDITION naming the reason) and has no
download link on the status page, until an admin publishes it with ``runs publish RUN
--override`` (recorded with its time, note and the admin's address).

The figures are the provider's measurement; the coordinator checks their shape and
recomputes the decision, it does not rerun the evaluation. Reading and parsing the
report (up to `MAX_REPORT_BYTES`) happens on a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError, DflashError
from ...evaluate.report import VERDICTS, verdict
from ...recipe import EvaluateConfig
from ..store import GateInputs, PublicationRow, Store

log = logging.getLogger("dflash_worker.coordinator")

REPORT_NAME = "eval/report.json"  # the evaluate stage's report (worker/spec.py EVAL_DIR)
PLOT_NAME = "eval/acceptance.png"
MAX_REPORT_BYTES = 32 << 20


@dataclass(frozen=True, kw_only=True)
class Decision:
    published: bool
    verdict: str
    reason: str
    evaluation: dict[str, Any]


def held_out(spec: dict[str, Any]) -> tuple[str, float]:
    """`(split, tolerance)` the run's export is judged on: its job spec's evaluate split and recipe tolerance."""
    recipe = spec.get("recipe") if isinstance(spec.get("recipe"), dict) else {}
    section = recipe.get("evaluate") if isinstance(recipe.get("evaluate"), dict) else {}
    known = {k: section[k] for k in ("split", "tie_tolerance") if k in section}
    try:
        ecfg = EvaluateConfig(**known)
    except (ConfigError, TypeError) as exc:
        raise ConfigError(f"the run's `recipe.evaluate`: {exc}") from None
    opts = spec.get("evaluate") if isinstance(spec.get("evaluate"), dict) else {}
    split = opts.get("split") if isinstance(opts.get("split"), str) else ecfg.split
    return split, float(ecfg.tie_tolerance)


def _number(doc: dict, *path: str) -> float:
    v: Any = doc
    for k in path:
        if not isinstance(v, dict) or k not in v:
            raise ValueError(f"`{'.'.join(path)}` is missing")
        v = v[k]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"`{'.'.join(path)}` must be a finite non-negative number, got `{str(v)[:40]}`")
    return float(v)


def _positions(doc: dict, name: str) -> list[float]:
    pos = doc.get(name, {}).get("pooled", {}).get("per_position", []) if isinstance(doc.get(name), dict) else []
    if not isinstance(pos, list) or len(pos) > 1024:
        raise ValueError(f"`{name}.pooled.per_position` must be a list of at most 1024 numbers")
    out = []
    for i, v in enumerate(pos):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"`{name}.pooled.per_position[{i}]` is not a number")
        out.append(float(v))
    return out


def decide(report: bytes | None, spec_json: str, *, no_report: str = "") -> Decision:
    """The gate's decision on one export from its report's bytes (None: no report, for the reason
    `no_report` when given) and the run's spec."""
    try:
        split, tol = held_out(json.loads(spec_json))
    except (ConfigError, ValueError) as exc:
        return Decision(published=False, verdict="", reason=f"the run's spec does not say how to judge it: {exc}", evaluation={})
    if report is None and no_report:
        return Decision(published=False, verdict="", reason=no_report, evaluation={})
    if report is None:
        return Decision(
            published=False,
            verdict="",
            reason=f"no evaluation report (`{REPORT_NAME}`): an export is published only after `evaluate` shows it did not regress; "
            "add `evaluate` to the run's stages",
            evaluation={},
        )
    try:
        doc = json.loads(report)
        if not isinstance(doc, dict):
            raise ValueError("it is not a JSON object")
        got_split = doc.get("split")
        if not isinstance(got_split, str):
            raise ValueError("`split` is missing")
        trained, released = _number(doc, "trained", "tau_pooled"), _number(doc, "baseline", "tau_pooled")
        counts = doc.get("verdict_counts", {})
        if not isinstance(counts, dict) or any(not isinstance(counts.get(v, 0), int) or isinstance(counts.get(v, 0), bool) for v in VERDICTS):
            raise ValueError("`verdict_counts` must map improved/tied/regressed to integers")
        evaluation = {
            "split": got_split,
            "prompts": int(_number(doc, "prompts")),
            "tau_released": released,
            "tau_trained": trained,
            "tau_released_mean": _number(doc, "baseline", "tau_mean"),
            "tau_trained_mean": _number(doc, "trained", "tau_mean"),
            "per_position_released": _positions(doc, "baseline"),
            "per_position_trained": _positions(doc, "trained"),
            "counts": {v: int(counts.get(v, 0)) for v in VERDICTS},
            "tolerance": tol,
            "report_verdict": str(doc.get("verdict", ""))[:20],
        }
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        return Decision(published=False, verdict="", reason=f"the evaluation report `{REPORT_NAME}` is not usable: {exc}", evaluation={})
    v = verdict(trained, released, tol)
    evaluation["verdict"] = v
    if split == "train" or got_split != split:
        why = "`train` is not held out" if split == "train" else f"the run's held-out split is `{split}`"
        return Decision(published=False, verdict=v, reason=f"the report was measured on split `{got_split}`; {why}", evaluation=evaluation)
    figures = f"acceptance length {trained:.4f} trained vs {released:.4f} released on `{split}`, tolerance {tol:g}"
    if v == "regressed":
        return Decision(published=False, verdict=v, reason=f"regressed: {figures}", evaluation=evaluation)
    return Decision(published=True, verdict=v, reason=f"{v}: {figures}", evaluation=evaluation)


def _read_report(blobs, record) -> bytes:
    if record.size_bytes > MAX_REPORT_BYTES:
        raise ValueError(f"it is {record.size_bytes} bytes; at most {MAX_REPORT_BYTES}")
    return b"".join(blobs.read(record.sha256, 0, 1 << 20))


class PublishGate:
    """Decides publication for jobs as they succeed (and, at start, for any the last run left undecided)."""

    def __init__(self, store: Store, blobs):
        self.store = store
        self.blobs = blobs

    async def decide_job(self, job_id: str) -> PublicationRow | None:
        """Decide on the export a success of `job_id` settles (its own, or for a graph's evaluate shard 0 the
        train job's); that publication (None: nothing to decide yet)."""
        job_id = self.store.publications.gated_job(job_id)
        existing = self.store.publications.publication(job_id)
        if existing is not None:
            return existing
        inputs: GateInputs | None = self.store.publications.gate_inputs(job_id, REPORT_NAME)
        if inputs is None:
            return None

        def work() -> Decision:
            report = None
            if inputs.report is not None:
                try:
                    report = _read_report(self.blobs, inputs.report)
                except ValueError as exc:
                    return Decision(published=False, verdict="", reason=f"the evaluation report `{REPORT_NAME}` is not usable: {exc}", evaluation={})
            return decide(report, inputs.spec_json, no_report=inputs.no_report)

        try:
            d = await asyncio.to_thread(work)
        except DflashError as exc:
            # The blob store is down: decide later (at the next start, or the next call that asks).
            log.warning("regression gate: cannot read the report of job `%s`: %s", job_id, exc)
            return None
        pub = self.store.publications.record_publication(inputs, published=d.published, verdict=d.verdict, reason=d.reason, evaluation=d.evaluation)
        log.info("regression gate: job `%s` export %s (%s)", job_id, "published" if pub.published else "held back", pub.reason)
        return pub

    async def catch_up(self) -> int:
        """Decide every job a previous coordinator left undecided; returns how many were decided."""
        n = 0
        for job_id in self.store.publications.undecided_jobs():
            n += await self.decide_job(job_id) is not None
        return n
