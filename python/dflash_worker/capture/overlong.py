"""`[capture].on_overlong`: what becomes of examples longer than `[data].max_length`.

Decided once, before any weight is read, from the data check's `overlong` list
(every example over the limit, with the response tokens truncation would keep):

- ``skip``: every such example is left out of the capture;
- ``truncate``: each is cut to its first `max_length` tokens (ids and loss mask
  alike, so the supervised region stays the response's own tokens); one that
  would keep no response token (its prompt alone fills `max_length`, or the
  response starts past it) is skipped instead;
- ``fail``: the data check refuses the capture, naming the first one.

The decision goes into the manifest (``overlong``) and, when it changes which
bytes are captured (some example is over the limit), into the capture key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..data.check import Overlong


@dataclass(frozen=True)
class OverlongDecision:
    """The policy, every example over the limit (in capture order) and which of them are truncated."""

    policy: str
    max_length: int
    items: tuple[Overlong, ...] = ()
    truncate: frozenset[tuple[str, str]] = frozenset()  # (split, id) of the truncated ones; the rest are skipped

    @classmethod
    def decide(cls, policy: str, max_length: int, overlong: list[Overlong]) -> OverlongDecision:
        cut = frozenset((o.split, o.id) for o in overlong if o.kept_loss_tokens > 0) if policy == "truncate" else frozenset()
        return cls(policy, max_length, tuple(overlong), cut)

    @property
    def skipped(self) -> list[Overlong]:
        return [o for o in self.items if (o.split, o.id) not in self.truncate]

    @property
    def truncated(self) -> list[Overlong]:
        return [o for o in self.items if (o.split, o.id) in self.truncate]

    def skip_keys(self) -> frozenset[tuple[str, str]]:
        return frozenset((o.split, o.id) for o in self.skipped)

    def warning(self) -> str | None:
        """The one warning line for stderr, or None when no example is over the limit."""
        if not self.items:
            return None
        parts = []
        if self.skipped:
            parts.append(f"`{len(self.skipped)}` skipped ({_ids(self.skipped)})")
        if self.truncated:
            parts.append(f"`{len(self.truncated)}` truncated to `{self.max_length}` tokens ({_ids(self.truncated)})")
        return f"`{len(self.items)}` examples over max_length `{self.max_length}` (on_overlong `{self.policy}`): " + "; ".join(parts)

    def to_manifest(self) -> dict[str, Any]:
        """The manifest's ``overlong`` section; `ids` lists every example over the limit, in capture order."""
        return {
            "policy": self.policy,
            "max_length": self.max_length,
            "count": len(self.items),
            "ids": [o.id for o in self.items],
            "skipped": [o.id for o in self.skipped],
            "truncated": [o.id for o in self.truncated],
            "examples": [
                {"id": o.id, "split": o.split, "tokens": o.tokens, "kept_loss_tokens": o.kept_loss_tokens,
                 "action": "truncated" if (o.split, o.id) in self.truncate else "skipped"}
                for o in self.items
            ],
        }


def _ids(items: list[Overlong], limit: int = 5) -> str:
    shown = ", ".join(f"`{o.id}`" for o in items[:limit])
    return shown + (f" and `{len(items) - limit}` more, listed in the manifest" if len(items) > limit else "")
