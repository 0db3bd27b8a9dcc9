"""Routing: which next hop (delivery queue) a recipient goes to, and who may relay.

Pure functions over the configuration: no I/O, no clock. A recipient in an
accepted domain goes to the local mailbox store (queue ``mailbox:<database>``);
any other recipient goes to the smart host (``smarthost:host:port``) or, with
none configured, to the domain's MX hosts (``dns:<domain>``, resolved at
delivery time). A message whose recipients have different next hops is split
per next hop (bifurcation): one recipient row per (recipient, queue).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Mapping, Sequence

from transportd.smtp.addresses import domain_of, is_accepted

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
    """The mailbox database of a recipient: first matching 'pattern=DATABASE' rule, else default."""
    addr = address.lower()
    for rule in rules:
        pattern, _, db = rule.partition("=")
        if fnmatch.fnmatchcase(addr, pattern.strip().lower()):
            return db.strip()
    return default


def route(address: str, *, accepted_domains: Sequence[str], smart_host: str,
          mailbox_database: str = "local", rules: Sequence[str] = (),
          database_owners: Mapping[str, str] | None = None, this_node: str = "") -> NextHop:
    domain = domain_of(address)
    if is_accepted(domain, accepted_domains):
        db = mailbox_database_for(address, rules, mailbox_database)
        owner = (database_owners or {}).get(db)
        if owner and owner != this_node.lower():
            # The database lives on another node of the boundary: hop-by-hop over XSHADOW.
            return NextHop(f"peer:{owner}", PEER, owner)
        return NextHop(f"mailbox:{db}", MAILBOX, db)
    if smart_host:
        return NextHop(f"smarthost:{smart_host}", SMART_HOST, smart_host)
    return NextHop(f"dns:{domain}", DNS, domain)


def route_config(address: str, cfg) -> NextHop:
    return route(address, accepted_domains=cfg.routing.accepted_domains,
                 smart_host=cfg.routing.smart_host, mailbox_database=cfg.routing.mailbox_database,
                 rules=cfg.routing.mailbox_database_rules,
                 database_owners=getattr(cfg, "mailbox_databases", None), this_node=cfg.node.name)


def bifurcate(recipients: Sequence[str], cfg) -> dict[NextHop, list[str]]:
    """Group recipients by next hop, keeping their order; duplicates (case-insensitive) once."""
    out: dict[NextHop, list[str]] = {}
    seen: set[str] = set()
    for rcpt in recipients:
        key = rcpt.lower()
        if key in seen:
            continue
        seen.add(key)
        out.setdefault(route_config(rcpt, cfg), []).append(rcpt)
    return out


