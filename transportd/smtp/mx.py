"""Finding the hosts of a next hop outside the boundary (RFC 5321 5.1), with dnspython.

MX records by preference (equal ones in random order), else the domain itself (the implicit MX);
a null MX is permanent (RFC 7505); each host's addresses are looked up (A, then AAAA) with the same
resolver, the system's or the servers in ``delivery.external_dns_servers`` (Exchange's
ExternalDNSServers), so the address a session went to is the one the tracking log names.

A relay that finds itself among the MX hosts (its node name, or an address and port it listens
on) MUST discard that record and every one of equal or higher preference; with none left the
message loops back to this node and is returned undeliverable (RFC 5321 5.1): a backup MX holds
mail for the better hosts only, never for itself or its equals.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import random
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from transportd.errors import NextHopPermanentError, NextHopUnavailable
from transportd.smtp.addresses import literal_address

DNS_LIFETIME = 10.0
"""Seconds one lookup (all its servers and retries) may take before it is a transient failure."""


@dataclass(frozen=True)
class SmtpTarget:
    """Where a session goes: ``host`` names it (TLS, logs, server-hostname), ``address`` is what
    is connected to when it was looked up here (None: ``host`` is connected to as given)."""
    host: str
    port: int
    address: str | None = None

    @property
    def connect_to(self) -> str:
        return self.address or self.host


def order_mx(records: Iterable[tuple[int, str]], rng: random.Random | None = None) -> list[str]:
    """MX host names by preference, hosts of equal preference in a random order (RFC 5321 5.1:
    "the SMTP client SHOULD pick one at random"), so their load is spread; empty names dropped."""
    shuffle = (rng or random).random
    keyed = sorted((pref, shuffle(), host) for pref, host in records)
    return [host for _, _, host in keyed if host]


def short_of_self(records: list[tuple[int, str]], is_self: Any) -> list[tuple[int, str]] | None:
    """The records left once this node is found among them (RFC 5321 5.1: the record that names
    it and all of equal or higher preference discarded); ``records`` unchanged when none names it;
    None when it names itself at the lowest preference (nothing left: a loop)."""
    mine = [pref for pref, host in records if is_self(host)]
    if not mine:
        return records
    left = [(pref, host) for pref, host in records if pref < min(mine)]
    return left or None


def local_address(address: str) -> bool:
    """Whether ``address`` is one of this machine's (a socket can be bound to it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((address, 0))
        return True
    except OSError as exc:
        if exc.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.EINVAL):
            raise
        return False


