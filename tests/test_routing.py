"""Routing: next hop per recipient, bifurcation, relay control, address syntax. Pure functions."""

from __future__ import annotations

import ipaddress

import pytest

from transportd.config import load_dict
from transportd.queue.routing import (
    DNS,
    MAILBOX,
    SMART_HOST,
    NextHop,
    bifurcate,
    route,
    route_config,
)
from transportd.smtp.addresses import (
    domain_of,
    is_accepted,
    postmaster_address,
    relay_allowed,
    valid_address,
)


def cfg(accepted=("example.test",), smart_host="", mailbox_database="local"):
    return load_dict({"routing": {"accepted_domains": list(accepted), "smart_host": smart_host,
                                  "mailbox_database": mailbox_database}})


LOCAL = NextHop("mailbox:local", MAILBOX, "local")


# --------------------------------------------------------------------------- route

@pytest.mark.parametrize("address", [
    "alice@example.test", "Alice@EXAMPLE.TEST", "bob@Example.Test.", "x@example.test",
])
def test_accepted_domain_goes_to_the_mailbox_queue(address) -> None:
    hop = route_config(address, cfg(smart_host="127.0.0.1:2500"))
    assert hop == LOCAL
    assert hop.is_local


def test_mailbox_database_names_the_queue() -> None:
    hop = route_config("a@example.test", cfg(mailbox_database="db2"))
    assert hop == NextHop("mailbox:db2", MAILBOX, "db2")


@pytest.mark.parametrize("address, local", [
    ("a@sub.example.test", True), ("a@deep.sub.example.test", True), ("a@SUB.Example.TEST", True),
    ("a@example.test", True), ("a@badexample.test", False), ("a@example.test.evil", False),
    ("a@other.test", False),
])
def test_wildcard_accepted_domain(address, local) -> None:
    hop = route_config(address, cfg(accepted=["*.example.test"], smart_host="relay.test:2500"))
    assert hop.is_local is local
    if not local:
        assert hop == NextHop("smarthost:relay.test:2500", SMART_HOST, "relay.test:2500")


def test_other_domains_go_to_the_smart_host() -> None:
    c = cfg(smart_host="127.0.0.1:2500")
    for address in ("carol@foreign.test", "dave@EXAMPLE.org", "x@example.test.org"):
        hop = route_config(address, c)
        assert hop == NextHop("smarthost:127.0.0.1:2500", SMART_HOST, "127.0.0.1:2500")
        assert not hop.is_local


def test_without_smart_host_the_queue_is_per_domain_dns() -> None:
    c = cfg()
    assert route_config("carol@Foreign.Test", c) == NextHop("dns:foreign.test", DNS, "foreign.test")
    assert route_config("d@other.test.", c) == NextHop("dns:other.test", DNS, "other.test")
    assert route("e@x.test", accepted_domains=[], smart_host="") == NextHop("dns:x.test", DNS, "x.test")


def test_send_connectors_route_by_the_closest_address_space() -> None:
    """Exchange's send connectors: the address space that matches the domain most closely wins (an
    exact domain, then the longest ``*.domain``, then ``*``; the first listed among equals); one
    without smart hosts sends to the MX hosts; a domain no connector matches goes by
    routing.smart_host; accepted domains stay local whatever the connectors say."""
    c = load_dict({
        "routing": {"accepted_domains": ["example.test"], "smart_host": "relay.test:2500"},
        "send_connectors": [
            {"name": "partner", "address_spaces": ["partner.test", "*.corp.partner.test"],
             "smart_hosts": ["p1.test:2526", "p2.test"]},
            {"name": "direct", "address_spaces": ["*.partner.test", "*.example.test"]},
            {"name": "also-partner", "address_spaces": ["partner.test"], "smart_hosts": "never.test"},
        ]})
    partner = NextHop("smarthost:p1.test:2526,p2.test:25", SMART_HOST, "p1.test:2526,p2.test:25")
    assert route_config("a@Partner.Test", c) == partner
    assert route_config("a@x.corp.partner.test", c) == partner  # *.corp.partner.test beats *.partner.test
    assert route_config("a@sales.partner.test", c) == NextHop("dns:sales.partner.test", DNS, "sales.partner.test")
    assert route_config("a@example.test", c) == LOCAL
    assert route_config("a@sub.example.test", c) == NextHop("dns:sub.example.test", DNS, "sub.example.test")
    assert route_config("a@other.test", c) == NextHop("smarthost:relay.test:2500", SMART_HOST, "relay.test:2500")
    catch_all = load_dict({"send_connectors": [{"name": "internet", "address_spaces": ["*"],
                                                 "smart_hosts": "out.test:587"},
                                                {"name": "lab", "address_spaces": ["lab.test"]}]})
    assert route_config("a@any.test", catch_all) == NextHop("smarthost:out.test:587", SMART_HOST, "out.test:587")
    assert route_config("a@lab.test", catch_all) == NextHop("dns:lab.test", DNS, "lab.test")


