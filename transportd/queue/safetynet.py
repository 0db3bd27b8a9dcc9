"""Safety Net resubmission (docs/PROTOCOL.md section 5): copies kept after processing, replayed on request.

It owns choosing, from this node's Primary or Shadow Safety Net, the messages of a
time window that went (or would go) to one destination (a mailbox database, or the
queue of a peer of the boundary), and queueing them again as new copies: the same
network-message-id, origin ``resubmit``, DSNs suppressed. Duplicate detection at
the mailbox store keeps users from seeing copies twice. Recipients outside the
boundary are never resubmitted (Exchange: no resubmission once a message crossed
it; an outside recipient would see the copy twice). Expiry of the Safety Net
itself is the delivery agent's housekeeping.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy.engine import Connection

from transportd import faults
from transportd.queue import messages as mq
from transportd.queue.routing import bifurcate, mailbox_database_for
from transportd.smtp.addresses import domain_of, is_accepted
from transportd.queue.store import meta, messages, recipients


@dataclass
class Resubmitted:
    original_id: int
    new_id: int
    network_message_id: str
    recipients: list[str]
    source: str  # "primary" or "shadow"
    message_id: str = ""
    sender: str = ""
    subject: str = ""
    size: int | None = None
    author: str = ""

    def row(self) -> dict:
        """The new copy as a message row, for its RESUBMIT tracking row (sender, Message-ID,
        subject and size as the original's, as Exchange writes them)."""
        return {"id": self.new_id, "network_message_id": self.network_message_id, "message_id": self.message_id,
                "sender": self.sender, "author": self.author, "subject": self.subject, "size": self.size}


def destination_matches(hop_identity: str, destination: str) -> bool:
    """A destination is a mailbox database name (MDB01) or a queue identity (smarthost:h:p)."""
    if hop_identity == destination:
        return True
    return hop_identity == f"mailbox:{destination}" or hop_identity.startswith("peer:") and destination == hop_identity[5:]


def outside_boundary(destination: str) -> bool:
    """A queue identity of a next hop outside the boundary (a smart host, a send connector's hosts,
    a domain's MX hosts): Safety Net never resubmits to one."""
    return destination.startswith(("smarthost:", "dns:"))


def known_destinations(cfg: Any) -> set[str]:
    """The destinations a resubmit request can name: the mailbox databases the config knows
    (this node's, those of ``[mailbox_databases]`` and of the routing rules), their queues
    (``mailbox:DB``) and the peers' queues (``peer:NODE``)."""
    dbs = {cfg.routing.mailbox_database, *cfg.mailbox_databases,
           *(rule.partition("=")[2].strip() for rule in cfg.routing.mailbox_database_rules)}
    dbs.discard("")
    return dbs | {f"mailbox:{db}" for db in dbs} | {f"peer:{p.name}" for p in cfg.peers}


def database_of(address: str, cfg: Any) -> str | None:
    """The mailbox database of an accepted-domain recipient (wherever it lives), else None."""
    if not is_accepted(domain_of(address), cfg.routing.accepted_domains):
        return None
    return mailbox_database_for(address, cfg.routing.mailbox_database_rules, cfg.routing.mailbox_database)


def database_created_at(conn: Connection) -> float:
    value = conn.execute(select(meta.c.value).where(meta.c.key == "created_at")).scalar()
    return float(value) if value else 0.0


def _in_window(start: float, end: float, sources: Sequence[str], for_primary: str | None) -> list:
    """The Safety Net copies a request for the window [start, end] looks at."""
    roles = [r for r in sources if r in ("primary", "shadow")]
    return [
        messages.c.state == mq.SAFETY_NET, messages.c.role.in_(roles),
        # The window is when a copy entered the Safety Net (delivered, or discarded on a shadow),
        # as Exchange's resubmit requests mean it, not when the message was first received.
        func.coalesce(messages.c.completed_at, messages.c.received_at).between(start, end),
        # For a peer (``for_primary``): its shadows, and every copy of our Primary Safety Net (mail we
        # handed it hop by hop is in ours: it took that mail as primary, we kept the copy).
        *([or_(messages.c.role == "primary", messages.c.primary_node == for_primary)] if for_primary else [])]


def resubmit_candidates(conn: Connection, cfg: Any, *, destination: str, start: float, end: float,
                        sources: tuple[str, ...] = ("primary", "shadow"), for_primary: str | None = None) -> list[int]:
    """The ids of the copies ``resubmit`` would queue again (the others it leaves as they are),
    oldest first: read without their bodies, outside any write transaction, so that a request
    over a busy node's Safety Net (tens of thousands of copies, most for other destinations)
    writes only the copies it resubmits (``resubmit(among=...)``)."""
    rows = conn.execute(select(messages.c.id, messages.c.role, recipients.c.address, recipients.c.status)
                        .join(recipients, recipients.c.message_id == messages.c.id)
                        .where(*_in_window(start, end, sources, for_primary))
                        .order_by(messages.c.id, recipients.c.id)).all()
    by_copy: dict[int, list[str]] = {}
    for mid, role, address, status in rows:
        by_copy.setdefault(mid, [])
        if role != "primary" or status == mq.DELIVERED:
            by_copy[mid].append(address)
    return [mid for mid, addrs in by_copy.items()
            if _chosen([a for a in dict.fromkeys(addrs) if is_accepted(domain_of(a), cfg.routing.accepted_domains)],
                       cfg, destination)]


def resubmit(conn: Connection, cfg: Any, *, destination: str, start: float, end: float,
             sources: tuple[str, ...] = ("primary", "shadow"), now: float | None = None,
             for_primary: str | None = None, failures: list | None = None,
             among: Sequence[int] | None = None) -> list[Resubmitted]:
    """Queue again the copies of the window (with ``among``: those of these ids); a copy that
    cannot be resubmitted is skipped (its changes undone) and, with ``failures``, reported there
    as (row, error): one bad copy never stops the others."""
    now = time.time() if now is None else now
    out: list[Resubmitted] = []
    rows = conn.execute(select(messages).where(
        *_in_window(start, end, sources, for_primary),
        *([messages.c.id.in_(list(among))] if among is not None else [])
    ).order_by(messages.c.id)).mappings().all()
    for m in rows:
        try:
            with mq.savepoint(conn, "resubmit_one"):
                done = _resubmit_one(conn, cfg, m, destination, now)
        except Exception as exc:  # noqa: BLE001 - isolated per message
            if failures is None:
                raise
            failures.append((dict(m), exc))
            continue
        if done is not None:
            out.append(done)
    return out


def _chosen(addrs: list[str], cfg: Any, destination: str) -> dict[Any, list[str]]:
    """Of a copy's recipients inside the boundary, those for ``destination``, by next hop."""
    chosen = {hop: a for hop, a in bifurcate(addrs, cfg).items()
              if destination_matches(hop.identity, destination)}
    chosen_addrs = {x for v in chosen.values() for x in v}
    in_db = [x for x in addrs if x not in chosen_addrs and database_of(x, cfg) == destination]
    for hop, a in bifurcate(in_db, cfg).items():
        chosen.setdefault(hop, []).extend(a)
    return chosen


def _resubmit_one(conn: Connection, cfg: Any, m: Any, destination: str, now: float) -> Resubmitted | None:
    faults.check("resubmit", m)
    # A primary copy resubmits the recipients it delivered; a shadow copy never delivered
    # anything itself, so all of its recipients count.
    cond = recipients.c.message_id == m["id"]
    if m["role"] == "primary":
        cond = and_(cond, recipients.c.status == mq.DELIVERED)
    # Only recipients inside the boundary (accepted domains: a mailbox database here or on a peer):
    # "No resubmission of the message from Safety Net can occur after the primary message has been
    # successfully transmitted across the transport high availability boundary" (Exchange).
    params = {a: d or "" for a, d in conn.execute(select(recipients.c.address, recipients.c.dsn_params).where(cond))
              if is_accepted(domain_of(a), cfg.routing.accepted_domains)}
    chosen = _chosen(list(params), cfg, destination)
    if not chosen:
        return None
    body = mq.body(conn, m["id"])  # read only for a copy that is resubmitted
    if body is None:
        return None
    copy = mq.NewMessage(
        network_message_id=m["network_message_id"], sender=m["sender"], data=body, recipients=chosen,
        received_at=now, expires_at=now + cfg.delivery.message_expiration_timeout,
        message_id=m["message_id"], submit_time=m["submit_time"], subject=m["subject"], author=m["author"],
        client_ip=m["client_ip"], client_hostname=m["client_hostname"], origin="resubmit",
        suppress_dsn=True, redundancy="unprotected", smtputf8=bool(m["smtputf8"]),
        body_type=m["body_type"] or "",
        # the sender's DSN parameters (RFC 3461) go on with the copy, for a next hop that offers DSN
        dsn_mail=m["dsn_params"] or "", dsn_rcpt={a.lower(): d for a, d in params.items() if d})
    new_id = mq.enqueue(conn, copy)
    return Resubmitted(m["id"], new_id, m["network_message_id"], [a for v in chosen.values() for a in v],
                       m["role"], m["message_id"] or "", m["sender"] or "", m["subject"] or "", len(body),
                       m["author"] or "")


