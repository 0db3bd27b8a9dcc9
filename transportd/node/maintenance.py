"""Queue maintenance on a clock: expiry, delay DSNs, the Safety Net purge, idle queues, orphaned transient states.

It owns the work nobody asks for: failing recipients older than
*MessageExpirationTimeout* (FAIL from ROUTING, a DSN with 4.4.7), one delay DSN
per message waiting longer than *DelayNotificationTimeout*, dropping what left
the Safety Net and the duplicate-detection window, removing delivery queues
empty and idle for *QueueMaxIdleTime* (mail makes them again), removing tracking-log files
past their retention (*MessageTrackingLogMaxAge*, *MessageTrackingLogMaxDirectorySize*),
and making recipients left Active (or messages left pending) by a failed commit
deliverable again. Each runs at its own pace; one message's failure never stops
the others. It never talks SMTP.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import Any

from transportd import faults
from transportd.node.events import NodeEvents
from transportd.node.outcomes import (
    Delivered,
    OutcomeRecorder,
    dsn_message,
    internal_failure,
    status_of,
    utc,
)
from transportd.queue import messages as mq
from transportd.queue.delivered import DeliveredLog
from transportd.queue.messages import Outcome, WorkItem
from transportd.queue.store import QueueStore
from transportd.smtp import dsnparams
from transportd.smtp.dsn import RecipientReport

log = logging.getLogger("transportd.node.maintenance")

# Safety Net batches purged per housekeeping round at most (a round every 10 poll intervals, at
# most 10 s): up to 50,000 copies a round, far above what a node delivers meanwhile.
PURGE_ROUNDS = 50
EXPIRED_REPLY = "550 4.4.7 QUEUE.Expired; message expired"


class Maintenance:
    def __init__(self, cfg: Any, store: QueueStore, events: NodeEvents, recorder: OutcomeRecorder,
                 delivered: DeliveredLog | None = None):
        self.cfg = cfg
        self.delivered = delivered  # DeliveredTo beside the mailboxes: purged past the window here
        self.store = store
        self.events = events
        self.recorder = recorder
        self._last_expiry = 0.0
        self._last_housekeeping = 0.0

    async def due(self, now: float, in_flight: set[int]) -> None:
        """Run what is due: expiry and the tracking rows a full disk kept every second, the rest
        every ten poll intervals (at most 10 s)."""
        if now - self._last_expiry >= 1.0:
            self._last_expiry = now
            self.events.write_kept_tracking_rows()
            await self.expire(now)
        if now - self._last_housekeeping >= min(10.0, self.cfg.delivery.queue_poll_interval * 10):
            self._last_housekeeping = now
            await self.housekeeping(now)
            await self.release_orphans(now, in_flight)
            if self.cfg.delivery.delay_notification_timeout > 0:
                await self.notify_delays(now)  # a scan of the queued messages: at this slower pace

    async def expire(self, now: float) -> None:
        expired = await self.store.aread(lambda c: mq.expired_recipients(c, now))
        by_msg: dict[int, list[dict]] = defaultdict(list)
        for r in expired:
            by_msg[r["message_id"]].append(r)
        for mid, rcpts in by_msg.items():
            # Claimed (Active) so record_outcomes applies uniformly, then failed with a DSN.
            ids = [r["id"] for r in rcpts]
            claimed = set(await self.store.write(lambda c, ids=ids: mq.mark_active(c, ids, now)))
            rcpts = [r for r in rcpts if r["id"] in claimed]
            if not rcpts:
                continue
            item = WorkItem(queue_id=0, queue_identity="expiry", delivery_type="Expiry", next_hop="",
                            message_id=mid, recipient_ids=[r["id"] for r in rcpts],
                            addresses=[r["address"] for r in rcpts], dsn_params=[r["dsn_params"] for r in rcpts])
            outs = [Outcome(r["id"], mq.FAILED, EXPIRED_REPLY + (f" (last error: {r['last_error']})"
                                                                 if r["last_error"] else "")) for r in rcpts]
            try:
                row = await self.store.aread(lambda c, m=mid: mq.message_row(c, m))
                faults.check("expire", {"id": mid, **(row or {})})
                await self.recorder.commit(Delivered([item], {mid: outs}, expiry=True), now)
            except Exception as exc:  # noqa: BLE001 - one message never holds up the others
                await self.recorder.commit_safely(internal_failure([item], "expire", exc), item)

    async def notify_delays(self, now: float) -> None:
        """One delay DSN (RFC 3464, action delayed) per message waiting longer than
        *DelayNotificationTimeout*; one message's failure never stops the others."""
        timeout = self.cfg.delivery.delay_notification_timeout
        due = await self.store.aread(lambda c: mq.delayed_messages(c, now, timeout))
        for m in due:
            try:
                body = await self.store.aread(lambda c, mid=m["id"]: mq.body(c, mid))
                if body is None:
                    continue
                with self.events.handling.step(m["id"], "dsn"):  # a content step a message could crash
                    faults.check("dsn", m)
                    reports = [RecipientReport(address=r["address"], action="delayed",
                                               status=status_of(r["last_error"] or "451 4.4.1"),
                                               diagnostic=r["last_error"] or "",
                                               original_recipient=dsnparams.orcpt_of(r["dsn_params"]),
                                               last_attempt=utc(r["last_attempt_at"]),
                                               will_retry_until=utc(m["expires_at"]))
                               for r in m["waiting"] if dsnparams.wants(r["dsn_params"], dsnparams.DELAY)]
                    dsn = dsn_message(self.cfg, m, body, reports, now)
                dsn_id = await self.store.write(lambda c, mid=m["id"], dsn=dsn: mq.record_delay_dsn(c, mid, dsn, now),
                                                queue_changed=dsn is not None)
            except Exception as exc:  # noqa: BLE001 - isolated per message
                await self.events.message_failed(m, "dsn", exc)
                continue
            if dsn_id is not None:
                self.events.log_dsn(m, dsn_id, dsn)

    async def release_orphans(self, now: float, in_flight: set[int]) -> None:
        """Recipients left Active whose owner in this process is gone (a commit that failed), and
        messages left ``pending`` by an older version (which committed a message before its shadow
        outcome): made deliverable again without a restart."""
        copy_timeout = self.cfg.shadow_redundancy.shadow_copy_timeout
        try:
            n_active, n_pending = await self.store.write(lambda c: mq.release_orphans(
                c, now, active_owned=set(in_flight), pending_owned=set(), active_grace=1.0,
                pending_grace=copy_timeout + 5.0))
        except Exception as exc:  # noqa: BLE001 - tried again at the next housekeeping
            log.error("releasing orphaned transient states failed: %s", exc)
            return
        if n_active or n_pending:
            log.warning("%d recipient(s) left Active and %d message(s) left pending by a failed commit are "
                        "deliverable again", n_active, n_pending)
            self.store.queue_changed.set()

    async def housekeeping(self, now: float) -> None:
        await asyncio.to_thread(self.events.apply_tracking_retention, now)
        window = self.cfg.mailbox.duplicate_detection_window
        n_msgs, n_dup = await self.store.write(lambda c: mq.purge_expired(c, now, window))
        # Batch after batch while full ones come back (bounded per round): one batch a round let
        # copies outstay SafetyNetHoldTime and pile up wherever more than a batch a round (100-200
        # messages a second at the default poll interval) left the queue.
        batch, rounds = n_msgs, 1
        while batch >= mq.PURGE_BATCH and rounds < PURGE_ROUNDS:
            batch, _ = await self.store.write(lambda c: mq.purge_expired(c, now, window))
            n_msgs, rounds = n_msgs + batch, rounds + 1
        if self.delivered is not None:
            try:
                n_dup += await asyncio.to_thread(self.delivered.purge, now, window)
            except OSError as exc:  # tried again at the next housekeeping
                log.error("purging DeliveredTo records failed: %s", exc)
        if n_msgs or n_dup:
            log.info("housekeeping: %d message(s) left the Safety Net, %d DeliveredTo entries expired",
                     n_msgs, n_dup)
        # After the purge: the queues its messages were the last of go in the same round.
        idle = self.cfg.delivery.queue_max_idle_time
        removed = await self.store.write(lambda c: mq.remove_idle_queues(c, now, idle))
        if removed:
            log.info("housekeeping: %d empty delivery queue(s) idle for %gs removed (made again when mail for "
                     "their next hop comes): %s", len(removed), idle, ", ".join(removed[:10])
                     + (f" and {len(removed) - 10} more" if len(removed) > 10 else ""))
