"""The shadow queues: copies we hold for primaries, their discard, promotion and Safety Net resubmit.

It owns what happens to a shadow copy here: stored when a primary sends it
(HARECEIVE), moved to the Shadow Safety Net when the primary discards it
(HADISCARD), promoted to a primary copy of ours when the primary is lost
(HADISCARD Resubmitted and RESUBMIT, in pages, delivered at once; with several
shadows per message only up to the rank the heartbeat allows), adopted by the
shadow of a lower rank that promoted it (XSHADOWADOPT), and resubmitted from the
Shadow Safety Net for a primary's resubmit request. Every query goes through
queue/shadows.py; it never talks to a peer (redundancy/heartbeat.py does) and
never schedules delivery itself: its commits set the store's queue-changed event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from transportd import faults
from transportd.queue import messages as mq
from transportd.queue import notices, safetynet
from transportd.queue import shadows as sq
from transportd.queue.messages import NewMessage
from transportd.queue.routing import bifurcate
from transportd.queue.store import QueueStore
from transportd.redundancy.events import EventSink
from transportd.redundancy.protocol import DELAY_NOTIFIED, FAILED, NOTICE_ACTIONS, recipient_done
from transportd.smtp.frontend import new_network_message_id, received_as
from transportd.smtp.headers import header_fields, network_id_from

log = logging.getLogger("transportd.redundancy.shadow_queue")

# Shadows promoted per commit (and tracked before the loop runs anything else).
PROMOTE_PAGE = 500
# What re-shadowing a promoted copy needs of its row (and its tracking rows show).
RESHADOW_FIELDS = ("id", "network_message_id", "message_id", "sender", "author", "subject", "size", "smtputf8", "body_type",
                   "shadow_guid", "shadow_rank")


class ShadowQueues:
    """The shadow side of shadow redundancy, over the queue database."""

    def __init__(self, cfg: Any, store: QueueStore, events: EventSink,
                 reshadow: Callable[[list[dict], str], None]):
        self.cfg = cfg
        self.store = store
        self.events = events
        self._reshadow = reshadow  # starts, in the background, new shadows of promoted copies

    async def store_shadow(self, envelope: Any, session: Any, request: Any, guid: str,
                           rank: int = 1) -> tuple[int, str]:
        """Keep a shadow copy for ``request.primary_fqdn`` durably; returns (internal id, Message-ID)."""
        now = time.time()
        data = envelope.original_content or b""
        message_id, submit_time, subject, author = header_fields(data)
        smtputf8, body_type = received_as(envelope)
        network_id = network_id_from(data) or new_network_message_id()
        msg = NewMessage(
            network_message_id=network_id, data=data,
            sender="" if envelope.mail_from in (None, "<>") else envelope.mail_from,
            recipients=bifurcate(envelope.rcpt_tos, self.cfg), received_at=now,
            expires_at=now + self.cfg.delivery.message_expiration_timeout,
            message_id=message_id, submit_time=submit_time,
            subject=subject, author=author, client_ip=str((session.peer or ("",))[0]),
            client_hostname=request.primary_fqdn, origin="shadow", role="shadow", redundancy="shadow",
            shadow_guid=guid, primary_node=request.primary_fqdn, primary_dbid=request.primary_dbid,
            shadow_rank=rank, smtputf8=smtputf8, body_type=body_type,
            dsn_mail=getattr(envelope, "dsn_mail", ""), dsn_rcpt=getattr(envelope, "dsn_rcpt", {}),
        )
        internal_id = await self.store.write(lambda c: mq.enqueue(c, msg))
        row = {"id": internal_id, "network_message_id": network_id, "message_id": msg.message_id,
               "sender": msg.sender, "author": author, "subject": msg.subject, "size": len(data)}
        self.events.track("HARECEIVE", "SMTP", row, recipients=list(envelope.rcpt_tos), source_context=guid,
                          client_hostname=request.primary_fqdn, client_ip=msg.client_ip)
        return internal_id, msg.message_id

    async def discard(self, primary: str, entries: list[tuple[str, str | None]], now: float) -> int:
        """Apply discard ids of ``primary``: processed copies go to the Shadow Safety Net; copies an
        operator removed there (reason DeletedByAdmin) are removed here too (never resubmitted).
        Shielded: a caller cancelled while the commit is under way (a time limit, a stop) does not
        leave copies discarded with no HADISCARD row."""
        return await asyncio.shield(self._discard(primary, entries, now))

    async def _discard(self, primary: str, entries: list[tuple[str, str | None]], now: float) -> int:
        hold = self.cfg.safety_net.safety_net_hold_time
        # Per-recipient entries (a recipient the primary delivered, or failed, while others wait;
        # or delivered with its success notice still owed there) narrow what a promotion delivers;
        # a copy they leave with nothing to deliver nor notice to send is discarded as processed.
        # Applied in their order, a run of one kind at a time (a notice owed, then its end).
        runs: list[tuple[str, str | None, list[tuple[str, str]]]] = []
        whole = []
        # The primary sent these messages' delay notice: noted on our copies (and forks), kept.
        delayed = [g for g, r in entries if r == DELAY_NOTIFIED]
        if delayed:
            await self.store.write(lambda c: sq.apply_delay_notified(c, primary, delayed, now))
        for guid, reason in entries:
            told = recipient_done(reason)
            if reason == DELAY_NOTIFIED:
                continue
            if told is None:
                whole.append((guid, reason))
                continue
            kind = (mq.FAILED, None) if told[0] == FAILED else (mq.DELIVERED, NOTICE_ACTIONS.get(told[0]))
            if not runs or runs[-1][:2] != kind:
                runs.append((*kind, []))
            runs[-1][2].append((guid, told[1]))
        entries = whole
        released: list[tuple[dict, str]] = []
        if runs:
            def apply(c):
                emptied = []
                for status, notice, pairs in runs:
                    # Our hop-by-hop forks of its messages learn them too (docs/PROTOCOL.md section 3).
                    sq.apply_fork_recipients(c, primary, pairs, now, status, notice)
                    emptied += sq.apply_delivered_recipients(c, primary, pairs, now, status, notice)
                # A fork whose every recipient they now cover is released, as by the discard.
                forks = sq.release_covered_forks(c, primary, [g for _, _, p in runs for g, _ in p], now, hold)
                return emptied, forks
            emptied, released = await self.store.write(apply)
            log.debug("%d recipient(s) of shadows of %s delivered by it, %d failed by it",
                      sum(len(p) for st, _, p in runs if st == mq.DELIVERED), primary,
                      sum(len(p) for st, _, p in runs if st == mq.FAILED))
            entries += [(g, None) for g in dict.fromkeys(emptied) if g not in {e[0] for e in entries}]
        for row, guid in released:
            self.events.track("HADISCARD", "SMTP", row, source_context=f"ExplicitlyDiscarded;{guid}",
                              client_hostname=primary)
        if not entries:
            return len(released)
        reasons = {g: r for g, r in entries}
        rows, failed = await self.store.write(lambda c: sq.apply_discards(c, primary, reasons, now, hold))
        for r in rows:
            why = reasons.get(r["shadow_guid"]) or "ExplicitlyDiscarded"
            self.events.track("HADISCARD", "SMTP", r, source_context=f"{why};{r['shadow_guid']}",
                              client_hostname=primary)
        for r, exc in failed:
            await self.events.message_failed(r, "discard", exc)
        forks = await self.store.write(lambda c: sq.release_forks(c, primary, list(reasons), now, hold))
        for row, guid in forks:
            self.events.track("HADISCARD", "SMTP", row,
                              source_context=f"{reasons.get(guid) or 'ExplicitlyDiscarded'};{guid}",
                              client_hostname=primary)
        return len(rows) + len(forks) + len(released)

    async def adopt(self, old_primary: str, new_primary: str, new_dbid: str | None, rank: int,
                    guids: list[str]) -> list[tuple[str, int]]:
        """XSHADOWADOPT from ``new_primary``: it promoted these shadows of ``old_primary`` (its copies
        had ``rank``); the copies we hold of them become its shadows, ``rank`` closer to ownership.
        Returns (GUID, new rank) of each copy adopted."""
        rows = await self.store.write(lambda c: sq.adopt_shadows(c, old_primary, new_primary, new_dbid, rank,
                                                                 guids))
        for r in rows:
            self.events.track("HARECEIVE", "SMTP", r, source_context=f"{r['shadow_guid']};AdoptedFrom={old_primary}",
                              client_hostname=new_primary)
        if rows:
            log.info("%s promoted %d message(s) of %s we hold shadows of: they are its shadows now",
                     new_primary, len(rows), old_primary)
        return [(r["shadow_guid"], r["shadow_rank"]) for r in rows]

    async def promote(self, primary: str, reason: str, keep_dbid: str | None = None,
                      max_rank: int | None = None, guids: list[str] | None = None) -> int:
        """Make the shadows of ``primary`` primary messages of ours and deliver them.

        ``keep_dbid`` (a state change): shadows made from that queue database, i.e. after the
        primary came back with it, are current and stay shadows; only older ones are promoted.
        The promoted copies are delivered at once (the promotion is the failover) while, in the
        background, each gets a new shadow on another peer (``reshadowing`` until it has one).
        Our hop-by-hop forks of messages ``primary`` took are resubmitted first, their recipients
        routed again (``sq.requeue_forks``): mail drained to ``primary`` leaves by its own next hop.
        ``guids``: only those shadows and forks (the live primary does not know them: XQSTATUS).
        """
        total, promoted_all = 0, []
        # The success notices a lost primary owed for recipients it delivered (NotifyDelivered=,
        # NotifyRelayed=) are sent from here, each in the commit that promotes its copy.
        owed: list[tuple[dict, int, NewMessage]] = []
        batch = await self.store.write(lambda c: sq.requeue_forks(c, primary, keep_dbid, self.cfg, time.time(),
                                                                  owed, guids), queue_changed=True)
        while True:
            # One page at a time (bounded memory, a short commit each), the loop free in between.
            # Tracked before delivery can take them: the scheduler runs only between awaits.
            promoted = await self.store.write(lambda c: self._promote_page(c, primary, keep_dbid, max_rank, owed,
                                                                           guids))
            rows, batch = batch + promoted, []
            failed: list[tuple[dict, Exception]] = []
            for r in rows:
                try:
                    faults.check("promote", r)
                    # The shadow copy is resubmitted: discarded as a shadow (Exchange's context
                    # Resubmitted), then resubmitted as a primary copy whose reference is the
                    # internal id of the copy it was made from (docs/TRACKING_LOG.md).
                    self.events.track("HADISCARD", "SMTP", r, source_context=f"Resubmitted;{r['shadow_guid']}",
                                      client_hostname=primary)
                    # It names the recipients the promoted copy takes (the primary may have told us
                    # it processed the others): the analytics job reads them as this copy's take.
                    self.events.track("RESUBMIT", "REDUNDANCY", r, recipients=r.get("waiting_recipients"),
                                      source_context=f"{primary} ({reason})", reference=str(r["id"]))
                except Exception as exc:  # noqa: BLE001 - promoted all the same; counted, the others go on
                    failed.append((r, exc))
            for r, exc in failed:
                await self.events.message_failed(r, "promote", exc)
            for original, dsn_id, dsn in owed:
                row, fields = notices.dsn_tracking(original, dsn_id, dsn)
                self.events.track("DSN", "DSN", row, **fields)
            owed.clear()
            total += len(rows)
            promoted_all.extend({k: r[k] for k in RESHADOW_FIELDS} for r in promoted)  # a slim copy each
            if rows:
                self.store.queue_changed.set()
            if len(promoted) < PROMOTE_PAGE:
                break
            await asyncio.sleep(0)
        if total:
            self.events.metrics.promotions.labels(primary, reason).inc(total)
            log.warning("promoted %d shadow(s) of %s (%s)", total, primary, reason)
        if promoted_all:
            self._reshadow(promoted_all, primary)  # delivery does not wait for the new shadows
        return total

    def _promote_page(self, conn: Any, primary: str, keep_dbid: str | None, max_rank: int | None,
                      owed: list[tuple[dict, int, NewMessage]], guids: list[str] | None) -> list[dict]:
        """One page of promoted copies (``sq.promote_page``), with the success notices ``primary``
        owed for recipients of theirs it delivered queued here (appended to ``owed``)."""
        rows = sq.promote_page(conn, primary, keep_dbid, PROMOTE_PAGE, max_rank, guids)
        owed.extend(notices.send_owed_notices(conn, self.cfg, [r["id"] for r in rows], time.time()))
        # The recipients each promoted copy takes: those the primary did not tell us it processed.
        waiting = mq.waiting_recipients(conn, [r["id"] for r in rows])
        for r in rows:
            r["waiting_recipients"] = waiting[r["id"]]
        return rows

    async def resubmit_for(self, primary: str, destination: str, start: float, end: float) -> int:
        """A peer's resubmit request (``primary`` asks, or asked and has been unreachable too long):
        our Shadow Safety Net copies of ``primary`` and our Primary Safety Net copies for the
        destination and window. The latter include the mail we handed ``primary`` hop by hop (it
        took it as primary; our copy is the only other one once its queue database is lost), as
        Exchange's broadcast asks every Safety Net of the boundary for the database's messages."""
        failures: list = []
        done = await self.store.write(lambda c: safetynet.resubmit(
            c, self.cfg, destination=destination, start=start, end=end, sources=("primary", "shadow"),
            for_primary=primary, failures=failures), queue_changed=True)
        for row, exc in failures:
            await self.events.message_failed(row, "resubmit", exc)
        for r in done:
            self.events.track("RESUBMIT", "SAFETYNET", r.row(), recipients=r.recipients, reference=str(r.original_id),
                              source_context=f"{destination};MessageResubmit")
        log.info("resubmitted %d Safety Net copies for %s at %s's request", len(done), destination, primary)
        return len(done)

    async def resubmit_requested(self, primary: str, now: float) -> int:
        """``primary``'s Primary Safety Net has been unreachable for primary_safety_net_unreachable_time:
        the resubmit requests filed for it here become shadow resubmit requests, served from this
        node's Shadow Safety Net (as Exchange does after 12 hours). Returns how many were served."""
        hold = self.cfg.safety_net.safety_net_hold_time
        pending = await self.store.aread(lambda c: sq.open_resubmit_requests(c, primary))
        for req in pending:
            if req["created_at"] < now - hold:
                result = "expired: the Safety Net no longer holds that window"
            else:
                n = await self.resubmit_for(primary, req["destination"], req["start_at"], req["end_at"])
                result = f"{n} message(s) resubmitted from the Safety Net"
                log.warning("%s unreachable for %s: resubmit request %d for %s served here: %s", primary,
                            self.cfg.safety_net.primary_safety_net_unreachable_time, req["id"],
                            req["destination"], result)
            await self.store.write(lambda c, rid=req["id"], result=result: sq.close_resubmit_request(
                c, rid, now, result))
        return len(pending)

    async def housekeeping(self, now: float, live_tokens: set[str]) -> None:
        """Drop discard events nobody asked for; expire shadows (and hop-by-hop forks) never
        acknowledged."""
        cfg = self.cfg
        expired = await self.store.write(lambda c: sq.shadow_housekeeping(
            c, now, auto_discard=cfg.shadow_redundancy.shadow_message_auto_discard_interval,
            expire_after=cfg.safety_net.safety_net_hold_time + cfg.delivery.message_expiration_timeout,
            hold=cfg.safety_net.safety_net_hold_time, live_tokens=live_tokens))
        for r in expired:
            self.events.track("HADISCARD", "SMTP", r, source_context="Expired")
        if expired:
            # The primary never released them (nor did it say it lost them: XQSTATUS): loud, not
            # an INFO row in the tracking log alone.
            ids = [str(r.get("id")) for r in expired]
            primaries = sorted({r.get("primary_node") or "hop by hop" for r in expired})
            log.warning("%d shadow cop%s expired unacknowledged (no discard from %s within safety_net_hold_time "
                        "+ message_expiration_timeout); ids: %s%s", len(ids), "y" if len(ids) == 1 else "ies",
                        ", ".join(primaries), ", ".join(ids[:100]), " ..." if len(ids) > 100 else "")
