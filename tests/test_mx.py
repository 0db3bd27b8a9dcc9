"""Next hops without a smart host (smtp/mx.py): MX records and host addresses asked, over real
UDP sockets, of a small DNS server on loopback (tests/dnsserver.py), as the node asks the servers of
``delivery.external_dns_servers``. No other network."""

from __future__ import annotations

import pytest
from dnsserver import TestDnsServer

from transportd.errors import NextHopPermanentError, NextHopUnavailable
from transportd.smtp.mx import NextHopResolver, order_mx, short_of_self


@pytest.fixture
def dns_server():
    with TestDnsServer() as server:
        yield server


def resolver(server, port=25, **own):
    return NextHopResolver([(server.host, server.port)], port, **own)


def hosts(targets):
    return [(t.host, t.address, t.port) for t in targets]


async def test_mx_hosts_in_preference_order_each_at_its_addresses(dns_server):
    dns_server.records = {
        "far.test": {"MX": ["20 mx2.far.test.", "10 mx1.far.test.", "30 mx3.far.test."]},
        "mx1.far.test": {"A": ["127.0.0.11"], "AAAA": ["::1"]},
        "mx2.far.test": {"A": ["127.0.0.12", "127.0.0.13"]},
        "mx3.far.test": {"AAAA": ["::1"]},
    }
    found = hosts(await resolver(dns_server).targets("far.test"))
    assert found[:2] == [("mx1.far.test", "127.0.0.11", 25), ("mx1.far.test", "::1", 25)]
    assert sorted(found[2:4]) == [("mx2.far.test", "127.0.0.12", 25), ("mx2.far.test", "127.0.0.13", 25)]
    assert found[4:] == [("mx3.far.test", "::1", 25)]
    assert ("far.test", "MX") in dns_server.queries


async def test_answers_are_kept_for_their_ttl(dns_server):
    dns_server.records = {"far.test": {"MX": ["10 mx1.far.test."]}, "mx1.far.test": {"A": ["127.0.0.11"]}}
    dns_server.ttl = 300
    r = resolver(dns_server)
    for _ in range(3):
        assert [t.address for t in await r.targets("far.test")] == ["127.0.0.11"]
    assert sorted(dns_server.queries) == [("far.test", "MX"), ("mx1.far.test", "A"), ("mx1.far.test", "AAAA")]


async def test_no_mx_is_the_implicit_mx_of_the_domain_itself(dns_server):
    dns_server.records = {"far.test": {"A": ["127.0.0.5"]}}
    assert hosts(await resolver(dns_server, 2525).targets("far.test")) == [("far.test", "127.0.0.5", 2525)]


async def test_null_mx_missing_domain_and_hosts_without_address_are_permanent(dns_server):
    dns_server.records = {"nullmx.test": {"MX": ["0 ."]}, "noaddr.test": {"MX": ["10 gone.noaddr.test."]},
                          "bare.test": {"TXT": ['"v=spf1 -all"']}}
    r = resolver(dns_server)
    with pytest.raises(NextHopPermanentError, match="556 5.1.10"):
        await r.targets("nullmx.test")
    with pytest.raises(NextHopPermanentError, match="550 5.1.2"):
        await r.targets("nowhere.test")
    # RFC 5321 5.1: MX records present but none usable, or an implicit MX that is unusable, MUST
    # be reported as an error (it was retried until the message expired).
    with pytest.raises(NextHopPermanentError, match="550 5.4.4 .*gone.noaddr.test"):
        await r.targets("noaddr.test")
    with pytest.raises(NextHopPermanentError, match="550 5.4.4 .*bare.test"):
        await r.targets("bare.test")


async def test_dns_trouble_is_transient(dns_server):
    dns_server.records = {"half.test": {"MX": ["10 broken.half.test."]}, "broken.half.test": {"A": ["127.0.0.1"]}}
    dns_server.failing = {"slow.test", "broken.half.test"}
    r = resolver(dns_server)
    with pytest.raises(NextHopUnavailable, match="MX lookup for slow.test failed"):
        await r.targets("slow.test")
    with pytest.raises(NextHopUnavailable, match="address lookup .*broken.half.test"):
        await r.targets("half.test")


async def test_a_server_that_does_not_answer_is_transient():
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:  # bound, never answers
        silent.bind(("127.0.0.1", 0))
        r = NextHopResolver([silent.getsockname()], 25)
        r.resolver.lifetime = 0.5
        with pytest.raises(NextHopUnavailable, match="MX lookup for far.test failed"):
            await r.targets("far.test")


