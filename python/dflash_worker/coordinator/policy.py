"""Which runs a provider may lease: version gate and device policy.

The coordinator alone decides version compatibility (the run-manager repeats
the device checks before launching, as a second line of defence):

- a provider whose ``client_version`` equals the run's required version may
  take the run in either launch mode;
- otherwise it may take the run only if it launches in native mode and its
  ``native_client_version`` was approved for that run by the run admin;
  anything else earns ``UpgradeRequired``;
- ``ephemeral`` runs are never leased to native providers (their checkpoints
  would live only on a machine the coordinator cannot resume from);
- runs with ``max_local_ranks > 1`` go only to CUDA providers, and to CPU providers
  that offer ``cpu_ranks`` (``run-manager --cpu-ranks N``, a test and development
  switch: N gloo ranks on one machine's cores);
- every required feature must be offered (the backend name counts as one);
- a job of a job graph also meets its kind's `placement` (`check_placement`): the provider's
  declared ``capabilities.memory_bytes`` is at least the kind's ``min_memory_bytes``, it offers
  the kind's own required features, and the kind's ``local_ranks`` (not the run's maximum)
  decide whether it must run ranks.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequestError

PROTOCOL_VERSION = "dflash.v1"
CHECKPOINT_POLICIES = ("durable", "ephemeral")
# Which earlier attempts' artifacts a new attempt of the same job is handed (its resume checkpoint,
# a capture job's shards): a job's earlier attempts never succeeded, so their bytes were never
# vouched for by anyone but the provider that sent them. `own`: only attempts of the provider the
# new attempt runs on (a provider resuming its own crashed work gains nothing it did not have);
# `succeeded`: none; `any`: every attempt's, whoever ran it. Outputs of needed jobs (their
# SUCCEEDED attempts') are inputs under every policy. Ordered from the strictest.
TRUST_INPUTS = ("succeeded", "own", "any")
DEFAULT_TRUST_INPUTS = "own"
BACKENDS = ("cuda", "mps", "cpu")
# Offered by a CPU provider started with `run-manager --cpu-ranks N`: it runs up to `device_count` ranks.
CPU_RANKS_FEATURE = "cpu_ranks"
# Required of every job of a job graph (a run with `capture_shards`): a provider that runs a
# job's own part of the graph (one capture shard, train from the shards' inputs, ...), not the
# whole pipeline once per job, which is what a run-manager without it would do.
JOB_GRAPH_FEATURE = "job_graph"
# What workers announce, plus `checkpoint_file`: a file a checkpoint manifest lists, which the
# run-manager uploads before the manifest itself; `data`: a graph's prepare job's split files.
ARTIFACT_KINDS = ("checkpoint", "export", "manifest", "report", "metrics", "capture", "checkpoint_file", "data")

# The kinds of a job graph's jobs (`store.JOB_KINDS` less `pipeline`), which `placement` may name.
GRAPH_KINDS = ("prepare", "capture", "train", "evaluate")
PLACEMENT_KEYS = ("min_memory_bytes", "required_features", "local_ranks")
MAX_LOCAL_RANKS = 1024
# SQLite's INTEGER is signed 64-bit: a larger figure could not be stored or compared.
MAX_MEMORY_BYTES = 2**63 - 1

# Semantic version, as the run-manager prints it (pre-release and build allowed).
_SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?$")
_FEATURE = re.compile(r"^[A-Za-z0-9_.:+-]{1,64}$")
MAX_FEATURES = 64


def check_version(value: str, field: str) -> str:
    """Return `value` if it is a semantic version, else raise naming `field`."""
    if not _SEMVER.match(value or ""):
        raise InvalidRequestError(
            f"`{field}` must be a semantic version like `1.2.3`, got `{value[:80]!s}`\n"
            "hint: use the version the run-manager prints with `run-manager --version`"
        )
    return value


def check_features(values, field: str) -> tuple[str, ...]:
    """Validate a list of feature flags (short identifiers, bounded count)."""
    values = tuple(values)
    if len(values) > MAX_FEATURES:
        raise InvalidRequestError(f"`{field}` lists {len(values)} features; at most {MAX_FEATURES} are allowed")
    for v in values:
        if not _FEATURE.match(v):
            raise InvalidRequestError(f"`{field}` has an invalid feature name `{v[:80]}` (letters, digits, `_.:+-`, 1-64 chars)")
    return values


class Verdict(enum.Enum):
    ELIGIBLE = "eligible"
    # The provider cannot run this job at all (device, mode or features): skip it.
    INCAPABLE = "incapable"
    # Only the client version stands in the way: the provider must upgrade.
    UPGRADE = "upgrade"


@dataclass(frozen=True, kw_only=True)
class ProviderProfile:
    """What a registered provider declared about itself."""

    client_version: str
    native_client_version: str
    native: bool
    backend: str
    device_count: int
    features: frozenset[str]
    # `capabilities.memory_bytes` as registered (per device; 0: not declared).
    memory_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class RunRequirements:
    """The parts of a run that decide who may lease its jobs."""

    required_client_version: str
    approved_native_versions: frozenset[str]
    checkpoint_policy: str
    max_local_ranks: int
    required_features: tuple[str, ...]
    # A placement's memory floor (`Placement.min_memory_bytes`); 0 for pipeline jobs.
    min_memory_bytes: int = 0

    def for_kind(self, placement: Placement) -> RunRequirements:
        """What a job of one kind needs: the run's requirements with its kind's placement on top."""
        extra = tuple(f for f in placement.required_features if f not in self.required_features)
        return dataclasses.replace(
            self, max_local_ranks=placement.local_ranks, min_memory_bytes=placement.min_memory_bytes, required_features=self.required_features + extra
        )


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where the jobs of one kind of a job graph may run, on top of the run's own requirements."""

    min_memory_bytes: int = 0
    required_features: tuple[str, ...] = ()
    local_ranks: int = 1


