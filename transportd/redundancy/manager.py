"""The Shadow Redundancy Manager: a shadow copy before every acknowledgement, and redundancy regained.

It owns the primary side's policy: which peer gets a message's shadow copy
(*ShadowMessagePreferenceSetting*, retry counts, a fair share of
*shadow_copy_timeout* per peer), making copies redundant again after a
promotion or a peer's lost queue database (``reshadowing``, a few at a time),
retrying messages accepted without a shadow every heartbeat round, and the
discard events handed to shadows over the transport connector. It composes the
shadow side (shadow_queue.py) and the heartbeat (heartbeat.py) and runs their
loop. It holds no SQL (queue/shadows.py) and no socket code (peers.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiosmtplib

from transportd import faults
from transportd.errors import PEER_FAILURES
from transportd.queue import messages as mq
from transportd.queue import shadows as sq
from transportd.queue.messages import NewMessage
from transportd.queue.store import QueueStore
from transportd.redundancy.events import EventSink
from transportd.redundancy.heartbeat import Heartbeat
from transportd.redundancy.peers import PeerPool, PeerSession
from transportd.redundancy.protocol import Peer, heartbeat_period, shadow_attempts
from transportd.redundancy.shadow_queue import ShadowQueues
from transportd.smtp.envelope import message_parameters

log = logging.getLogger("transportd.redundancy.manager")

# Copies made redundant again at once after a promotion, a peer's lost database or a failed
# shadow (each on its own peer session): one at a time left a window a second failure could hit.
RESHADOW_CONCURRENCY = 8
# Unprotected messages retried per heartbeat round.
REPROTECT_BATCH = 64


@dataclass
class ShadowResult:
    peer: str | None
    reply: str  # the peer's DATA reply, or the reasons no shadow could be made
    # Peers that may hold a copy although we do not count it (the session broke after DATA):
    # they get a discard event for the GUID, so no copy is left behind forever.
    uncertain: tuple[str, ...] = ()


class ShadowManager:
    def __init__(self, cfg: Any, store: QueueStore, events: EventSink):
        self.cfg = cfg
        self.sr = cfg.shadow_redundancy
        self.store = store
        self.events = events
        self.peers = [Peer(p.name, p.site, p.transport) for p in cfg.peers]
        self.by_name = {p.name: p for p in self.peers}
        self.pool = PeerPool(cfg, self.peers)
        self.shadow_queues = ShadowQueues(cfg, store, events, self._reshadow_in_background)
        self.heartbeat = Heartbeat(cfg, store, events, self.pool, self.shadow_queues, self._spawn, self.reprotect)
        self.accepting = True
        self._rotate = 0
        self._background: set[asyncio.Task] = set()
        self._reshadow_slots = asyncio.Semaphore(RESHADOW_CONCURRENCY)
        self._sweep: asyncio.Task | None = None
        # Tokens of the transport sessions open now: a discard id handed out on any other token
        # belongs to a session gone without settling it, and is handed out again (housekeeping).
        self.live_discard_tokens: set[str] = set()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.rounds = 0  # heartbeat rounds completed (an observable for tests and metrics)

    @property
    def node_name(self) -> str:
        return self.cfg.node.name.lower()

    @property
    def queue_database_id(self) -> str:
        return self.store.queue_database_id

    @property
    def enabled(self) -> bool:
        return bool(self.sr.shadow_redundancy_enabled and self.peers)

    def start(self) -> None:
        if self.peers:
            self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        self._stopping = True
        self.accepting = False
        tasks = [t for t in (self._task, *self._background) if t is not None]
        for t in tasks:
            t.cancel()  # a copy left "reshadowing" is retried after the restart (recover_after_restart)
        await asyncio.gather(*tasks, return_exceptions=True)
        self.pool.close()

    def _spawn(self, coro: Any, what: str) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._background.add(task)  # held: the loop keeps only a weak reference to tasks
        task.add_done_callback(self._background.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or log.error(
            "%s failed: %r", what, t.exception()))
        return task

    async def _loop(self) -> None:
        freq = heartbeat_period(self.sr)
        loop = asyncio.get_running_loop()
        next_round = loop.time() + freq
        while not self._stopping:
            # Rounds start every ``freq`` whatever the last one took (no drift past the span).
            await asyncio.sleep(max(0.0, next_round - loop.time()))
            next_round = max(next_round + freq, loop.time())
            try:
                await self.shadow_queues.housekeeping(time.time(), set(self.live_discard_tokens))
                if self._sweep is None or self._sweep.done():
                    self._sweep = self._spawn(self.protect_unprotected(), "making unprotected messages redundant")
                await self.heartbeat.round()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop must survive
                log.exception("shadow heartbeat round failed")
            self.rounds += 1

    # ================================================================== shadow copies

    def attempts(self) -> list[Peer]:
        self._rotate += 1
        return shadow_attempts(self.peers, self.cfg.node.site, self.sr.shadow_message_preference_setting,
                               self.sr.max_retries_for_remote_site_shadow,
                               self.sr.max_retries_for_local_site_shadow, rotate=self._rotate)

    async def make_shadow(self, msg: NewMessage, guid: str, recipients: list[str],
                          exclude: str | None = None) -> ShadowResult:
        """Copy ``msg`` to a peer before the sender gets its 250; tries peers as configured."""
        faults.check("shadow", msg)
        # The copy travels as the message came: SMTPUTF8 and BODY=8BITMIME when it needs them.
        params = message_parameters(msg.sender, recipients, msg.data, smtputf8=msg.smtputf8,
                                    body_type=msg.body_type)
        candidates = [p for p in self.attempts() if p.name != exclude and self.pool.takes_shadows(p)]
        if not candidates:
            return ShadowResult(None, "No suitable shadow servers")
        reasons: list[str] = []
        uncertain: list[str] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.sr.shadow_copy_timeout
        timed_out: set[str] = set()
        for i, peer in enumerate(candidates):
            if peer.name in timed_out:
                continue  # a peer that hung once (partitioned, paused) would eat the others' time
            remaining = deadline - loop.time()
            if remaining <= 0:
                reasons.append(f"no shadow within shadow_copy_timeout ({self.sr.shadow_copy_timeout:g}s)")
                break
            # Each distinct peer still to try gets a fair share of what is left, so one silent peer
            # cannot leave a healthy one untried.
            left = len({p.name for p in candidates[i:] if p.name not in timed_out})
            accepted, reply = await self._copy_to(peer, msg, guid, recipients, params, remaining / max(1, left),
                                                  timed_out, uncertain)
            if accepted:
                return ShadowResult(peer.name, reply, tuple(u for u in uncertain if u != peer.name))
            reasons.append(f"{peer.name}: {reply}")
        return ShadowResult(None, "; ".join(dict.fromkeys(reasons)) or "No suitable shadow servers",
                            tuple(uncertain))

    async def _copy_to(self, peer: Peer, msg: NewMessage, guid: str, recipients: list[str], params: list[str],
                       limit: float, timed_out: set[str], uncertain: list[str]) -> tuple[bool, str]:
        """One attempt on one peer: (whether it holds the copy, its reply or why not)."""
        s: PeerSession | None = None
        ok = False
        try:
            async with asyncio.timeout(limit):
                s = await self.pool.session(peer)
                await s.shadow_request(self.queue_database_id)
                result = await s.copy(msg.sender, params, recipients, msg.data, guid)
                ok = True  # the session is fine, whatever the peer answered
                if result.held and peer.name not in uncertain:
                    uncertain.append(peer.name)  # refused, yet stored: it gets a discard event
                return result.accepted, result.reply
        except aiosmtplib.SMTPResponseException as exc:
            if s is not None:
                try:
                    await s.client.rset()
                    ok = True  # the session itself is fine
                except Exception:  # noqa: BLE001
                    ok = False
            return False, f"{exc.code} {exc.message}"
        except PEER_FAILURES as exc:
            if isinstance(exc, (asyncio.TimeoutError, aiosmtplib.SMTPTimeoutError)):
                timed_out.add(peer.name)
            if s is not None and s.data_sent and peer.name not in uncertain:
                uncertain.append(peer.name)  # it may hold a copy we do not count
            return False, str(exc) or exc.__class__.__name__
        finally:
            if s is not None:
                self.pool.release(s, ok)

    async def take_discard_events(self, shadow_node: str, n: int, token: str) -> list[tuple[str, str | None]]:
        """Up to ``n`` discard ids for a shadow, marked as handed out on session ``token``: deleted
        when that session ends with QUIT (the shadow applied them first), handed out again if it
        breaks. A discard is never lost to a dropped connection."""
        return await self.store.write(lambda c: sq.take_discard_events(c, shadow_node, n, token))

    async def settle_discard_events(self, token: str, acknowledged: bool) -> None:
        await self.store.write(lambda c: sq.settle_discard_events(c, token, acknowledged))

    # ================================================================== redundancy regained

    async def reprotect(self, peer: str) -> int:
        """``peer`` came back with a new queue database: our queued messages shadowed there have lost
        their shadow. One transaction forgets the lost copies and marks the messages
        ``reshadowing`` (visible to ``message list`` and the metrics); new copies are made concurrently."""
        rows = await self.store.write(lambda c: sq.claim_lost_shadows(c, peer))
        made = await self._reshadow_all(rows, exclude=None)
        if rows:
            log.warning("%s has a new queue database: made %d of %d lost shadow(s) of our messages again",
                        peer, made, len(rows))
        return len(rows)

    async def protect_unprotected(self) -> int:
        """Retry a shadow for queued messages accepted (or left) without one, a batch per heartbeat
        round: a peer that was down or cut off when they arrived may be back."""
        if not self.enabled:
            return 0
        rows = await self.store.write(lambda c: sq.claim_unprotected(c, REPROTECT_BATCH))
        made = await self._reshadow_all(rows, exclude=None, track_failure=False)  # tracked when accepted
        if made:
            log.info("made %d unprotected message(s) redundant", made)
        return made

    def _reshadow_in_background(self, rows: list[dict], exclude: str) -> None:
        self._spawn(self._reshadow_all(rows, exclude=exclude), f"making the promoted copies of {exclude} redundant")

    async def _reshadow_all(self, rows: list[dict], exclude: str | None, track_failure: bool = True) -> int:
        """Make each copy redundant again, RESHADOW_CONCURRENCY at a time (never a coroutine per
        message: a promotion may hold tens of thousands); returns how many got a shadow. A copy
        whose handling fails is left unprotected (retried every heartbeat round) and counted
        towards the Poison queue; the others go on."""
        made = 0
        for i in range(0, len(rows), RESHADOW_CONCURRENCY):
            done = await asyncio.gather(*(self._reshadow_isolated(r, exclude, track_failure)
                                          for r in rows[i:i + RESHADOW_CONCURRENCY]))
            made += sum(done)
        return made

    async def _reshadow_isolated(self, row: dict, exclude: str | None, track_failure: bool) -> bool:
        try:
            return await self._reshadow(row, exclude, track_failure)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - one message never holds up the others
            try:
                await self.store.write(lambda c: sq.mark_unprotected(c, row["id"]))
            except Exception as err:  # noqa: BLE001 - a restart makes "reshadowing" unprotected too
                log.error("could not mark message %s unprotected: %s", row["id"], err)
            await self.events.message_failed(row, "reshadow", exc)
            return False

    async def _reshadow(self, row: dict, exclude: str | None, track_failure: bool = True) -> bool:
        """Make a promoted or unprotected copy redundant again on another peer (or mark it
        unprotected: the heartbeat loop retries it). Delivery may finish the message meanwhile."""
        async with self._reshadow_slots:
            faults.check("reshadow", row)
            now = time.time()
            mid = row["id"]
            body, addrs = await self.store.aread(lambda c: sq.reshadow_inputs(c, mid))
            result = ShadowResult(None, "No suitable shadow servers")
            guid = str(uuid.uuid4())
            if self.enabled and body is not None and addrs:
                msg = NewMessage(network_message_id=row["network_message_id"], sender=row["sender"], data=body,
                                 recipients={}, received_at=now, expires_at=now, subject=row.get("subject") or "",
                                 smtputf8=bool(row.get("smtputf8")), body_type=row.get("body_type") or "")
                result = await self.make_shadow(msg, guid, addrs, exclude=exclude)
            state = await self.store.write(lambda c: sq.settle_reshadow(
                c, mid, result.peer, guid, result.uncertain, bool(addrs), now))
            if not addrs:
                return False
            if result.peer:
                self.events.track("HAREDIRECT", "SMTP", row, recipients=addrs,
                                  source_context=f"{result.peer}={result.reply}")
            elif state == mq.QUEUED and track_failure:
                self.events.track("HAREDIRECTFAIL", "SMTP", row, recipients=addrs, source_context=result.reply)
            return bool(result.peer)
