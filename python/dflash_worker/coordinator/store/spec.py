"""A run's specification, validated once when it is created (`RunSpecData`), and its job graph.

What `runs create` submits is checked here, before anything is stored: the job-spec JSON is
parsed strictly (`parse_spec_json`), the versions, features and shard counts are bounded, and a
graph run's per-kind placement is validated so leasing never parses ``spec_json`` again
(`RunSpecData.stored` reads a spec back without checking it a second time).

Job graphs: a run created without shards has ``num_jobs`` independent ``pipeline`` jobs (the
worker runs every stage). A graph run (``capture_shards`` N > 0) has ``prepare`` -> ``capture``
x N (shard i of N) -> ``train`` -> ``evaluate`` x M, with the edges in ``job_deps``
(`RunSpecData.graph`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field

from ...errors import ConfigError, InvalidRequestError
from ...strict_json import no_duplicate_keys
from ..policy import (
    CHECKPOINT_POLICIES,
    DEFAULT_TRUST_INPUTS,
    DEFAULT_VERIFY_FRACTION,
    JOB_GRAPH_FEATURE,
    MAX_LOCAL_RANKS,
    Placement,
    check_features,
    check_placement,
    check_trust_inputs,
    check_verify_fraction,
    check_version,
)

# Job kinds: `pipeline` (every stage in one job: runs without a graph) and the graph's stages.
# `verify`: another provider recomputes a capture job's shards, or replays the train job's training
# up to the checkpoint its export derives from (the run's `verify_fraction`; `store.verify`).
JOB_KINDS = ("pipeline", "prepare", "capture", "train", "evaluate", "verify")
# Capture / evaluate shards per graph run (each one job).
MAX_SHARDS = 1024
MAX_JOBS_PER_RUN = 10_000
MAX_SPEC_JSON_BYTES = 1 << 20


def _no_constant(name):
    raise ValueError(f"`{name}` is not valid JSON")


def parse_spec_json(text: str) -> dict:
    """Parse a run's job-spec JSON strictly: one object, no duplicate keys, no NaN/Infinity."""
    if len(text.encode("utf-8")) > MAX_SPEC_JSON_BYTES:
        raise ConfigError(f"`spec.spec_json` is larger than {MAX_SPEC_JSON_BYTES} bytes")
    try:
        value = json.loads(text, object_pairs_hook=no_duplicate_keys, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        where = f" (line {exc.lineno}, column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise ConfigError(
            f"`spec.spec_json` is not valid JSON{where}: {exc}\n"
            "hint: the job spec must be a JSON object with the recipe, data and model references"
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(f"`spec.spec_json` must be a JSON object, got {type(value).__name__}")
    return value


@dataclass(frozen=True, kw_only=True)
class RunSpecData:
    """A validated run specification (what `runs create` submits)."""

    name: str
    spec_json: str
    required_client_version: str
    checkpoint_policy: str = "durable"
    max_local_ranks: int = 1
    required_features: tuple[str, ...] = ()
    image: str = ""
    num_jobs: int = 1
    # A job graph instead of `num_jobs` pipeline jobs when > 0: prepare -> capture x
    # `capture_shards` -> train -> evaluate x `eval_shards` (0: 1). `num_jobs` is then
    # the graph's job count (1 or that count may be given).
    capture_shards: int = 0
    eval_shards: int = 0
    # Each graph kind's placement, from the spec JSON's `placement` object (validated here,
    # stored in `placements` at creation so leasing never parses `spec_json`); () for pipeline runs.
    placements: tuple[tuple[str, Placement], ...] = field(default=(), init=False, compare=False)
    # Which earlier attempts' checkpoints and capture shards a new attempt is handed (`policy.TRUST_INPUTS`),
    # from the spec JSON's `trust_inputs` (stored in `runs.trust_inputs` at creation).
    trust_inputs: str = field(default=DEFAULT_TRUST_INPUTS, init=False, compare=False)
    # The share of capture jobs a `verify` job recomputes on another provider (spec JSON `verify_fraction`;
    # read only when the run is created, which creates the verify jobs).
    verify_fraction: float = field(default=DEFAULT_VERIFY_FRACTION, init=False, compare=False)

    def __post_init__(self):
        if not self.name or len(self.name) > 200 or any(ord(c) < 0x20 for c in self.name):
            raise InvalidRequestError("`spec.name` must be 1-200 printable characters")
        doc = parse_spec_json(self.spec_json)
        check_version(self.required_client_version, "spec.required_client_version")
        if self.checkpoint_policy not in CHECKPOINT_POLICIES:
            raise InvalidRequestError(
                f"`spec.checkpoint_policy` `{self.checkpoint_policy[:40]}` is not one of {list(CHECKPOINT_POLICIES)}"
            )
        if not 1 <= self.max_local_ranks <= MAX_LOCAL_RANKS:
            raise InvalidRequestError(f"`spec.max_local_ranks` must be 1-1024, got {self.max_local_ranks}")
        check_features(self.required_features, "spec.required_features")
        if len(self.image) > 512:
            raise InvalidRequestError("`spec.image` is longer than 512 characters")
        for k in ("capture_shards", "eval_shards"):
            if not 0 <= getattr(self, k) <= MAX_SHARDS:
                raise InvalidRequestError(f"`spec.{k}` must be 0-{MAX_SHARDS}, got {getattr(self, k)}")
        if self.capture_shards == 0:
            if self.eval_shards:
                raise InvalidRequestError(
                    "`spec.eval_shards` needs `spec.capture_shards`: evaluate jobs exist only in a job graph\n"
                    "hint: give `--capture-shards N` too, or leave `--eval-shards` out"
                )
        else:
            object.__setattr__(self, "eval_shards", self.eval_shards or 1)
            total = 2 + self.capture_shards + self.eval_shards
            if self.num_jobs not in (1, total):
                raise InvalidRequestError(
                    f"`spec.num_jobs` {self.num_jobs} does not apply to a job graph ({total} jobs: prepare, "
                    f"{self.capture_shards} capture, train, {self.eval_shards} evaluate)\nhint: leave `--jobs` out with `--capture-shards`"
                )
            object.__setattr__(self, "num_jobs", total)
            if JOB_GRAPH_FEATURE not in self.required_features:
                object.__setattr__(self, "required_features", (*self.required_features, JOB_GRAPH_FEATURE))
        if not 1 <= self.num_jobs <= MAX_JOBS_PER_RUN:
            raise InvalidRequestError(f"`spec.num_jobs` must be 1-{MAX_JOBS_PER_RUN}, got {self.num_jobs}")
        if "placement" in doc and not self.capture_shards:
            raise InvalidRequestError(
                "`spec.spec_json.placement` applies to the jobs of a job graph; this run has none\n"
                "hint: give `--capture-shards N`, or use `--feature` and `--max-local-ranks` for the run's pipeline jobs"
            )
        object.__setattr__(self, "trust_inputs", check_trust_inputs(doc.get("trust_inputs", DEFAULT_TRUST_INPUTS)))
        fraction = check_verify_fraction(doc.get("verify_fraction", DEFAULT_VERIFY_FRACTION))
        if fraction and not self.capture_shards:
            raise InvalidRequestError(
                "`spec.spec_json.verify_fraction` spot-checks the capture jobs of a job graph; this run has none\n"
                "hint: give `--capture-shards N`, or leave `verify_fraction` out"
            )
        object.__setattr__(self, "verify_fraction", fraction)
        if self.capture_shards:
            placements = check_placement(doc.get("placement", {}), max_local_ranks=self.max_local_ranks)
            object.__setattr__(self, "placements", tuple(placements.items()))
            if fraction and placements["train"].local_ranks > 1:
                raise InvalidRequestError(
                    f"`spec.spec_json.verify_fraction` replays the train job on one rank; this run trains on {placements['train'].local_ranks}"
                    " (several ranks equal one only within a tolerance, and the replay compares bytes)\n"
                    'hint: give `"placement": {"train": {"local_ranks": 1}}`, or leave `verify_fraction` out'
                )

    def verified_shards(self, run_id: str) -> list[int]:
        """The capture shards a verify job recomputes: ceil(`verify_fraction` x N) of the N, those whose
        sha256(run id, shard) is smallest (deterministic for the run, unknown to a provider beforehand)."""
        n = self.capture_shards
        count = min(n, math.ceil(self.verify_fraction * n - 1e-9)) if self.verify_fraction else 0
        return sorted(sorted(range(n), key=lambda i: hashlib.sha256(f"{run_id}:{i}".encode()).digest())[:count])

    def graph(self, run_id: str = "") -> list[tuple[str, int, int, tuple[int, ...]]]:
        """The run's jobs in creation order: `(kind, shard_index, shard_count, needs)`, `needs` indexing this list.

        Every later job needs prepare (the worker reads the prepared data in each); train needs
        every capture shard; evaluate shard j needs train, and shard 0 also needs shards 1..M-1
        (it merges their rows into the run's one report). With a `verify_fraction`, the verified
        capture shards' verify jobs come next (each needs prepare and its capture job; train needs
        them), then the train replay's verify job (needs prepare, every capture job and train; every
        evaluate job needs it). Runs created before these edges keep
        the edges they were created with (`job_deps` is not migrated): a job's inputs are always
        what its own rows say.
        """
        if not self.capture_shards:
            return [("pipeline", 0, 1, ())] * self.num_jobs
        n, m = self.capture_shards, self.eval_shards
        train = n + 1
        jobs = [("prepare", 0, 1, ())]
        jobs += [("capture", i, n, (0,)) for i in range(n)]
        jobs.append(("train", 0, 1, (0, *range(1, n + 1))))
        jobs.append(("evaluate", 0, m, (0, train, *range(train + 2, train + 1 + m))))
        jobs += [("evaluate", i, m, (0, train)) for i in range(1, m)]
        verify = [(len(jobs) + k, i) for k, i in enumerate(self.verified_shards(run_id))]
        jobs += [("verify", i, n, (0, 1 + i)) for _, i in verify]
        kind, index, count, needs = jobs[train]
        jobs[train] = (kind, index, count, (*needs, *(j for j, _ in verify)))
        if self.verify_fraction:
            # Training is replayed too (`verify`): one verify job needing what train needs and train itself,
            # needed by every evaluate job, so nothing reads the train job's export before it is checked.
            replay = len(jobs)
            jobs.append(("verify", 0, 1, (0, *range(1, n + 1), train)))
            for j in range(train + 1, train + 1 + m):
                kind, index, count, needs = jobs[j]
                jobs[j] = (kind, index, count, (*needs, replay))
        return jobs

    @classmethod
    def stored(cls, **fields) -> RunSpecData:
        """A spec read back from the database: checked when it was created, not parsed again
        (re-parsing a 1 MiB `spec_json` per queued run on every AcquireLease stalled the loop)."""
        self = object.__new__(cls)
        for k, v in fields.items():
            object.__setattr__(self, k, v)
        return self