def check_trust_inputs(value: Any, field: str = "spec.spec_json.trust_inputs") -> str:
    """A run's `trust_inputs` policy (`TRUST_INPUTS`); INVALID_ARGUMENT naming `field` otherwise."""
    if not isinstance(value, str) or value not in TRUST_INPUTS:
        shown = value[:40] if isinstance(value, str) else type(value).__name__
        raise InvalidRequestError(
            f"`{field}` must be one of {', '.join(f'`{t}`' for t in TRUST_INPUTS)}, got `{shown}`\n"
            f"hint: leave it out for `{DEFAULT_TRUST_INPUTS}` (docs/run-admin.md, Trust model)"
        )
    return value


# Verification by replay: the share of a graph run's capture jobs that a `verify` job recomputes on
# another provider, and the share of the train job's steps up to its selected checkpoint that one
# replays (spec JSON `verify_fraction`, 0 to 1; 0: none). A verify job uploads what it
# recomputed under `VERIFY_PREFIX` + the producer's name, and the coordinator compares the digests.
DEFAULT_VERIFY_FRACTION = 0.0
VERIFY_PREFIX = "verify/"
# What a graph's train job records (the worker's `RUN_DIR` and `train.export_run.SELECTION`, and its
# checkpoints' directory): a train replay reads the selected step from its selection record's step.
TRAIN_SELECTION = "run/selection.json"
TRAIN_CHECKPOINTS = "run/checkpoints/"


