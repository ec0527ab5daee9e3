"""auth.Gate, FailureLimiter and peer_key without a server: what counts as a failure, windows, bounded memory,
the mTLS identity check, and the constant-time digest comparison in the store."""

from __future__ import annotations

import pytest

from dflash_worker.coordinator import auth
from dflash_worker.coordinator import store as store_mod
from dflash_worker.coordinator.store import Principal, Store
from dflash_worker.errors import AuthenticationError, PermissionDeniedError, RateLimitedError

PROVIDER_CALL = "/dflash.v1.ProviderService/Register"
ADMIN_CALL = "/dflash.v1.AdminService/ListRuns"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Ctx:
    def __init__(self, peer="ipv4:10.0.0.7:40000", cn: str | None = None):
        self._peer = peer
        self._auth = {"transport_security_type": [b"ssl"]} | ({"x509_common_name": [cn.encode()]} if cn is not None else {})

    def peer(self):
        return self._peer

    def auth_context(self):
        return self._auth


def _authenticate(token: str) -> Principal:
    table = {
        "tok-a": Principal(admin=False, provider_id="prov-a", name="box-a"),
        "tok-admin": Principal(admin=True),
    }
    if token not in table:
        raise AuthenticationError("unknown bearer token")
    return table[token]


def _md(token):
    return (("authorization", f"Bearer {token}"),)


@pytest.mark.parametrize(
    "peer, key",
    [
        ("ipv4:10.0.0.7:40000", "10.0.0.7"),
        ("ipv6:[::1]:5000", "::/64"),
        ("ipv6:[2001:db8:1:2:aaaa::1]:443", "2001:db8:1:2::/64"),
        ("ipv6:[2001:db8:1:2:bbbb::9]:1", "2001:db8:1:2::/64"),
        ("ipv6:[::ffff:192.0.2.5]:80", "192.0.2.5"),
        ("ipv6:[fe80::1%eth0]:80", "fe80::/64"),
        ("unix:/tmp/sock", "unix"),
        ("", ""),
        ("ipv4:garbage", ""),
    ],
)
def test_peer_key_drops_the_port_and_groups_ipv6_by_64(peer, key):
    assert auth.peer_key(peer) == key


def test_the_limit_refuses_a_peer_until_its_window_ends():
    clock = Clock()
    lim = auth.FailureLimiter(limit=3, window=10, clock=clock)
    for _ in range(3):
        lim.check("p")
        lim.failed("p")
    with pytest.raises(RateLimitedError, match=r"from `p` \(3 in 10 s\); retry after 10 s"):
        lim.check("p")
    lim.check("q")  # other peers are not affected
    clock.now += 9.5
    with pytest.raises(RateLimitedError, match="retry after 1 s"):
        lim.check("p")
    clock.now += 0.5
    lim.check("p")  # the window ended: forgotten
    assert len(lim) == 0
    # Failures spread wider than a window never add up to the limit.
    for _ in range(5):
        lim.failed("p")
        lim.failed("p")
        clock.now += 11
        lim.check("p")


def test_memory_is_bounded_by_max_peers():
    lim = auth.FailureLimiter(limit=2, window=60, max_peers=100, clock=Clock())
    for i in range(10_000):
        lim.failed(f"peer-{i}")
    assert len(lim) == 100
    lim.failed("peer-9999")
    with pytest.raises(RateLimitedError):
        lim.check("peer-9999")  # the most recent ones are kept


def test_limit_zero_turns_the_limiter_off():
    lim = auth.FailureLimiter(limit=0, window=60, clock=Clock())
    for _ in range(100):
        lim.failed("p")
        lim.check("p")
    assert len(lim) == 0


def test_gate_counts_authentication_failures_only():
    gate = auth.Gate(_authenticate, auth.FailureLimiter(limit=2, window=60, clock=Clock()))
    ctx = Ctx()
    for _ in range(3):  # a valid token on the wrong service: not an authentication failure
        with pytest.raises(PermissionDeniedError):
            gate.admit(ADMIN_CALL, _md("tok-a"), ctx)
    assert gate.admit(PROVIDER_CALL, _md("tok-a"), ctx).provider_id == "prov-a"
    with pytest.raises(AuthenticationError, match="missing"):
        gate.admit(PROVIDER_CALL, (), ctx)
    with pytest.raises(AuthenticationError, match="unknown"):
        gate.admit(PROVIDER_CALL, _md("tok-x"), ctx)
    with pytest.raises(RateLimitedError):
        gate.admit(PROVIDER_CALL, _md("tok-a"), ctx)
    # Another address is unaffected.
    assert gate.admit(PROVIDER_CALL, _md("tok-a"), Ctx("ipv4:10.0.0.8:1")).provider_id == "prov-a"


def test_gate_under_mtls_checks_the_certificate_names_the_provider():
    gate = auth.Gate(_authenticate, auth.FailureLimiter(limit=2, window=60, clock=Clock()), mtls=True)
    assert gate.admit(PROVIDER_CALL, _md("tok-a"), Ctx(cn="box-a")).name == "box-a"
    # Admin calls: any certificate the handshake accepted.
    assert gate.admit(ADMIN_CALL, _md("tok-admin"), Ctx(cn="someone")).admin
    with pytest.raises(AuthenticationError, match="CN `box-b` and the token's provider `box-a` disagree"):
        gate.admit(PROVIDER_CALL, _md("tok-a"), Ctx(cn="box-b"))
    with pytest.raises(AuthenticationError, match="no subject CommonName"):
        gate.admit(PROVIDER_CALL, _md("tok-a"), Ctx(cn=None))
    # Both mismatches counted: the peer is now throttled.
    with pytest.raises(RateLimitedError):
        gate.admit(PROVIDER_CALL, _md("tok-a"), Ctx(cn="box-a"))


def test_without_mtls_the_certificate_is_not_consulted():
    gate = auth.Gate(_authenticate, auth.FailureLimiter(clock=Clock()), mtls=False)
    assert gate.admit(PROVIDER_CALL, _md("tok-a"), Ctx(cn="box-b")).provider_id == "prov-a"


def test_the_store_compares_digests_in_constant_time(tmp_path, monkeypatch):
    store = Store(tmp_path / "c.db")
    try:
        _, token = store.credentials.create_provider("box-a")
        calls = []
        real = store_mod.credentials.hmac.compare_digest
        monkeypatch.setattr(store_mod.credentials.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
        assert store.credentials.authenticate(token).name == "box-a"
        assert calls == [(store_mod.hash_token(token), store_mod.hash_token(token))]
    finally:
        store.close()
