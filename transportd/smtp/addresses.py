"""Addresses and relay rules: which addresses are well formed, which domains are ours, who may relay.

Pure functions over strings and configured networks; no I/O, no clock, no
configuration object. Routing (queue/routing.py) and the receive connectors
(smtp/frontend.py, redundancy/server.py) both decide with these. A domain is compared in
one form however it is spelt (any case, U-label or A-label: ``canonical_domain``), and
never rewritten in the address itself.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from typing import Iterable, Sequence

from transportd.config import domain_key


@functools.lru_cache(maxsize=4096)
def canonical_domain(domain: str) -> str | None:
    """The form in which two spellings of one domain compare equal (``config.domain_key``): lower
    case, no final dot, a U-label as its A-label (RFC 5890 2.3.2.1: ``bücher.test`` is
    ``xn--bcher-kva.test``). None: a non-ASCII domain that holds no valid U-label, which is
    RFC 6531 3.3's syntax error and no domain of ours. An ASCII name is only lower-cased: an
    ``xn--`` label that is no valid A-label can match nothing configured (config refuses one)."""
    try:
        return domain_key(domain)
    except ValueError:
        return None


def domain_of(address: str) -> str:
    """The domain of an address as routing compares it: ``canonical_domain``'s form; an invalid
    internationalized one lower-cased as given (it matches no accepted domain or address space)."""
    domain = address.rpartition("@")[2]
    return canonical_domain(domain) or domain.lower().rstrip(".")


def address_key(address: str) -> str:
    """The form in which two spellings of one address are one recipient (duplicates, the mailbox
    folder, duplicate detection): local part lower-cased as everywhere in the node, the domain as
    ``domain_of`` gives it. Only a key: the address itself is sent on as the sender gave it."""
    local, at, domain = address.rpartition("@")
    if not at or domain.startswith("["):
        return address.lower()
    return f"{local.lower()}@{domain_of(address)}"


def is_accepted(domain: str, accepted_domains: Iterable[str]) -> bool:
    """Whether a domain is one of ours, in either spelling (U-label or A-label, any case)."""
    d = canonical_domain(domain)
    if d is None:
        return False
    for accepted in accepted_domains:
        accepted = canonical_domain(accepted) or accepted.lower()  # config's are so already
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


def address_literal_of(client_ip: str) -> str:
    """A client's address as RFC 5321's address literal inside the brackets of a Received
    field's TCP-info (4.4, 4.1.3): ``192.0.2.1``; ``IPv6:2001:db8::1`` (the zone of a link-local
    address left out, no literal holds one); an IPv4 client seen on an IPv6 socket
    (``::ffff:192.0.2.1``) as its IPv4 address. Anything that is not an address is returned as
    given, printable ASCII only."""
    try:
        ip = ipaddress.ip_address(client_ip.split("%", 1)[0])
    except ValueError:
        return re.sub(r"[^\x21-\x5a\x5e-\x7e]", "?", client_ip) or "unknown"  # no [ \ ] in a literal
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ip.ipv4_mapped) if ip.ipv4_mapped else f"IPv6:{ip.compressed}"
    return str(ip)


_LOCAL_PART = re.compile(r"^[A-Za-z0-9!#$%&'*+/=?^_`{|}~.\-\u0080-\U0010ffff]+$")
_QUOTED_LOCAL_PART = re.compile(r'^"(?:[ !#-\[\]-~\u0080-\U0010ffff]|\\[ -~])*"$')
"""RFC 5321 4.1.2's Quoted-string: qtextSMTP (printable ASCII but '"' and '\\', and the space) or
a quoted-pair of a backslash and printable ASCII; UTF-8 too (RFC 6531 3.3). No tab, no CR or LF."""


_DOMAIN = re.compile(r"^[A-Za-z0-9\u0080-\U0010ffff]([A-Za-z0-9\-\u0080-\U0010ffff]*"
                     r"[A-Za-z0-9\u0080-\U0010ffff])?(\.[A-Za-z0-9\u0080-\U0010ffff]([A-Za-z0-9\-"
                     r"\u0080-\U0010ffff]*[A-Za-z0-9\u0080-\U0010ffff])?)*$")


def literal_address(domain: str) -> str | None:
    """The IP address of an address literal (RFC 5321 4.1.3): ``[192.0.2.1]`` gives ``192.0.2.1``,
    ``[IPv6:2001:db8::1]`` gives ``2001:db8::1``; None for a domain name, and for a literal that
    holds no valid address (``[999.1.1.1]``, a bare ``[2001:db8::1]``, a general literal
    ``[tag:...]``: no next hop can be found for it), or a zone index (``[IPv6:fe80::1%eth0]``:
    RFC 5321 4.1.3's IPv6-addr has none, and it names an interface of the sender, not ours;
    Python's ipaddress takes it)."""
    if not (domain.startswith("[") and domain.endswith("]")):
        return None
    inner = domain[1:-1]
    try:
        if inner[:5].lower() == "ipv6:":
            return None if "%" in inner else str(ipaddress.IPv6Address(inner[5:]))
        return str(ipaddress.IPv4Address(inner))
    except ValueError:
        return None


def valid_address(address: str) -> bool:
    """A path we can route (RFC 5321 4.1.2): a dot-string or quoted-string local part, @, a domain
    name or an IPv4/IPv6 address literal; at most 254 octets, a local part of at most 64."""
    if not address or len(address.encode("utf-8", "surrogateescape")) > 254:
        return False
    if re.search(r"[\ud800-\udfff]", address):  # undecodable bytes (surrogateescape): not UTF-8
        return False
    local, at, domain = address.rpartition("@")
    if not at or not local or not domain or len(local.encode("utf-8", "surrogateescape")) > 64:
        return False
    if domain.startswith("["):
        if literal_address(domain) is None:
            return False
    elif not _DOMAIN.match(domain) or canonical_domain(domain) is None:
        return False  # a non-ASCII domain must be U-labels (RFC 6531 3.3): no symbol, no emoji
    if local.startswith('"'):
        return bool(_QUOTED_LOCAL_PART.match(local))
    if local.startswith(".") or local.endswith(".") or ".." in local:
        return False
    return bool(_LOCAL_PART.match(local))