def test_domain_of_and_is_accepted() -> None:
    assert domain_of("a@B.Test.") == "b.test"
    assert domain_of("weird@local@Host.Test") == "host.test"
    assert is_accepted("EXAMPLE.TEST.", ["example.test"])
    assert not is_accepted("example.test", [])
    assert not is_accepted("xexample.test", ["*.example.test"])


def test_postmaster_is_that_of_the_first_accepted_domain() -> None:
    assert postmaster_address(["example.test", "other.test"]) == "postmaster@example.test"
    assert postmaster_address(["*.example.test"]) == "postmaster@example.test"
    assert postmaster_address([]) is None


# --------------------------------------------------------------------------- bifurcation

def test_bifurcate_groups_by_next_hop_in_order_and_dedups() -> None:
    c = cfg(smart_host="127.0.0.1:2500")
    out = bifurcate(["a@example.test", "x@remote.test", "A@EXAMPLE.TEST", "b@example.test",
                     "y@other.test", "X@Remote.Test"], c)
    smart = NextHop("smarthost:127.0.0.1:2500", SMART_HOST, "127.0.0.1:2500")
    assert out == {LOCAL: ["a@example.test", "b@example.test"], smart: ["x@remote.test", "y@other.test"]}
    assert list(out) == [LOCAL, smart]


def test_bifurcate_with_dns_splits_per_domain() -> None:
    out = bifurcate(["x@remote.test", "y@other.test", "z@REMOTE.test", "a@example.test"], cfg())
    assert out == {
        NextHop("dns:remote.test", DNS, "remote.test"): ["x@remote.test", "z@REMOTE.test"],
        NextHop("dns:other.test", DNS, "other.test"): ["y@other.test"],
        LOCAL: ["a@example.test"],
    }
    assert sum(len(v) for v in out.values()) == 4


def test_bifurcate_empty() -> None:
    assert bifurcate([], cfg()) == {}


# --------------------------------------------------------------------------- relay

NETS = [ipaddress.ip_network(n) for n in ("127.0.0.1/32", "10.0.0.0/8", "::1/128", "fd00::/8")]


@pytest.mark.parametrize("ip, allowed", [
    ("127.0.0.1", True), ("127.0.0.2", False), ("10.200.3.4", True), ("11.0.0.1", False),
    ("::1", True), ("::2", False), ("fd12:3456::1", True), ("fe80::1", False),
    ("::ffff:127.0.0.1", True), ("::ffff:10.1.1.1", True), ("::ffff:127.0.0.2", False),
    ("fd00::1%eth0", True), ("", False), ("not-an-ip", False), ("127.0.0.1:25", False),
])
def test_relay_allowed(ip, allowed) -> None:
    assert relay_allowed(ip, NETS) is allowed


def test_relay_allowed_with_no_networks_is_always_false() -> None:
    assert not relay_allowed("127.0.0.1", [])
    assert not relay_allowed("::1", [])


def test_relay_from_configured_networks() -> None:
    c = load_dict({"routing": {"trusted_networks": ["192.0.2.0/24", "2001:db8::/32"]}})
    assert relay_allowed("192.0.2.77", c.routing.trusted_networks)
    assert relay_allowed("::ffff:192.0.2.1", c.routing.trusted_networks)
    assert relay_allowed("2001:db8::25", c.routing.trusted_networks)
    assert not relay_allowed("198.51.100.1", c.routing.trusted_networks)


