"""Providers as they registered: what each declared (`Registration`), and which are live now.

A provider's ``identity`` is the name it was created with (an mTLS client certificate's CN
must equal it); ``name`` is what it last registered as. Its tokens are `credentials`'. A
quarantine (`verify`) is lifted here, by an admin (`unquarantine`), and recorded in `audit`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ...errors import NotFoundError, PolicyError
from ..policy import MAX_MEMORY_BYTES, ProviderProfile, format_bytes
from . import audit
from .audit import AuditRow, check_reason
from .db import Database, Part, printable

# Providers `runs show` weighs when it says why a ready job waits (the most recently seen first).
MAX_WAITING_PROVIDERS = 200


@dataclass(frozen=True, kw_only=True)
class Registration:
    client_version: str
    native_client_version: str
    launch_mode: int
    native: bool
    backend: str
    device_count: int
    features: tuple[str, ...]
    capabilities: bytes
    name: str
    # `capabilities.memory_bytes` (per device), what placement's `min_memory_bytes` is compared with.
    memory_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class ProviderRow:
    provider_id: str
    name: str
    client_version: str
    launch_mode: int
    capabilities: bytes | None
    last_seen_unix: float | None
    identity: str = ""
    revoked_unix: float | None = None
    # Set when a verify job recomputed other bytes than this provider uploaded (`verify`): it is leased nothing.
    quarantined_unix: float | None = None
    quarantine_reason: str = ""
    # The last time an admin lifted a quarantine of this provider (`Providers.unquarantine`), if ever.
    last_unquarantine: AuditRow | None = None


class Providers(Part):
    """Registration, listing, and each provider's profile (what leasing and `runs show` weigh)."""

    def __init__(self, database: Database, *, live_seconds: float):
        super().__init__(database)
        # A provider counts as live for `runs show`'s waiting reasons when it asked for work this
        # recently (a long poll refreshes it) or holds a live lease.
        self.live_seconds = live_seconds

    def provider_state(self, provider_id: str) -> tuple[str, str, float | None]:
        """`(identity, token_sha256, revoked_unix)` of a provider; NOT_FOUND if there is none."""
        r = self.db.execute("SELECT identity, token_sha256, revoked_unix FROM providers WHERE provider_id=?", (provider_id[:200],)).fetchone()
        if r is None:
            raise NotFoundError(f"no provider `{provider_id[:80]}`\nhint: `dflash-coordinator providers list` shows the provider ids")
        return r

    def register(self, provider_id: str, reg: Registration) -> None:
        now = self.clock()
        with self._tx() as db:
            cur = db.execute(
                "UPDATE providers SET client_version=?, native_client_version=?, launch_mode=?, native=?, backend=?, device_count=?,"
                " features=?, capabilities=?, name=?, registered_unix=?, last_seen_unix=?, memory_bytes=? WHERE provider_id=?",
                (
                    reg.client_version,
                    reg.native_client_version,
                    reg.launch_mode,
                    int(reg.native),
                    reg.backend,
                    reg.device_count,
                    json.dumps(list(reg.features)),
                    reg.capabilities,
                    reg.name,
                    now,
                    now,
                    min(max(reg.memory_bytes, 0), MAX_MEMORY_BYTES),
                    provider_id,
                ),
            )
            if cur.rowcount != 1:
                raise NotFoundError(f"no provider `{provider_id}`")

    _PROVIDER_COLS = (
        "provider_id, name, client_version, launch_mode, capabilities, last_seen_unix, identity, revoked_unix, quarantined_unix, quarantine_reason"
    )

    def _provider_row(self, r) -> ProviderRow:
        return ProviderRow(
            provider_id=r[0], name=r[1], client_version=r[2], launch_mode=r[3], capabilities=r[4], last_seen_unix=r[5], identity=r[6], revoked_unix=r[7],
            quarantined_unix=r[8], quarantine_reason=r[9], last_unquarantine=audit.last(self.db, r[0], "unquarantine"),
        )  # fmt: skip

    def list_providers(self) -> list[ProviderRow]:
        return [self._provider_row(r) for r in self.db.execute(f"SELECT {self._PROVIDER_COLS} FROM providers ORDER BY seq").fetchall()]

    def get_provider(self, provider_id: str) -> ProviderRow:
        self.provider_state(provider_id)
        return self._provider_row(self.db.execute(f"SELECT {self._PROVIDER_COLS} FROM providers WHERE provider_id=?", (provider_id,)).fetchone())

    def quarantined(self, provider_id: str) -> bool:
        r = self.db.execute("SELECT quarantined_unix FROM providers WHERE provider_id=?", (provider_id,)).fetchone()
        return r is not None and r[0] is not None

    def unquarantine(self, provider_id: str, *, reason: str, peer: str) -> AuditRow:
        """Lift `provider_id`'s quarantine: it is leased work again. Recorded in the audit log with the admin's
        `reason` (`audit.check_reason`), address `peer` and the quarantine lifted. NOT_FOUND for an unknown
        provider, FAILED_PRECONDITION for one that is not quarantined (nothing is recorded then)."""
        reason = check_reason(reason)
        self.provider_state(provider_id)
        now = self.clock()
        with self._tx() as db:
            since, why = db.execute("SELECT quarantined_unix, quarantine_reason FROM providers WHERE provider_id=?", (provider_id,)).fetchone()
            if since is None:
                raise PolicyError(
                    f"provider `{provider_id}` is not quarantined; nothing to lift\nhint: `dflash-coordinator providers list` marks the quarantined ones QUARANTINED"
                )
            db.execute("UPDATE providers SET quarantined_unix=NULL, quarantine_reason='' WHERE provider_id=?", (provider_id,))
            entry = audit.record(
                db, action="unquarantine", provider_id=provider_id, reason=reason, peer=peer, now=now, detail=f"quarantined at unix {since:.0f}: {why}"
            )
        self.on_work()  # it may take queued work again
        return entry

    def profile(self, provider_id: str) -> ProviderProfile:
        r = self.db.execute(
            "SELECT client_version, native_client_version, native, backend, device_count, features, registered_unix, memory_bytes"
            " FROM providers WHERE provider_id=?",
            (provider_id,),
        ).fetchone()
        if r is None:
            raise NotFoundError(f"no provider `{provider_id}`")
        if r[6] is None:
            raise PolicyError(f"provider `{provider_id}` has not registered\nhint: call `Register` before `AcquireLease`")
        return ProviderProfile(
            client_version=r[0],
            native_client_version=r[1],
            native=bool(r[2]),
            backend=r[3],
            device_count=r[4],
            features=frozenset(json.loads(r[5])),
            memory_bytes=r[7],
        )

    def live_providers(self) -> tuple[list[tuple[str, ProviderProfile, bool]], int]:
        """Up to MAX_WAITING_PROVIDERS live providers (seen within `live_seconds`, or holding a live
        lease), the most recently seen first: `(label, profile, busy)`; and how many were found
        (one more than the cap when there are more). Two index range reads, bounded."""
        now = self.clock()
        cols = "provider_id, identity, name, client_version, native_client_version, native, backend, device_count, features, memory_bytes"
        rows = self.db.execute(
            f"SELECT {cols} FROM providers WHERE last_seen_unix >= ? AND revoked_unix IS NULL AND quarantined_unix IS NULL AND registered_unix IS NOT NULL"
            " ORDER BY last_seen_unix DESC LIMIT ?",
            (now - self.live_seconds, MAX_WAITING_PROVIDERS + 1),
        ).fetchall()
        busy = {
            p
            for (p,) in self.db.execute(
                "SELECT DISTINCT provider_id FROM attempts WHERE state='live' AND lease_expires_unix >= ? LIMIT ?", (now, MAX_WAITING_PROVIDERS + 1)
            )
        }
        seen = {r[0] for r in rows}
        for pid in sorted(busy - seen):
            if len(rows) > MAX_WAITING_PROVIDERS:
                break
            r = self.db.execute(f"SELECT {cols} FROM providers WHERE provider_id=? AND revoked_unix IS NULL AND quarantined_unix IS NULL AND registered_unix IS NOT NULL", (pid,)).fetchone()
            if r is not None:
                rows.append(r)
        out = []
        for pid, identity, name, version, native_version, native, backend, count, features, memory in rows[:MAX_WAITING_PROVIDERS]:
            profile = ProviderProfile(
                client_version=version, native_client_version=native_version, native=bool(native), backend=backend, device_count=count,
                features=frozenset(json.loads(features)), memory_bytes=memory,
            )  # fmt: skip
            label = f"{printable(identity or name)[:80]} ({backend}, {format_bytes(memory) if memory else 'memory not declared'})"
            out.append((label, profile, pid in busy))
        return out, len(rows)