async def test_this_node_among_the_mx_hosts_discards_itself_and_those_no_better(dns_server):
    """RFC 5321 5.1: a relay that finds itself among the MX hosts MUST discard that record and all
    of equal or higher preference; with none left it is an error (a backup MX relays to the better
    hosts only; the best MX would send the message to itself)."""
    dns_server.records = {
        "backup.test": {"MX": ["10 primary.backup.test.", "20 node1.cluster.test.", "20 peer.backup.test.",
                               "30 last.backup.test."]},
        "best.test": {"MX": ["10 Node1.Cluster.Test.", "20 other.best.test."]},
        "equal.test": {"MX": ["10 node1.cluster.test.", "10 other.best.test."]},
        "primary.backup.test": {"A": ["127.0.0.21"]}, "peer.backup.test": {"A": ["127.0.0.22"]},
        "last.backup.test": {"A": ["127.0.0.23"]}, "other.best.test": {"A": ["127.0.0.24"]},
        "node1.cluster.test": {"A": ["127.0.0.1"]},
    }
    r = resolver(dns_server, own_names=["node1.cluster.test"])
    assert hosts(await r.targets("backup.test")) == [("primary.backup.test", "127.0.0.21", 25)]
    for domain in ("best.test", "equal.test"):
        with pytest.raises(NextHopPermanentError, match=f"554 5.4.6 mail for {domain} loops back to myself"):
            await r.targets(domain)
    # The implicit MX naming this node is a loop too.
    dns_server.records["node1.cluster.test"]["MX"] = []
    with pytest.raises(NextHopPermanentError, match="5.4.6"):
        await r.targets("node1.cluster.test")


async def test_an_mx_host_at_an_address_and_port_this_node_listens_on_is_itself(dns_server):
    dns_server.records = {"far.test": {"MX": ["10 mx1.far.test.", "20 alias.far.test."]},
                          "mx1.far.test": {"A": ["127.0.0.32"]}, "alias.far.test": {"A": ["127.0.0.31"]}}
    specific = resolver(dns_server, 2525, own_endpoints=[("127.0.0.31", 2525)])
    assert hosts(await specific.targets("far.test")) == [("mx1.far.test", "127.0.0.32", 2525)]
    # Listening on every address: any address of this machine (all of 127/8 here) is itself.
    wildcard = resolver(dns_server, 2525, own_endpoints=[("0.0.0.0", 2525)])
    with pytest.raises(NextHopPermanentError, match="5.4.6"):
        await wildcard.targets("far.test")
    # Another port is another server, and 192.0.2.1 (TEST-NET, never this machine's) is not us.
    other_port = resolver(dns_server, 2525, own_endpoints=[("127.0.0.31", 2526)])
    assert [t.address for t in await other_port.targets("far.test")] == ["127.0.0.32", "127.0.0.31"]
    dns_server.records["mx1.far.test"] = {"A": ["192.0.2.1"]}
    assert [t.address for t in await wildcard.targets("far.test")] == ["192.0.2.1"]
    # A listener given by name (node1:2525 in a container): its name and the addresses it bound.
    named = resolver(dns_server, 2525, own_endpoints=[("localhost", 2525)])
    assert "localhost" in named.own_names and ("127.0.0.1", 2525) in named.own_endpoints
    dns_server.records["alias.far.test"] = {"A": ["127.0.0.1"]}
    assert [t.address for t in await named.targets("far.test")] == ["192.0.2.1"]


def test_short_of_self_keeps_what_is_better_than_this_node():
    records = [(10, "a"), (20, "me"), (20, "b"), (5, "c")]
    assert short_of_self(records, lambda h: h == "me") == [(10, "a"), (5, "c")]
    assert short_of_self(records, lambda h: h == "nobody") == records
    assert short_of_self(records, lambda h: h in ("me", "c")) is None


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


async def test_equal_preference_hosts_are_shuffled(dns_server):
    dns_server.records = {"far.test": {"MX": ["10 mx-a.far.test.", "10 mx-b.far.test.", "20 backup.far.test."]},
                          "mx-a.far.test": {"A": ["127.0.0.41"]}, "mx-b.far.test": {"A": ["127.0.0.42"]},
                          "backup.far.test": {"A": ["127.0.0.43"]}}
    r = resolver(dns_server)
    seen = set()
    for _ in range(40):
        names = [t.host for t in await r.targets("far.test")]
        assert names[2] == "backup.far.test"
        seen.add(names[0])
    assert seen == {"mx-a.far.test", "mx-b.far.test"}


async def test_an_address_literal_is_the_host_itself_with_no_lookup(dns_server):
    """RFC 5321 5.1: mail for user@[192.0.2.1] or user@[IPv6:...] goes to that address; no MX or
    address lookup is made."""
    r = resolver(dns_server, 2525)
    assert [(t.host, t.port) for t in await r.targets("[127.0.0.7]")] == [("127.0.0.7", 2525)]
    assert [(t.host, t.port) for t in await r.targets("[ipv6:0::1]")] == [("::1", 2525)]
    with pytest.raises(NextHopPermanentError, match="553 5.1.2"):
        await r.targets("[999.0.0.1]")  # refused at RCPT now; an older queue may hold one
    assert dns_server.queries == []


async def test_no_resolver_configured_is_a_transient_failure(tmp_path):
    """A container without /etc/resolv.conf: the node starts (smart hosts need no DNS); mail that
    needs an MX lookup waits, with a reply naming the key to set."""
    for text in ("", "search example.test\n"):
        (tmp_path / "resolv.conf").write_text(text)
        r = NextHopResolver([], 25, resolv_conf=str(tmp_path / "resolv.conf"))
        with pytest.raises(NextHopUnavailable, match="delivery.external_dns_servers"):
            await r.targets("far.test")
    r = NextHopResolver([], 25, resolv_conf=str(tmp_path / "missing.conf"))
    with pytest.raises(NextHopUnavailable, match="delivery.external_dns_servers"):
        await r.targets("far.test")
