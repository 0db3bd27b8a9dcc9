"""The delivery scheduler: due work from the queue database, fairly, to the connectors.

It owns deciding what is sent now: it wakes on the store's queue-changed event
(or every *queue_poll_interval*), takes due recipients from every queue round
robin within the session limits (*max_outbound_connections*, per next hop,
messages per session), claims them (Active), hands each batch to its connector
and commits what the connector reports through the outcome recorder. It runs
the periodic maintenance (expiry, housekeeping, delay DSNs, orphaned states) at
its own pace. It owns the clean stop of deliveries too: no new work, and a
batch in a transaction (``DeliveryDrain``) gets its grace to finish. It never
talks SMTP and never builds a DSN itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import Any, Callable

from transportd.errors import StoreError
from transportd.node.connectors import DeliveryDrain
from transportd.node.maintenance import Maintenance
from transportd.node.outcomes import OutcomeRecorder, internal_failure
from transportd.queue import messages as mq
from transportd.queue.messages import WorkItem
from transportd.queue.routing import MAILBOX, PEER
from transportd.queue.store import QueueStore

log = logging.getLogger("transportd.node.scheduler")


class Scheduler:
    """Runs in the node's event loop: scheduler tick, one task per session, maintenance."""

    def __init__(self, cfg: Any, store: QueueStore, recorder: OutcomeRecorder, maintenance: Maintenance,
                 connectors: dict[str, Any], on_pass: Callable[[], Any] = lambda: None,
                 drain: DeliveryDrain | None = None):
        self.cfg = cfg
        self.store = store
        self.recorder = recorder
        self.maintenance = maintenance
        self.connectors = connectors  # by delivery type; "smtp" for every other type
        self.in_flight: set[int] = set()  # recipient ids claimed by a running session
        self._sessions_per_queue: dict[int, int] = defaultdict(int)
        self._sessions_total = 0
        self._tasks: set[asyncio.Task] = set()
        self._rotate = 0  # round-robin start over the due queues
        self._stopping = False
        self.drain = drain or DeliveryDrain()  # the SMTP connectors' transactions under way
        self._on_pass = on_pass  # told after every pass (the scheduler_passes counter)
        self._caps: dict[int, tuple[int, float]] = {}  # queue -> (most sessions, until): its next hop's limit

    async def run(self) -> None:
        interval = self.cfg.delivery.queue_poll_interval
        changed = self.store.queue_changed
        failing = 0  # passes the queue database failed in a row (a full disk): said once, not a traceback each
        while not self._stopping:
            try:
                await asyncio.wait_for(changed.wait(), timeout=interval)
            except asyncio.TimeoutError:
                pass
            changed.clear()
            if self._stopping:
                break
            try:
                await self.maintenance.due(time.time(), self.in_flight)
                await self.tick()
            except StoreError as exc:  # the database, not the code: one line, and one when it works again
                failing += 1
                if failing == 1:
                    log.error("delivery scheduler: the queue database failed (%s); trying again every %.1fs",
                              exc, interval)
            except Exception:  # noqa: BLE001 - the loop must survive; the queue is the truth
                log.exception("delivery scheduler tick failed; retrying in %.1fs", interval)
            else:
                if failing:
                    log.warning("delivery scheduler: the queue database works again (%d passes failed)", failing)
                    failing = 0
            self._on_pass()

    async def stop(self) -> None:
        """A clean stop: no new work; every batch is cancelled at once but those in a transaction,
        which may hold a message the next hop already took: these get delivery.stop_grace_time to
        read the reply and commit the outcome (then QUIT). One still waiting then is cut, its
        message left Active for a retry after the restart, as after a crash."""
        self._stopping = self.drain.stopping = True
        self.store.queue_changed.set()
        for t in list(self._tasks):
            if not self.drain.in_transaction(t):
                t.cancel()
        if self._tasks:
            grace = self.cfg.delivery.stop_grace_time
            _, late = await asyncio.wait(set(self._tasks), timeout=grace)
            if late:
                log.warning("%d delivery session(s) still awaiting a reply after the stop's grace (%gs): cut, "
                            "their messages are retried after the restart", len(late), grace)
            for t in late:
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        for connector in self.connectors.values():
            if hasattr(connector, "close"):
                await connector.close()  # sessions kept for a next batch get their QUIT

    async def tick(self) -> None:
        now = time.time()
        d = self.cfg.delivery
        for qid in [q for q, (_, until) in self._caps.items() if now >= until]:
            del self._caps[qid]  # past its time, even for a queue no longer due (or removed since)
        busy = dict(self._sessions_per_queue)
        free_total = max(0, d.max_outbound_connections - self._sessions_total)

        def quota(qid: int) -> int:
            # As many recipients as this queue's free sessions can take: a saturated queue is skipped.
            free = min(self._most_sessions(qid, now) - busy.get(qid, 0), free_total)
            return max(0, free) * d.max_messages_per_connection
        self._rotate += 1
        work = await self.store.aread(lambda c: mq.due_work(c, now, exclude=self.in_flight, quota=quota,
                                                            start=self._rotate))
        by_queue: dict[int, list[WorkItem]] = defaultdict(list)
        for item in work:
            by_queue[item.queue_id].append(item)
        # Every session of this pass first, then one claim for all of them: a pass over many busy
        # queues costs one commit, so a queue late in the round (a local mailbox) waits for none.
        sessions = dict(self._sessions_per_queue)
        total = self._sessions_total
        plan: list[tuple[int, list[WorkItem]]] = []
        for qid, items in by_queue.items():
            while items and sessions.get(qid, 0) < self._most_sessions(qid, now) \
                    and total < d.max_outbound_connections:
                batch, items = items[:d.max_messages_per_connection], items[d.max_messages_per_connection:]
                plan.append((qid, batch))
                sessions[qid] = sessions.get(qid, 0) + 1
                total += 1
        if not plan:
            return
        claimed = await self._claim([it for _, batch in plan for it in batch], now)
        if self._stopping:
            return  # the stop began meanwhile: what was claimed is Ready again at the next start
        kept = {id(it) for it in claimed}  # the items themselves (a message may be in several queues)
        for qid, batch in plan:
            batch = [it for it in batch if id(it) in kept]
            if not batch:
                continue
            self.in_flight.update(r for it in batch for r in it.recipient_ids)
            self._sessions_per_queue[qid] += 1
            self._sessions_total += 1
            task = asyncio.ensure_future(self._run_batch(qid, batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _most_sessions(self, qid: int, now: float) -> int:
        """Sessions a queue may have: max_per_domain_outbound_connections, or fewer for
        transient_failure_retry_interval after its next hop turned one away (``Delivered.concurrency``)."""
        most = self.cfg.delivery.max_per_domain_outbound_connections
        cap = self._caps.get(qid)
        if cap is not None and now >= cap[1]:
            del self._caps[qid]
            cap = None
        return most if cap is None else min(most, cap[0])

    async def _claim(self, batch: list[WorkItem], now: float) -> list[WorkItem]:
        """Mark the batch's recipients Active; keep only those this claim got."""
        ids = [r for it in batch for r in it.recipient_ids]
        claimed = set(await self.store.write(lambda c: mq.mark_active(c, ids, now)))
        for it in batch:
            keep = [(r, a) for r, a in zip(it.recipient_ids, it.addresses) if r in claimed]
            it.recipient_ids = [r for r, _ in keep]
            it.addresses = [a for _, a in keep]
        return [it for it in batch if it.recipient_ids]

    def connector_for(self, delivery_type: str) -> Any:
        if delivery_type in (MAILBOX, PEER):
            return self.connectors[delivery_type]
        return self.connectors["smtp"]

    async def _run_batch(self, qid: int, batch: list[WorkItem]) -> None:
        pending = {it.message_id: it for it in batch}
        try:
            async for report in self.connector_for(batch[0].delivery_type).deliver(batch):
                if report.concurrency:
                    self._caps[qid] = (report.concurrency, time.time() + self.cfg.delivery.transient_failure_retry_interval)
                await self.recorder.commit(report)
                self.drain.outcome_recorded()
                for it in report.items:
                    pending.pop(it.message_id, None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - per-message failures are the connector's; this is the rest
            if isinstance(exc, StoreError):  # the database (a full disk), not the code: one line
                log.error("delivery to queue %s: the outcome could not be recorded: %s", batch[0].queue_identity, exc)
            else:
                log.exception("delivery to queue %s failed unexpectedly", batch[0].queue_identity)
            # Back to Retry (counted per message) so they are not stuck until a restart.
            if pending:
                await self.recorder.commit_safely(internal_failure(list(pending.values()), "deliver", exc), batch[0])
        finally:
            self.drain.outcome_recorded()
            for it in batch:
                self.in_flight.difference_update(it.recipient_ids)
            self._sessions_per_queue[qid] -= 1
            if not self._sessions_per_queue[qid]:  # housekeeping removes idle queues: no entry per queue ever used
                del self._sessions_per_queue[qid]
            self._sessions_total -= 1
            self.store.queue_changed.set()