# --------------------------------------------------------------------------- address syntax

def _address_of_octets(n: int) -> str:
    local = "a" * 64
    rest = n - len(local) - 1
    labels = []
    while rest > 0:
        size = min(63, rest)
        if rest - size == 1:  # avoid a trailing one-octet gap that a dot cannot fill
            size -= 1
        labels.append("b" * size)
        rest -= size + 1
    domain = ".".join(labels)
    address = f"{local}@{domain}"
    assert len(address.encode()) == n
    return address


@pytest.mark.parametrize("address", [
    "alice@example.test", "first.last@example.test", "a+tag@sub.example.test", "x_y-z@ex-ample.test",
    "o'brien@example.test", "a!#$%&*/=?^`{|}~@example.test", "postmaster@[127.0.0.1]",
    "user@[IPv6:2001:db8::1]", "user@[ipv6:::1]", "jörg@bücher.example", "用户@例子.测试",
    # RFC 5321 4.1.2's Quoted-string local part (aiosmtpd hands it over with its quotes when
    # they are needed): blanks, '@', specials, quoted-pairs, empty, UTF-8 (RFC 6531).
    '"john q. public"@example.test', '"a@b"@example.test', '"a;b,c<d>"@example.test',
    r'"a\"b"@example.test', r'"back\\slash"@example.test', '""@example.test', '"jörg x"@bücher.example',
    "A@B", _address_of_octets(254), "a" * 64 + "@example.test",
])
def test_valid_addresses(address) -> None:
    assert valid_address(address)


@pytest.mark.parametrize("address", [
    "", "alice", "@example.test", "alice@", "a..b@example.test", ".alice@example.test",
    "alice.@example.test", "alice@example..test", "alice@.example.test", "alice@example.test.",
    "al ice@example.test", "alice@exa mple.test", " alice@example.test", "alice@example.test ",
    "a\tb@example.test", "<alice@example.test>", "a@b@example.test", '"a\tb"@example.test',
    '"a"b"@example.test', '"unclosed@example.test', 'x"y"@example.test', '"a\\"@example.test',
    '"a\r\nb"@example.test', '"' + "a" * 63 + '"@example.test',
    # Address literals that hold no address: no next hop can be found for them (RFC 5321 4.1.3).
    "a@[999.1.1.1]", "a@[2001:db8::1]", "a@[IPv6:2001:db8::g]", "a@[tag:content]", "a@[]", "a@[1.2.3]",
    "a@[IPv6:fe80::1%eth0]", "a@[IPv6:fe80::1%1]", "a@[IPv6:fe80::1%]",  # no zone index in a literal
    "alice@-example.test", "alice@example-.test", "a,b@example.test", "a\r\nb@example.test",
    _address_of_octets(255), "a" * 65 + "@example.test", "ü" * 100 + "@" + "b" * 60 + ".test",
])
def test_invalid_addresses(address) -> None:
    assert not valid_address(address)


def test_length_limit_counts_octets_not_characters() -> None:
    # 203 characters, but 2 octets each for the umlauts: over 254 octets.
    address = "ü" * 60 + "@" + ".".join(["c" * 45] * 3) + ".test"
    assert len(address) <= 254 < len(address.encode())
    assert not valid_address(address)


def test_several_smart_hosts_are_tried_from_a_random_one_on() -> None:
    import random

    from transportd.node.connectors import smart_host_targets
    assert [(t.host, t.port) for t in smart_host_targets("relay.test:25")] == [("relay.test", 25)]
    rng = random.Random(3)
    orders = {tuple((t.host, t.port) for t in smart_host_targets("a.test:25,[::1]:2525,b.test:26", rng))
              for _ in range(60)}
    assert all(sorted(o) == [("::1", 2525), ("a.test", 25), ("b.test", 26)] for o in orders)
    assert {o[0] for o in orders} == {("::1", 2525), ("a.test", 25), ("b.test", 26)}  # each one starts