class NextHopResolver:
    """The targets of a domain: MX hosts (or the domain) by preference, each at its addresses.

    ``servers``: (address, port) pairs to ask, empty for the system's resolver; ``own_names``: the
    names this node is known by (its node name); ``own_endpoints``: the (address, port) pairs it
    listens on, a wildcard address standing for every address of this machine."""

    def __init__(self, servers: list[tuple[str, int]], port: int, *, own_names: Iterable[str] = (),
                 own_endpoints: Iterable[tuple[str, int]] = (), resolv_conf: str = "/etc/resolv.conf"):
        self.servers = list(servers)
        self.resolv_conf = resolv_conf
        self.port = port
        self.own_names = {n.lower().rstrip(".") for n in own_names if n}
        self.own_endpoints: set[tuple[str, int]] = set()
        for host, listening in own_endpoints:
            try:
                self.own_endpoints.add((_canonical(host), listening))
            except ValueError:  # a listener given by name (node1:2525 in a container): a name we are
                self.own_names.add(host.lower().rstrip("."))  # known by, and the addresses bound
                self.own_endpoints.update((_canonical(str(info[4][0])), listening)
                                          for info in _addresses_of(host))
        self._resolver: Any = None

    @property
    def resolver(self) -> Any:
        """dnspython's resolver, made at the first lookup: the system's (/etc/resolv.conf, read
        then) or one asking ``servers``. A machine with no resolver configured is a transient
        failure of the lookup that needs it, not of the node's start (smart hosts need none)."""
        if self._resolver is None:
            import dns.asyncresolver
            import dns.nameserver
            import dns.resolver
            try:
                resolver = dns.asyncresolver.Resolver(self.resolv_conf, configure=not self.servers)
            except dns.resolver.NoResolverConfiguration as exc:
                raise NextHopUnavailable(f"no DNS resolver configured ({exc}): set delivery.external_dns_servers "
                                         "or /etc/resolv.conf") from None
            if self.servers:
                resolver.nameservers = [dns.nameserver.Do53Nameserver(a, p) for a, p in self.servers]
            resolver.lifetime = DNS_LIFETIME
            resolver.cache = dns.resolver.Cache()  # answers kept for their TTL: one lookup per domain, not per batch
            self._resolver = resolver
        return self._resolver

    def _is_self_endpoint(self, address: str) -> bool:
        address = _canonical(address)
        for own, port in self.own_endpoints:
            if port != self.port:
                continue
            if own == address or (ipaddress.ip_address(own).is_unspecified and local_address(address)):
                return True
        return False

    async def targets(self, domain: str) -> list[SmtpTarget]:
        """Where mail for ``domain`` goes, best first. NextHopPermanentError: the domain does not
        exist, takes no mail (null MX), has no host with an address, or loops back to this node;
        NextHopUnavailable: DNS did not answer (retried later, as RFC 5321 5.1 asks)."""
        if domain.startswith("["):
            ip = literal_address(domain)
            if ip is None:  # the receive connectors refuse these; an older queue may hold one
                raise NextHopPermanentError(f"553 5.1.2 No host in the address literal {domain}")
            return [SmtpTarget(ip, self.port)]
        records = await self._mx(domain)
        addresses = dict(zip([h for _, h in records],
                             await asyncio.gather(*(self._addresses(h) for _, h in records))))

        def is_self(host: str) -> bool:
            found = addresses[host]
            return host.lower() in self.own_names or (
                not isinstance(found, Exception) and any(self._is_self_endpoint(a) for a in found))

        usable = short_of_self(records, is_self)
        if usable is None:
            raise NextHopPermanentError(f"554 5.4.6 mail for {domain} loops back to myself "
                                        f"(this node is its best MX host)")
        out: list[SmtpTarget] = []
        trouble: list[str] = []
        for host in order_mx(usable):
            found = addresses[host]
            if isinstance(found, Exception):
                trouble.append(f"{host}: {found}")
            else:
                out.extend(SmtpTarget(host, self.port, a) for a in found)
        if out:
            return out
        if trouble:
            raise NextHopUnavailable(f"address lookup for the hosts of {domain} failed: " + "; ".join(trouble))
        hosts = ", ".join(h for _, h in usable)
        raise NextHopPermanentError(f"550 5.4.4 Host or domain name not found: no address for {hosts}")

    async def _mx(self, domain: str) -> list[tuple[int, str]]:
        import dns.exception
        import dns.resolver
        try:
            answer = await self.resolver.resolve(domain, "MX")
        except dns.resolver.NoAnswer:
            return [(0, domain)]  # the implicit MX (RFC 5321 5.1)
        except dns.resolver.NXDOMAIN:
            raise NextHopPermanentError(f"550 5.1.2 Host or domain name not found: {domain}") from None
        except dns.exception.DNSException as exc:
            raise NextHopUnavailable(f"MX lookup for {domain} failed: {exc}") from None
        records = [(r.preference, str(r.exchange).rstrip(".")) for r in answer]
        if not any(host for _, host in records):
            raise NextHopPermanentError(f"556 5.1.10 {domain} does not accept mail (null MX, RFC 7505)")
        return [(pref, host) for pref, host in records if host]

    async def _addresses(self, host: str) -> list[str] | Exception:
        """The host's IPv4 then IPv6 addresses ([] where it has none or does not exist); the
        DNS failure where one of the two lookups failed and the other found nothing."""
        import dns.exception
        import dns.resolver
        found: list[str] = []
        failure: Exception | None = None
        for rdtype in ("A", "AAAA"):
            try:
                answer = await self.resolver.resolve(host, rdtype)
                found.extend(r.address for r in answer)
            except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
                continue
            except dns.exception.DNSException as exc:
                failure = exc
        return found if found or failure is None else failure


def _addresses_of(host: str) -> list[Any]:
    """What the listener's name resolves to (as it was bound: the machine's resolver); [] if nothing."""
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return []


def _canonical(address: str) -> str:
    return str(ipaddress.ip_address(address.strip("[]")))
