"""Addresses and relay rules: which addresses are well formed, which domains are ours, who may relay.

Pure functions over strings and configured networks; no I/O, no clock, no
configuration object. Routing (queue/routing.py) and the receive connectors
(smtp/frontend.py, redundancy/server.py) both decide with these.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Iterable, Sequence


def domain_of(address: str) -> str:
    return address.rpartition("@")[2].lower().rstrip(".")


def is_accepted(domain: str, accepted_domains: Iterable[str]) -> bool:
    d = domain.lower().rstrip(".")
    for accepted in accepted_domains:
        if accepted.startswith("*."):
            base = accepted[2:]
            if d == base or d.endswith("." + base):
                return True
        elif d == accepted:
            return True
    return False


def postmaster_address(accepted_domains: Iterable[str]) -> str | None:
    """Where ``RCPT TO:<Postmaster>`` goes (no domain: RFC 5321 4.1.1.3 and 4.5.1, which a server
    that relays or delivers MUST accept): the postmaster of the first accepted domain, as
    Exchange's postmaster is that of its default accepted domain; None when none is accepted."""
    for domain in accepted_domains:
        return "postmaster@" + domain.removeprefix("*.")
    return None


def relay_allowed(client_ip: str, networks: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> bool:
    try:
        ip = ipaddress.ip_address(client_ip.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return any(ip in net for net in networks)


_LOCAL_PART = re.compile(r"^[A-Za-z0-9!#$%&'*+/=?^_`{|}~.\-\u0080-\U0010ffff]+$")


_DOMAIN = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9\u0080-\U0010ffff]([A-Za-z0-9\-\u0080-\U0010ffff]*"
                     r"[A-Za-z0-9\u0080-\U0010ffff])?(\.[A-Za-z0-9\u0080-\U0010ffff]([A-Za-z0-9\-"
                     r"\u0080-\U0010ffff]*[A-Za-z0-9\u0080-\U0010ffff])?)*)$")


def valid_address(address: str) -> bool:
    """A forward-path we can route: local@domain, no quoting games, at most 254 octets."""
    if not address or len(address.encode("utf-8", "surrogateescape")) > 254:
        return False
    if re.search(r"[\ud800-\udfff]", address):  # undecodable bytes (surrogateescape): not UTF-8
        return False
    local, at, domain = address.rpartition("@")
    if not at or not local or not domain or len(local) > 64:
        return False
    if local.startswith(".") or local.endswith(".") or ".." in local:
        return False
    return bool(_LOCAL_PART.match(local)) and bool(_DOMAIN.match(domain))
