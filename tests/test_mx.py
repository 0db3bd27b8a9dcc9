"""MX lookup for next hops without a smart host (dnspython), with the resolver replaced: no network."""

from __future__ import annotations

import dns.asyncresolver
import dns.name
import dns.resolver
import pytest

from transportd.errors import NextHopPermanentError, NextHopUnavailable
from transportd.smtp.client import order_mx, resolve_mx


class MX:
    def __init__(self, preference: int, exchange: str):
        self.preference = preference
        self.exchange = dns.name.from_text(exchange)


def fake_resolver(monkeypatch, result):
    calls = []

    async def resolve(name, rdtype, lifetime=None):
        calls.append((name, rdtype))
        if isinstance(result, Exception):
            raise result
        return result
    monkeypatch.setattr(dns.asyncresolver, "resolve", resolve)
    return calls


async def test_mx_hosts_in_preference_order(monkeypatch):
    calls = fake_resolver(monkeypatch, [MX(20, "mx2.far.test."), MX(10, "mx1.far.test."), MX(30, "mx3.far.test.")])
    targets = await resolve_mx("far.test", 25)
    assert [(t.host, t.port) for t in targets] == [("mx1.far.test", 25), ("mx2.far.test", 25), ("mx3.far.test", 25)]
    assert calls == [("far.test", "MX")]


async def test_no_mx_falls_back_to_the_domain(monkeypatch):
    fake_resolver(monkeypatch, dns.resolver.NoAnswer())
    assert [(t.host, t.port) for t in await resolve_mx("far.test", 2525)] == [("far.test", 2525)]


async def test_null_mx_and_missing_domain_are_permanent(monkeypatch):
    fake_resolver(monkeypatch, [MX(0, ".")])
    with pytest.raises(NextHopPermanentError, match="556 5.1.10"):
        await resolve_mx("nullmx.test", 25)
    fake_resolver(monkeypatch, dns.resolver.NXDOMAIN())
    with pytest.raises(NextHopPermanentError, match="550 5.1.2"):
        await resolve_mx("nowhere.test", 25)


async def test_dns_trouble_is_transient(monkeypatch):
    fake_resolver(monkeypatch, dns.resolver.LifetimeTimeout())
    with pytest.raises(NextHopUnavailable):
        await resolve_mx("slow.test", 25)


def test_equal_preference_hosts_are_tried_in_random_order():
    """RFC 5321 5.1: among MX hosts of equal preference the client picks at random; preference
    order between groups is kept. Over 200 draws each of the three equal hosts comes first."""
    import random
    records = [(10, "a.far.test"), (10, "b.far.test"), (10, "c.far.test"), (5, "first.far.test"),
               (20, "last.far.test")]
    rng = random.Random(7)
    firsts = {}
    for _ in range(200):
        order = order_mx(records, rng)
        assert order[0] == "first.far.test" and order[-1] == "last.far.test"
        assert sorted(order[1:4]) == ["a.far.test", "b.far.test", "c.far.test"]
        firsts[order[1]] = firsts.get(order[1], 0) + 1
    assert set(firsts) == {"a.far.test", "b.far.test", "c.far.test"}
    assert min(firsts.values()) > 30  # each roughly a third of 200


async def test_resolve_mx_shuffles_equal_preference(monkeypatch):
    fake_resolver(monkeypatch, [MX(10, "mx-a.far.test."), MX(10, "mx-b.far.test."), MX(20, "backup.far.test.")])
    seen = set()
    for _ in range(60):
        hosts = [t.host for t in await resolve_mx("far.test", 25)]
        assert hosts[2] == "backup.far.test"
        seen.add(hosts[0])
    assert seen == {"mx-a.far.test", "mx-b.far.test"}


async def test_an_address_literal_is_the_host_itself_with_no_lookup(monkeypatch):
    """RFC 5321 5.1: mail for user@[192.0.2.1] or user@[IPv6:...] goes to that address; no MX or
    address lookup is made (the resolver here would fail the test if called)."""
    calls = fake_resolver(monkeypatch, dns.resolver.NXDOMAIN())
    assert [(t.host, t.port) for t in await resolve_mx("[127.0.0.7]", 2525)] == [("127.0.0.7", 2525)]
    assert [(t.host, t.port) for t in await resolve_mx("[ipv6:0::1]", 25)] == [("::1", 25)]
    with pytest.raises(NextHopPermanentError, match="553 5.1.2"):
        await resolve_mx("[999.0.0.1]", 25)  # refused at RCPT now; an older queue may hold one
    assert calls == []
