"""Progress events of a training run, for the run-manager and any other observer.

Events are plain dicts following the worker event schema (``docs/worker-events.md``):

- ``{"event": "progress", "phase": "train", "step", "total_steps", "metrics", "committed_step"}``
  after every optimizer step (``committed_step``: newest committed checkpoint, or None);
- ``{"event": "artifact", "name", "kind", "path", "sha256", "size_bytes", "step"}`` for each
  committed checkpoint (kind ``checkpoint``, sha256 of its manifest) and export (kind ``export``);
- ``{"event": "log", "level", "message"}`` for notable moments (resume, stop request).

They go to the ``on_event`` callback given to `train` (the job runner forwards them), and, when
the environment variable ``DFLASH_EVENTS_FD`` names an open file descriptor, as one JSON line
each to that descriptor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

ENV_EVENTS_FD = "DFLASH_EVENTS_FD"

EventFn = Callable[[dict[str, Any]], None]


class Events:
    """Fan-out of events to a callback and the optional ``DFLASH_EVENTS_FD`` stream."""

    def __init__(self, callback: EventFn | None = None, env: dict[str, str] | None = None) -> None:
        self.callback = callback
        env = os.environ if env is None else env
        raw = env.get(ENV_EVENTS_FD, "").strip()
        self._stream = None
        if raw:
            try:
                self._stream = os.fdopen(os.dup(int(raw)), "w", buffering=1, encoding="utf-8")
            except (ValueError, OSError):
                self._stream = None  # a bad descriptor must not stop training

    def emit(self, event: dict[str, Any]) -> None:
        if self.callback is not None:
            self.callback(event)
        if self._stream is not None:
            try:
                self._stream.write(json.dumps(event, sort_keys=True, allow_nan=False, default=str) + "\n")
            except (OSError, ValueError):
                self._stream = None

    def log(self, message: str, level: str = "info") -> None:
        self.emit({"event": "log", "level": level, "message": message})

    def close(self) -> None:
        if self._stream is not None:
            try:
                self._stream.close()
            except OSError:
                pass
            self._stream = None
