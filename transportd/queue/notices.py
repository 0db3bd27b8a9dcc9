"""Delivery status notifications as queued messages, and the success notices a lost primary owed.

It owns building a DSN (RFC 3464) as a new message from <> for the sender of a
queued one (``dsn_message``: the node's outcomes, delays and expiries use it),
and the notices of success (RFC 3461 NOTIFY=SUCCESS) that another node owed for
recipients it delivered when it was lost: a shadow hears of such a recipient
(``NotifyDelivered=``/``NotifyRelayed=``, docs/PROTOCOL.md section 4) and marks it
delivered with the notice owed (``NOTICE_OWED``), and so does the holder of a
hop-by-hop fork; a promotion of the copy (or the fork's resubmission) sends the
notice here instead of delivering the recipient again (``send_owed_notices``).
Each function takes an open connection inside a transaction; nothing here talks
SMTP or logs a tracking event (the caller logs the DSN after the commit).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.engine import Connection

from transportd.queue import messages as mq
from transportd.queue.messages import NewMessage
from transportd.queue.routing import bifurcate
from transportd.queue.store import recipients, shadow_forks
from transportd.smtp import dsnparams
from transportd.smtp.dsn import RecipientReport, build_dsn, dsn_needs_utf8
from transportd.smtp.headers import header_fields, rfc5322_date

# The ``last_error`` of a recipient delivered by another node (a primary we shadow, or a peer that
# took it hop by hop) whose success notice that node had not sent yet: followed by the RFC 3464
# action (``delivered`` or ``relayed``), then by who delivered it. A plain ``Delivered=`` (the
# notice is out) or the message's discard ends it; a promotion (or the fork's resubmission) sends
# the notice.
NOTICE_OWED = "success notice owed: "


def notice_owed(action: str, by: str) -> str:
    """The ``last_error`` of a recipient ``by`` delivered whose notice (``action``) it owes."""
    return f"{NOTICE_OWED}{action}; delivered by the primary {by}"


def owed_action(last_error: str | None) -> str | None:
    """The action of the notice a recipient's ``last_error`` says is owed; None when none is."""
    if not last_error or not last_error.startswith(NOTICE_OWED):
        return None
    return last_error[len(NOTICE_OWED):].partition(";")[0].strip() or "relayed"


def notice_owed_on(column: Any) -> Any:
    """A condition on ``recipients.c.last_error``: a notice is owed for that recipient."""
    return column.like(f"{NOTICE_OWED}%")


def utc(ts: float | None) -> datetime | None:
    """A queue database time (seconds since the epoch) as an aware UTC datetime; None as None."""
    return None if ts is None else datetime.fromtimestamp(ts, tz=UTC)


def dsn_message(cfg: Any, original: dict, original_body: bytes, reports: Sequence[RecipientReport],
                now: float) -> NewMessage | None:
    """The DSN (a new message from <>) for ``reports`` (failed, delayed, or delivered and relayed
    where NOTIFY=SUCCESS asked), or None when none may be sent."""
    sender = original.get("sender") or ""
    if not sender or original.get("origin") == "dsn" or original.get("suppress_dsn") or not reports:
        return None
    # RFC 6533: a UTF-8 DSN when the original came with SMTPUTF8 (its sender's side speaks it) and
    # holds UTF-8; it then travels with SMTPUTF8 itself. Otherwise the classic 7-bit DSN.
    utf8 = dsn_needs_utf8(sender, list(reports), original_body, bool(original.get("smtputf8")))
    # RFC 3461 4.3/4.4: the ENVID comes back; the whole message only for RET=FULL and a failure
    # (a notice of delivery or delay carries the headers only).
    asked = original.get("dsn_params") or ""
    data = build_dsn(
        reporting_mta=cfg.node.name, original_sender=sender, original_message=original_body,
        recipients=list(reports), arrival_date=utc(original.get("received_at") or now), now=utc(now), utf8=utf8,
        original_envelope_id=dsnparams.envid_of(asked),
        include_body=dsnparams.returns_full(asked) and any(r.action == "failed" for r in reports),
    )
    message_id, _, subject, author = header_fields(data)  # its own Subject ("Undeliverable: <original's>"), decoded
    return NewMessage(
        network_message_id=str(uuid.uuid4()), sender="", data=data,
        recipients=bifurcate([sender], cfg), received_at=now,
        expires_at=now + cfg.delivery.message_expiration_timeout,
        message_id=message_id, submit_time=rfc5322_date(now), subject=subject, author=author,
        origin="dsn", smtputf8=utf8, body_type="8BITMIME" if utf8 else "",
        dsn_of=original.get("id"),
    )


def send_owed_notices(conn: Connection, cfg: Any, message_ids: Iterable[int],
                      now: float) -> list[tuple[dict, int, NewMessage]]:
    """The success notices owed for recipients of our queued primary messages ``message_ids``
    (promoted copies, or messages whose fork was resubmitted) that another node delivered
    (``NOTICE_OWED``; not those of a fork still held: its peer sends them): one DSN a message,
    queued, the recipients then plainly delivered, and a message left with nothing pending
    finished. Returns (original row, DSN id, DSN) of each DSN queued, for the DSN tracking rows."""
    out: list[tuple[dict, int, NewMessage]] = []
    for mid in dict.fromkeys(message_ids):
        row = mq.message_row(conn, mid)
        if row is None or row["role"] != "primary" or row["state"] != mq.QUEUED:
            continue
        forked = select(shadow_forks.c.queue_id).where(shadow_forks.c.message_id == mid)
        owed = conn.execute(select(recipients.c.id, recipients.c.address, recipients.c.last_error,
                                   recipients.c.dsn_params).where(
            recipients.c.message_id == mid, recipients.c.status == mq.DELIVERED,
            notice_owed_on(recipients.c.last_error), recipients.c.queue_id.not_in(forked))).all()
        if not owed:
            continue
        body = mq.body(conn, mid)
        reports = [RecipientReport(address=r.address, action=owed_action(r.last_error) or "relayed", status="2.0.0",
                                   original_recipient=dsnparams.orcpt_of(r.dsn_params or ""))
                   for r in owed]
        dsn = dsn_message(cfg, row, body, reports, now) if body is not None else None
        if dsn is not None:
            out.append((row, mq.enqueue(conn, dsn), dsn))
        conn.execute(update(recipients).where(recipients.c.id.in_([r.id for r in owed]))
                     .values(last_error=None))
        mq.finish_if_done(conn, mid, now, cfg.safety_net.safety_net_hold_time)
    return out


def dsn_tracking(original: dict, dsn_id: int, dsn: NewMessage) -> tuple[dict, dict[str, Any]]:
    """The DSN tracking row of a DSN queued about ``original``: the row and the fields (recipients,
    reference, source context) a ``track("DSN", "DSN", ...)`` call takes."""
    row = {"id": dsn_id, "network_message_id": dsn.network_message_id, "message_id": dsn.message_id, "sender": "",
           "author": dsn.author, "subject": dsn.subject, "size": len(dsn.data)}
    return row, {"recipients": [a for v in dsn.recipients.values() for a in v],
                 "reference": original.get("message_id") or "",
                 "source_context": f"original internal id {original.get('id')}; "
                                   f"network id {original.get('network_message_id')}"}
