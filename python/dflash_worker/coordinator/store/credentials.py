"""Bearer tokens and whose they are: the admin token, the status page's viewer token, provider tokens.

Provider tokens and the admin token are stored only as sha256 digests; the tokens are 256-bit
random strings, so a fast hash is enough (no password stretching is needed against a brute
force of 2**256). Tokens are found by their digest in an in-memory table (no database read per
call) and the stored digest is then compared with `hmac.compare_digest`; the lookup's timing can
only tell a caller about the digest of its own guess.

Token lifecycle: `rotate_token` gives a provider a new token and keeps the old digest in
``retired_tokens`` until the grace period ends (then it is refused, with a message saying so);
`revoke_provider` refuses every token of the provider at once and ends its live attempts as
``revoked``, so the next heartbeat on a stream the provider already has open is ABORTED (a new
call with its token is refused before it gets that far).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from ...errors import AuthenticationError, ConfigError, InvalidRequestError, PolicyError
from .db import Database, Part, new_id
from .jobs import Jobs
from .providers import Providers

DEFAULT_ROTATE_GRACE_SECONDS = 3600
MAX_ROTATE_GRACE_SECONDS = 30 * 24 * 3600

UNKNOWN_TOKEN = "unknown bearer token\nhint: ask the coordinator's admin for a provider token"
REVOKED_TOKEN = "this provider's token was revoked\nhint: ask the coordinator's admin for a new provider token"
GRACE_ENDED = "this token was replaced by `providers rotate` and its grace period has ended\nhint: use the provider's new token"


def hash_token(token: str) -> str:
    """Hex sha256 of a bearer token (what the database keeps instead of the token)."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def new_token() -> str:
    """A fresh bearer token: 256 random bits, URL-safe."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True, kw_only=True)
class Principal:
    """Who a bearer token belongs to."""

    admin: bool
    provider_id: str = ""
    # The name the provider was created with (what an mTLS certificate's CN must be).
    name: str = ""


@dataclass(frozen=True)
class _Token:
    """One accepted token digest: whose it is and until when (None: until rotated or revoked)."""

    digest: str
    principal: Principal
    expires_unix: float | None = None


class Credentials(Part):
    """Who a token belongs to (`authenticate`), and issuing, rotating and revoking tokens."""

    def __init__(self, database: Database, *, providers: Providers, jobs: Jobs):
        super().__init__(database)
        self.providers = providers
        self.jobs = jobs
        self._tokens: dict[str, _Token] = {}
        # The status page's viewer token digest ("" when there is none; None until first read).
        self._viewer_digest: str | None = None
        # Digests refused with a specific reason (revoked, grace ended) instead of "unknown".
        self._refused: dict[str, str] = {}
        self._load_tokens()

    def _load_tokens(self) -> None:
        """Rebuild the in-memory token table from the database (startup and admin-token changes)."""
        now = self.clock()
        tokens: dict[str, _Token] = {}
        refused: dict[str, str] = {}
        for pid, identity, digest, revoked in self.db.execute("SELECT provider_id, identity, token_sha256, revoked_unix FROM providers"):
            if revoked is not None:
                refused[digest] = REVOKED_TOKEN
            else:
                tokens[digest] = _Token(digest, Principal(admin=False, provider_id=pid, name=identity))
        for digest, pid, expires, identity, revoked in self.db.execute(
            "SELECT t.token_sha256, t.provider_id, t.expires_unix, p.identity, p.revoked_unix FROM retired_tokens t JOIN providers p USING (provider_id)"
        ):
            if revoked is not None:
                refused[digest] = REVOKED_TOKEN
            elif expires <= now:
                refused[digest] = GRACE_ENDED
            else:
                tokens[digest] = _Token(digest, Principal(admin=False, provider_id=pid, name=identity), expires)
        row = self.db.execute("SELECT value FROM meta WHERE key='admin_token_sha256'").fetchone()
        if row:
            tokens[row[0]] = _Token(row[0], Principal(admin=True))
        self._tokens, self._refused = tokens, refused

    def has_admin_token(self) -> bool:
        return self.db.execute("SELECT 1 FROM meta WHERE key='admin_token_sha256'").fetchone() is not None

    def set_admin_token(self, token: str) -> None:
        """Replace the admin token (only its hash is kept)."""
        if len(token) < 16:
            raise ConfigError("the admin token must be at least 16 characters\nhint: leave it unset and one is generated")
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('admin_token_sha256', ?)", (hash_token(token),))
        self._load_tokens()

    def has_viewer_token(self) -> bool:
        return self.db.execute("SELECT 1 FROM meta WHERE key='viewer_token_sha256'").fetchone() is not None

    def set_viewer_token(self, token: str) -> None:
        """Replace the status page's read-only viewer token (only its hash is kept). It is never a gRPC credential."""
        if len(token) < 16:
            raise ConfigError("the viewer token must be at least 16 characters\nhint: leave it unset and one is generated")
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('viewer_token_sha256', ?)", (hash_token(token),))
        self._viewer_digest = hash_token(token)

    def web_role(self, token: str) -> str | None:
        """`"admin"` or `"viewer"` for a token the status page accepts, else None (provider tokens are refused)."""
        if not token or len(token) > 512:
            return None
        digest = hash_token(token)
        viewer = self._viewer_digest
        if viewer is None:
            row = self.db.execute("SELECT value FROM meta WHERE key='viewer_token_sha256'").fetchone()
            viewer = self._viewer_digest = row[0] if row else ""
        if viewer and hmac.compare_digest(viewer, digest):
            return "viewer"
        p = self.principal(token)
        return "admin" if p is not None and p.admin else None

    def authenticate(self, token: str) -> Principal:
        """Who `token` belongs to; raises `AuthenticationError` (saying why) for a token that is not valid now."""
        digest = hash_token(token)
        entry = self._tokens.get(digest)
        if entry is None or not hmac.compare_digest(entry.digest, digest):
            raise AuthenticationError(self._refused.get(digest, UNKNOWN_TOKEN))
        if entry.expires_unix is not None and entry.expires_unix <= self.clock():
            del self._tokens[digest]
            self._refused[digest] = GRACE_ENDED
            raise AuthenticationError(GRACE_ENDED)
        return entry.principal

    def principal(self, token: str) -> Principal | None:
        """Who `token` belongs to, or None for a token that is not valid now."""
        try:
            return self.authenticate(token)
        except AuthenticationError:
            return None

    def create_provider(self, name: str) -> tuple[str, str]:
        """Create a provider; return `(provider_id, token)`. The token is not stored."""
        if not name or len(name) > 200 or any(ord(c) < 0x20 for c in name):
            raise InvalidRequestError("`name` must be 1-200 printable characters")
        token = new_token()
        provider_id = new_id("prov")
        digest = hash_token(token)
        with self._tx() as db:
            db.execute(
                "INSERT INTO providers(provider_id, name, identity, token_sha256, created_unix) VALUES (?,?,?,?,?)",
                (provider_id, name, name, digest, self.clock()),
            )
        self._tokens[digest] = _Token(digest, Principal(admin=False, provider_id=provider_id, name=name))
        return provider_id, token

    def rotate_token(self, provider_id: str, grace_seconds: float) -> tuple[str, float]:
        """Give a provider a new token; the old one keeps working for `grace_seconds`.

        Returns `(new_token, old_token_expires_unix)`. A grace of 0 refuses the
        old token at once. Tokens still in an earlier rotation's grace period
        keep their own end.
        """
        if not 0 <= grace_seconds <= MAX_ROTATE_GRACE_SECONDS:
            raise InvalidRequestError(f"`grace_seconds` must be 0-{MAX_ROTATE_GRACE_SECONDS}, got {grace_seconds}")
        identity, old, revoked = self.providers.provider_state(provider_id)
        if revoked is not None:
            raise PolicyError(f"provider `{provider_id}` is revoked; its token cannot be rotated\nhint: create a new provider")
        token = new_token()
        digest = hash_token(token)
        now = self.clock()
        expires = now + grace_seconds
        with self._tx() as db:
            db.execute("UPDATE providers SET token_sha256=? WHERE provider_id=?", (digest, provider_id))
            db.execute(
                "INSERT INTO retired_tokens(token_sha256, provider_id, retired_unix, expires_unix) VALUES (?,?,?,?)",
                (old, provider_id, now, expires),
            )
        principal = Principal(admin=False, provider_id=provider_id, name=identity)
        if grace_seconds > 0:
            self._tokens[old] = _Token(old, principal, expires)
        else:
            self._tokens.pop(old, None)
            self._refused[old] = GRACE_ENDED
        self._tokens[digest] = _Token(digest, principal)
        return token, expires

    def revoke_provider(self, provider_id: str) -> int:
        """Refuse every token of a provider from now on and end its live attempts; returns how many were ended.

        Their jobs go back to the queue (or fail at `max_attempts`, or end
        cancelled if a cancel was pending), so another provider takes them up;
        a write on those leases through a call authenticated before now (an
        open Heartbeat stream) is ABORTED. Revoking twice changes nothing.
        """
        self.providers.provider_state(provider_id)
        now = self.clock()
        with self._tx() as db:
            db.execute("UPDATE providers SET revoked_unix=? WHERE provider_id=? AND revoked_unix IS NULL", (now, provider_id))
            live = db.execute("SELECT attempt_id, job_id FROM attempts WHERE provider_id=? AND state='live'", (provider_id,)).fetchall()
            states = [self.jobs.end_attempt(db, a, j, "revoked", f"provider `{provider_id}` was revoked", now) for a, j in live]
        digests = [d for d, t in self._tokens.items() if t.principal.provider_id == provider_id and not t.principal.admin]
        for d in digests:
            del self._tokens[d]
            self._refused[d] = REVOKED_TOKEN
        if "queued" in states:
            self.on_work()
        return len(live)
