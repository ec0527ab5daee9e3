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
- every required feature must be offered (the backend name counts as one).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from ..errors import InvalidRequestError

PROTOCOL_VERSION = "dflash.v1"
CHECKPOINT_POLICIES = ("durable", "ephemeral")
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


@dataclass(frozen=True, kw_only=True)
class RunRequirements:
    """The parts of a run that decide who may lease its jobs."""

    required_client_version: str
    approved_native_versions: frozenset[str]
    checkpoint_policy: str
    max_local_ranks: int
    required_features: tuple[str, ...]


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
