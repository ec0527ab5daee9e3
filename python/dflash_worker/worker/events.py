"""Typed worker events: the one definition of what a worker tells the run-manager.

The wire format is ``docs/worker-events.md`` (one JSON object per line on stdout); the
Rust reader is ``run-manager/src/worker/events.rs``. Library code (capture, training,
evaluation) reports through an `EventSink` callback with these objects and never
prints; the job runner's `JsonLinesSink` is the only writer of the wire format.

``Event.to_json()`` gives the wire object and `event_from_json` reads one back
with the same field rules the run-manager applies, so a test can check both
directions.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, ClassVar

from ..errors import ConfigError

PHASES = ("starting", "prepare", "check", "capture", "train", "export", "evaluate", "finishing")
ARTIFACT_KINDS = ("checkpoint", "export", "manifest", "report", "metrics", "capture", "data")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MAX_METRICS = 64
MAX_METRIC_NAME = 64


def _clean_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Finite numbers only, names bounded: what the run-manager would keep anyway."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if len(out) >= MAX_METRICS:
            break
        if not isinstance(k, str) or not k or len(k) > MAX_METRIC_NAME or isinstance(v, bool):
            continue
        if isinstance(v, (int, float)) and math.isfinite(v):
            out[k] = float(v)
    return out


@dataclass(frozen=True, kw_only=True)
class Progress:
    """Where the job is; relayed into the heartbeat stream."""

    name: ClassVar[str] = "progress"
    phase: str
    step: int = 0
    total_steps: int = 0
    metrics: Mapping[str, float] = field(default_factory=dict)
    # step of the newest committed checkpoint; None when this event says nothing about it
    committed_step: int | None = None

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ConfigError(f"unknown progress phase `{self.phase}`; known: {', '.join(PHASES)}")
        for key in ("step", "total_steps") + (("committed_step",) if self.committed_step is not None else ()):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"progress `{key}` must be a non-negative integer, got `{v!r}`")
        object.__setattr__(self, "metrics", _clean_metrics(self.metrics))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"event": self.name, "phase": self.phase, "step": self.step, "total_steps": self.total_steps}
        if self.metrics:
            out["metrics"] = dict(self.metrics)
        if self.committed_step is not None:
            out["committed_step"] = self.committed_step
        return out


@dataclass(frozen=True, kw_only=True)
class Artifact:
    """A file the worker finished writing; ``path`` is absolute or relative to the job dir.

    A ``checkpoint`` artifact is the checkpoint's ``manifest.json``: the run-manager
    reads the files it lists, verifies them and resumes a restarted worker from it.
    """

    name: ClassVar[str] = "artifact"
    artifact: str  # name in the job's artifact namespace (relative, `/`-separated)
    kind: str
    path: str
    sha256: str
    size_bytes: int
    step: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ARTIFACT_KINDS:
            raise ConfigError(f"unknown artifact kind `{self.kind}`; known: {', '.join(ARTIFACT_KINDS)}")
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ConfigError(f"artifact `{self.artifact}`: sha256 must be 64 lowercase hex digits")
        for key in ("size_bytes", "step"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"artifact `{key}` must be a non-negative integer, got `{v!r}`")

    @classmethod
    def for_file(cls, path: str | Path, *, artifact: str, kind: str, step: int = 0) -> Artifact:
        """Hash a finished file and describe it."""
        from ..manifest import sha256_file

        p = Path(path)
        return cls(artifact=artifact, kind=kind, path=str(p), sha256=sha256_file(p), size_bytes=p.stat().st_size, step=step)

    def to_json(self) -> dict[str, Any]:
        return {
            "event": self.name,
            "name": self.artifact,
            "kind": self.kind,
            "path": self.path,
            "sha256": self.sha256,
            "size_bytes": self.size_bytes,
            "step": self.step,
        }


@dataclass(frozen=True, kw_only=True)
class Log:
    """A notable moment (resume, stop request) for whoever runs the library call.

    Not a wire event: the run-manager's reader knows none named `log`. The job runner
    writes these to its JSON log on stderr (which the run-manager relays); the CLI prints them.
    """

    name: ClassVar[str] = "log"
    message: str
    level: str = "info"

    def __post_init__(self) -> None:
        if self.level not in LOG_LEVELS:
            raise ConfigError(f"unknown log level `{self.level}`; known: {', '.join(LOG_LEVELS)}")

    def to_json(self) -> dict[str, Any]:
        return {"event": self.name, "level": self.level, "message": self.message}


@dataclass(frozen=True, kw_only=True)
class Done:
    """The job finished; the worker exits 0 next."""

    name: ClassVar[str] = "done"

    def to_json(self) -> dict[str, Any]:
        return {"event": self.name}


@dataclass(frozen=True, kw_only=True)
class Error:
    """The job failed; ``retryable`` asks the run-manager to restart the worker."""

    name: ClassVar[str] = "error"
    message: str
    retryable: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"event": self.name, "message": self.message, "retryable": self.retryable}


@dataclass(frozen=True, kw_only=True)
class Stopped:
    """The worker committed a checkpoint on SIGTERM and exits 0 without finishing."""

    name: ClassVar[str] = "stopped"
    committed_step: int

    def to_json(self) -> dict[str, Any]:
        return {"event": self.name, "committed_step": self.committed_step}


Event = Progress | Artifact | Log | Done | Error | Stopped
EventSink = Callable[[Event], None]

_BY_NAME: dict[str, type] = {c.name: c for c in (Progress, Artifact, Log, Done, Error, Stopped)}


def event_from_json(obj: Any) -> Event:
    """Read one wire object back into its typed event; `ConfigError` names what is wrong."""
    if not isinstance(obj, dict):
        raise ConfigError(f"a worker event must be a JSON object, got `{type(obj).__name__}`")
    name = obj.get("event")
    cls = _BY_NAME.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError(f"unknown worker event `{name!r}`; known: {', '.join(_BY_NAME)}")
    fields = {k: v for k, v in obj.items() if k != "event"}
    if cls is Artifact:
        fields["artifact"] = fields.pop("name", None)
    try:
        return cls(**fields)
    except TypeError as exc:
        raise ConfigError(f"worker event `{name}` has wrong fields: {exc}") from None


class JsonLinesSink:
    """Writes each event as one JSON line and flushes (the run-manager reads it live)."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def __call__(self, event: Event) -> None:
        self.stream.write(json.dumps(event.to_json(), sort_keys=True, allow_nan=False) + "\n")
        self.stream.flush()