def check_verify_fraction(value: Any, field: str = "spec.spec_json.verify_fraction") -> float:
    """A run's spot-check fraction: a number from 0 to 1; INVALID_ARGUMENT naming `field` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        shown = str(value)[:40] if isinstance(value, (int, float)) else type(value).__name__
        raise InvalidRequestError(
            f"`{field}` must be a number from 0 to 1, got `{shown}`\n"
            "hint: the share of capture jobs (and of training steps) another provider recomputes (docs/run-admin.md, Trust model);"
            " leave it out for none"
        )
    return float(value)


def default_placement(kind: str, max_local_ranks: int) -> Placement:
    """A kind's placement when the run names none: train (and a pipeline job) gets the run's ranks, the rest 1."""
    return Placement(local_ranks=max_local_ranks if kind in ("train", "pipeline") else 1)


def _placement_int(value: Any, field: str, lo: int, hi: int, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidRequestError(f"`{field}` must be a whole number from {lo} to {hi}, got `{str(value)[:40]}`\nhint: {hint}")
    return value


def check_placement(value: Any, *, max_local_ranks: int, field: str = "spec.spec_json.placement") -> dict[str, Placement]:
    """Validate a job spec's `placement` object; every graph kind's resolved `Placement`.

    `{"train": {"min_memory_bytes": 80000000000, "required_features": ["cuda"], "local_ranks": 8}, ...}`:
    every kind and key is optional; unknown ones are refused, as are numbers out of range
    (`local_ranks` at most the run's `max_local_ranks`, which caps every job of the run).
    """
    if not isinstance(value, dict):
        raise InvalidRequestError(
            f"`{field}` must be a JSON object mapping job kinds to requirements, got {type(value).__name__}\n"
            f'hint: e.g. {{"train": {{"min_memory_bytes": 85899345920}}}}'
        )
    unknown = sorted(set(value) - set(GRAPH_KINDS))
    if unknown:
        raise InvalidRequestError(f"`{field}` names unknown job kind `{str(unknown[0])[:40]}`; the kinds are {list(GRAPH_KINDS)}")
    out = {}
    for kind in GRAPH_KINDS:
        base = default_placement(kind, max_local_ranks)
        part = value.get(kind, {})
        where = f"{field}.{kind}"
        if not isinstance(part, dict):
            raise InvalidRequestError(f"`{where}` must be a JSON object with {list(PLACEMENT_KEYS)}, got {type(part).__name__}")
        unknown = sorted(set(part) - set(PLACEMENT_KEYS))
        if unknown:
            raise InvalidRequestError(f"`{where}` has unknown key `{str(unknown[0])[:40]}`; the keys are {list(PLACEMENT_KEYS)}")
        memory = base.min_memory_bytes
        if "min_memory_bytes" in part:
            memory = _placement_int(
                part["min_memory_bytes"], f"{where}.min_memory_bytes", 0, MAX_MEMORY_BYTES,
                "bytes of device memory a provider must declare; `dflash-worker preflight` prints the peak to put here",
            )  # fmt: skip
        features = base.required_features
        if "required_features" in part:
            feats = part["required_features"]
            if not isinstance(feats, list) or not all(isinstance(f, str) for f in feats):
                raise InvalidRequestError(f"`{where}.required_features` must be a list of feature names")
            features = check_features(dict.fromkeys(feats), f"{where}.required_features")
        ranks = base.local_ranks
        if "local_ranks" in part:
            ranks = _placement_int(
                part["local_ranks"], f"{where}.local_ranks", 1, max_local_ranks,
                "`spec.max_local_ranks` (`--max-local-ranks`) caps every job of the run; raise it to give this kind more ranks",
            )  # fmt: skip
        out[kind] = Placement(min_memory_bytes=memory, required_features=features, local_ranks=ranks)
    return out


def format_bytes(n: int) -> str:
    """`23.5 GiB`, `1.0 TiB`: a memory figure for a message."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def decide(run: RunRequirements, provider: ProviderProfile) -> tuple[Verdict, str]:
    """Return the verdict and a lowercase reason for leasing `run` to `provider`."""
    if provider.native and run.checkpoint_policy == "ephemeral":
        return Verdict.INCAPABLE, "ephemeral runs are not leased to native providers"
    if run.max_local_ranks > 1 and not _runs_ranks(provider):
        return Verdict.INCAPABLE, (
            f"run wants {run.max_local_ranks} local ranks; only cuda providers (and cpu providers started with "
            "`--cpu-ranks`) run more than one"
        )
    offered = provider.features | {provider.backend}
    missing = [f for f in run.required_features if f not in offered]
    if missing:
        return Verdict.INCAPABLE, f"missing required features {missing}"
    if provider.memory_bytes < run.min_memory_bytes:
        return Verdict.INCAPABLE, (
            f"needs `min_memory_bytes` {format_bytes(run.min_memory_bytes)}, provider declares "
            + (format_bytes(provider.memory_bytes) if provider.memory_bytes else "none")
        )
    if provider.client_version == run.required_client_version:
        return Verdict.ELIGIBLE, "client version matches"
    if provider.native and provider.native_client_version and provider.native_client_version in run.approved_native_versions:
        return Verdict.ELIGIBLE, f"native client version `{provider.native_client_version}` approved for this run"
    return Verdict.UPGRADE, (
        f"run requires client version `{run.required_client_version}`, provider runs `{provider.client_version}`"
        + (
            f" (native `{provider.native_client_version}` is not approved for this run)"
            if provider.native_client_version
            else ""
        )
    )


def _runs_ranks(provider: ProviderProfile) -> bool:
    return provider.backend == "cuda" or (provider.backend == "cpu" and CPU_RANKS_FEATURE in provider.features)


def local_ranks(run: RunRequirements, provider: ProviderProfile) -> int:
    """Ranks a leased job gets: up to the run's maximum on CUDA (a rank per device) and on a
    `--cpu-ranks` CPU provider, 1 anywhere else."""
    if not _runs_ranks(provider):
        return 1
    return max(1, min(run.max_local_ranks, provider.device_count or 1))
