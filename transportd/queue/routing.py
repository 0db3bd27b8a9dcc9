"""Routing: which next hop (delivery queue) a recipient goes to, and who may relay.

Pure functions over the configuration: no I/O, no clock. A recipient in an
accepted domain goes to the local mailbox store (queue ``mailbox:<database>``);
any other recipient goes by the send connector whose address space matches its
domain most closely (``[[send_connectors]]``: an exact domain before ``*.domain``,
a longer one before a shorter, ``*`` last; the first listed among equals), else by
``routing.smart_host``: to its smart hosts (``smarthost:host:port``, several joined
by commas) or, with none, to the domain's MX hosts (``dns:<domain>``, resolved at
delivery time). A message whose recipients have different next hops is split
per next hop (bifurcation): one recipient row per (recipient, queue).

Domains are compared in ``canonical_domain``'s form (smtp/addresses.py): a recipient in
``bücher.test`` and one in ``xn--bcher-kva.test`` have one next hop, whichever spelling the
configuration uses; a ``dns:`` next hop names the A-label, the form DNS is asked in. The
address itself is never rewritten: each recipient is sent on as the sender spelt it.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from transportd.smtp.addresses import address_key, canonical_domain, domain_of, is_accepted

MAILBOX = "SmtpDeliveryToMailbox"
SMART_HOST = "SmartHostConnectorDelivery"
DNS = "DnsConnectorDelivery"
PEER = "SmtpRelayToMailboxDeliveryGroup"


@dataclass(frozen=True)
class NextHop:
    identity: str  # the queue's name, e.g. "smarthost:127.0.0.1:2500"
    delivery_type: str
    next_hop: str  # host:port, mailbox database name or domain

    @property
    def is_local(self) -> bool:
        return self.delivery_type == MAILBOX


def mailbox_database_for(address: str, rules: Sequence[str], default: str) -> str:
    """The mailbox database of a recipient: first matching 'pattern=DATABASE' rule, else default
    (matched in ``address_key``'s form: a rule's U-label is its A-label, config.py)."""
    addr = address_key(address)
    for rule in rules:
        pattern, _, db = rule.partition("=")
        if fnmatch.fnmatchcase(addr, pattern.strip().lower()):
            return db.strip()
    return default


def _address_space_match(domain: str, space: str) -> tuple[int, int] | None:
    """How closely an address space matches a domain (higher is closer); None: not at all."""
    if space == "*":
        return (0, 0)
    if space.startswith("*."):
        base = space[2:]
        return (1, len(base)) if domain == base or domain.endswith("." + base) else None
    return (2, len(space)) if domain == space else None


def send_connector_for(domain: str, connectors: Sequence[Any]) -> Any | None:
    """The send connector (``name``, ``address_spaces``, ``smart_hosts``) for a domain: the one
    whose address space matches it most closely, the first listed among equals; None: no match."""
    d = canonical_domain(domain) or domain.lower().rstrip(".")
    best: tuple[tuple[int, int], Any] | None = None
    for connector in connectors:
        for space in connector.address_spaces:
            match = _address_space_match(d, canonical_domain(space) or space)  # config's are so already
            if match is not None and (best is None or match > best[0]):
                best = (match, connector)
    return best[1] if best else None


def route(address: str, *, accepted_domains: Sequence[str], smart_host: str,
          mailbox_database: str = "local", rules: Sequence[str] = (),
          database_owners: Mapping[str, str] | None = None, this_node: str = "",
          send_connectors: Sequence[Any] = ()) -> NextHop:
    domain = domain_of(address)
    if is_accepted(domain, accepted_domains):
        db = mailbox_database_for(address, rules, mailbox_database)
        owner = (database_owners or {}).get(db)
        if owner and owner != this_node.lower():
            # The database lives on another node of the boundary: hop-by-hop over XSHADOW.
            return NextHop(f"peer:{owner}", PEER, owner)
        return NextHop(f"mailbox:{db}", MAILBOX, db)
    connector = send_connector_for(domain, send_connectors)
    hosts = connector.smart_hosts if connector is not None else smart_host
    if hosts:
        return NextHop(f"smarthost:{hosts}", SMART_HOST, hosts)
    return NextHop(f"dns:{domain}", DNS, domain)


def route_config(address: str, cfg) -> NextHop:
    return route(address, accepted_domains=cfg.routing.accepted_domains,
                 smart_host=cfg.routing.smart_host, mailbox_database=cfg.routing.mailbox_database,
                 rules=cfg.routing.mailbox_database_rules,
                 database_owners=getattr(cfg, "mailbox_databases", None), this_node=cfg.node.name,
                 send_connectors=getattr(cfg, "send_connectors", ()))


def bifurcate(recipients: Sequence[str], cfg) -> dict[NextHop, list[str]]:
    """Group recipients by next hop, keeping their order; duplicates once, the first spelling kept
    (``address_key``: any case, the domain as U-label or A-label)."""
    out: dict[NextHop, list[str]] = {}
    seen: set[str] = set()
    for rcpt in recipients:
        key = address_key(rcpt)
        if key in seen:
            continue
        seen.add(key)
        out.setdefault(route_config(rcpt, cfg), []).append(rcpt)
    return out


