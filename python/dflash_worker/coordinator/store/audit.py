"""The audit log: what changed a provider's standing, when, who asked and why (table ``audit_log``).

Two actions are recorded, and rows are only ever added:

- ``quarantine``: the coordinator quarantined a provider because a verify job's disagreement was
  settled against it (`verify`); ``reason`` is the quarantine's reason, ``peer`` is empty.
- ``unquarantine``: an admin lifted a quarantine (`providers unquarantine ID --reason TEXT`);
  ``reason`` is the admin's text, ``peer`` the admin client's address, and ``detail`` the
  quarantine it lifted (when it began and its reason), which the provider's row no longer holds.

`providers list` shows each provider's last unquarantine; the status page shows the newest entries.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

from ...errors import InvalidRequestError

# An admin's reason is one line of text at most this long.
MAX_REASON_CHARS = 1000
# Entries the status page shows (newest first).
MAX_SHOWN = 50
_COLS = "seq, created_unix, action, provider_id, reason, peer, detail"


@dataclass(frozen=True, kw_only=True)
class AuditRow:
    seq: int
    created_unix: float
    action: str  # `quarantine` or `unquarantine`
    provider_id: str
    reason: str
    peer: str = ""
    detail: str = ""


def _row(r) -> AuditRow:
    return AuditRow(seq=r[0], created_unix=r[1], action=r[2], provider_id=r[3], reason=r[4], peer=r[5], detail=r[6])


def check_reason(reason: str, field: str = "reason") -> str:
    """An admin's reason as recorded: not empty, one line of printable text, at most MAX_REASON_CHARS;
    INVALID_ARGUMENT naming the field otherwise (it reaches terminals and the status page)."""
    if not reason.strip():
        raise InvalidRequestError(f"`{field}` is empty\nhint: say why, e.g. `--reason \"the verifier that accused it was the liar\"`; it is recorded in the audit log")
    if len(reason) > MAX_REASON_CHARS:
        raise InvalidRequestError(f"`{field}` is {len(reason)} characters long; at most {MAX_REASON_CHARS}")
    for i, c in enumerate(reason):
        if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0:
            raise InvalidRequestError(f"`{field}` holds a control character (U+{ord(c):04X} at position {i}); it must be one line of printable text")
    return reason.strip()


def record(db: sqlite3.Connection, *, action: str, provider_id: str, reason: str, now: float, peer: str = "", detail: str = "") -> AuditRow:
    """Add an entry (inside the caller's transaction) and return it."""
    cur = db.execute(
        "INSERT INTO audit_log(created_unix, action, provider_id, reason, peer, detail) VALUES (?,?,?,?,?,?)",
        (now, action, provider_id, reason[:4000], peer[:200], detail[:4000]),
    )
    return AuditRow(seq=int(cur.lastrowid or 0), created_unix=now, action=action, provider_id=provider_id, reason=reason[:4000], peer=peer[:200], detail=detail[:4000])


def last(db: sqlite3.Connection, provider_id: str, action: str) -> AuditRow | None:
    """The provider's newest entry of `action` (index `audit_by_provider`), or None."""
    r = db.execute(
        f"SELECT {_COLS} FROM audit_log WHERE provider_id=? AND action=? ORDER BY seq DESC LIMIT 1", (provider_id, action)
    ).fetchone()
    return None if r is None else _row(r)


def recent(db: sqlite3.Connection, limit: int = MAX_SHOWN) -> list[tuple[AuditRow, str]]:
    """The newest `limit` entries, newest first, each with its provider's identity (else its name)."""
    rows = db.execute(
        f"SELECT a.{_COLS.replace(', ', ', a.')}, COALESCE(NULLIF(p.identity, ''), p.name) FROM audit_log a"
        " JOIN providers p ON p.provider_id=a.provider_id ORDER BY a.seq DESC LIMIT ?",
        (limit,),
    ).fetchall()
    return [(_row(r[:-1]), r[-1]) for r in rows]
