"""The Shadow Redundancy Manager: a shadow copy before every acknowledgement, and redundancy regained.

It owns the primary side's policy: which peers get a message's shadow copies
(*ShadowMessagePreferenceSetting*, retry counts, a fair share of
*shadow_copy_timeout* per peer; ``shadow_copies`` of them at once, each with its
rank), making copies redundant again after a promotion (the other shadows of a
promoted message adopted first, XSHADOWADOPT: adoption.py) or a peer's lost queue database
(``reshadowing``, a few at a time),
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
from typing import Any, Iterable

from transportd import faults
from transportd.queue import messages as mq
from transportd.queue import shadows as sq
from transportd.queue.messages import NewMessage
from transportd.queue.store import QueueStore
from transportd.redundancy.adoption import Adoptions
from transportd.redundancy.copies import ShadowCopier, ShadowResult
from transportd.redundancy.events import EventSink
from transportd.redundancy.heartbeat import Heartbeat
from transportd.redundancy.peers import PeerPool
from transportd.redundancy.protocol import (
    DONE,
    HELD,
    MAX_SHADOW_RANK,
    UNKNOWN,
    Peer,
    heartbeat_period,
    shadow_attempts,
)
from transportd.redundancy.shadow_queue import ShadowQueues

log = logging.getLogger("transportd.redundancy.manager")

# Copies made redundant again at once after a promotion, a peer's lost database or a failed
# shadow (each on its own peer session): one at a time left a window a second failure could hit.
RESHADOW_CONCURRENCY = 8
# Unprotected messages retried per heartbeat round.
REPROTECT_BATCH = 64


def _by_prior_redundancy(rows: list[dict]) -> str:
    """The messages given new shadow copies, by what they were (their ``redundancy`` when claimed):
    ``2 message(s) that had fewer than shadow_copies (partial)``, not all called unprotected."""
    partial = sum(r["redundancy"] == mq.PARTIAL for r in rows)
    parts = [(len(rows) - partial, "that had none (unprotected)"),
             (partial, "that had fewer than shadow_copies (partial)")]
    return " and ".join(f"{n} message(s) {what}" for n, what in parts if n)


class ShadowManager:
    def __init__(self, cfg: Any, store: QueueStore, events: EventSink):
        self.cfg = cfg
        self.sr = cfg.shadow_redundancy
        self.store = store
        self.events = events
        self.peers = [Peer(p.name, p.site, p.transport) for p in cfg.peers]
        self.by_name = {p.name: p for p in self.peers}
        # Peers taken out of [[peers]] that still hold shadows of our messages: they may still
        # authenticate for their heartbeats (and nothing else), or they would promote mail we deliver.
        self.former_peers = store.read(sq.shadow_holders) - set(self.by_name) - {self.node_name}
        self.pool = PeerPool(cfg, self.peers)
        self.copier = ShadowCopier(self.sr, self.pool, lambda: self.store.queue_database_id)
        self.adoptions = Adoptions(self.sr, store, self.pool, self.peers, lambda: self.store.queue_database_id)
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
        # Without [[peers]] too while we hold shadows or forks for a primary taken out of them:
        # its heartbeats decide whether they are promoted (never, if nothing polled it).
        if self.peers or self.store.read(sq.primaries_to_poll):
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
                    self._sweep = self._spawn(self._regain(), "making unprotected messages redundant")
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
                          exclude: Iterable[str] = (), copies: int | None = None, first_rank: int = 1) -> ShadowResult:
        """Copy ``msg`` to ``copies`` peers (default shadow_copies) before the sender gets its 250;
        ``exclude`` are peers never tried. The copies themselves are copies.py's."""
        faults.check("shadow", msg)
        excluded = set(exclude)
        candidates = [p for p in self.attempts() if p.name not in excluded and self.pool.takes_shadows(p)]
        result = await self.copier.make(msg, guid, recipients, candidates,
                                        self.sr.shadow_copies if copies is None else copies, first_rank)
        for peer, dbid in result.databases.items():
            self.heartbeat.holder_seen(peer, dbid)  # a peer back with a new database: our older copies there are gone
        return result

    async def take_discard_events(self, shadow_node: str, n: int, token: str, recipients: bool = False,
                                  failed: bool = False, notify: bool = False,
                                  delay: bool = False) -> list[tuple[str, str | None]]:
        """Up to ``n`` discard ids for a shadow, marked as handed out on session ``token``: deleted
        when that session ends with QUIT (the shadow applied them first), handed out again if it
        breaks. A discard is never lost to a dropped connection. ``recipients``: the shadow takes
        per-recipient entries (``XQDISCARD n RCPT``), ``failed``: ``Failed=`` ones too (``RCPT
        FAILED``); another is never handed one. ``notify``: ``NotifyDelivered=``/``NotifyRelayed=``
        ones too (``RCPT FAILED NOTIFY``); another that takes per-recipient entries gets
        ``Delivered=`` for them. ``delay``: ``DelayNotified`` ones too (``RCPT FAILED NOTIFY DELAY``);
        another is never handed one."""
        return await self.store.write(lambda c: sq.take_discard_events(c, shadow_node, n, token, recipients,
                                                                       failed, notify, delay))

    async def shadow_status(self, shadow_node: str, guids: list[str]) -> dict[str, str]:
        """XQSTATUS: per GUID, Done (a discard of the message waits for that shadow), Held (a
        message of ours, in any state) or Unknown (never committed here, or lost with a damaged
        queue database: the shadow promotes its copy)."""
        peers = [p.name for p in self.cfg.peers]
        done, known = await self.store.aread(lambda c: sq.shadow_status(c, shadow_node, guids, peers))
        return {g: DONE if g in done else HELD if g in known else UNKNOWN for g in guids}

    async def settle_discard_events(self, token: str, acknowledged: bool) -> None:
        await self.store.write(lambda c: sq.settle_discard_events(c, token, acknowledged))

    # ================================================================== redundancy regained

    async def reprotect(self, peer: str, dbid: str, seen_at: float | None = None) -> int:
        """``peer`` has the queue database ``dbid`` (new since ``seen_at``, when a change was seen):
        our queued messages shadowed there in another of its databases have lost their shadow
        (``claim_lost_shadows``). One transaction forgets the lost copies and marks the messages
        ``reshadowing`` (visible to ``message list`` and the metrics); new copies are made concurrently."""
        rows = await self.store.write(lambda c: sq.claim_lost_shadows(c, peer, seen_at, time.time(), dbid=dbid))
        made = await self._reshadow_all(rows, exclude=None)
        if rows:
            log.warning("%s has a new queue database: made %d of %d lost shadow(s) of our messages again",
                        peer, len(made), len(rows))
        return len(rows)

    async def _regain(self) -> None:
        """A heartbeat round's background work: the peers that missed an adoption asked again
        (before any new shadow is placed on them), then unprotected messages given a shadow."""
        try:
            await self.adoptions.ask_again()
        finally:
            await self.protect_unprotected()

    async def protect_unprotected(self) -> int:
        """Retry a shadow for queued messages accepted (or left) without one, a batch per heartbeat
        round: a peer that was down or cut off when they arrived may be back."""
        if not self.enabled:
            return 0
        rows = await self.store.write(lambda c: sq.claim_unprotected(c, REPROTECT_BATCH))
        made = await self._reshadow_all(rows, exclude=None, track_failure=False)  # tracked when accepted
        if made:
            log.info("made new shadow copies of %s", _by_prior_redundancy(made))
        return len(made)

    def _reshadow_in_background(self, rows: list[dict], exclude: str) -> None:
        self._spawn(self._after_promotion(rows, exclude), f"making the promoted copies of {exclude} redundant")

    async def _after_promotion(self, rows: list[dict], lost: str) -> None:
        """Promoted copies of ``lost``'s messages: first every peer is asked to adopt the other
        shadows it holds of them (XSHADOWADOPT: they become our shadows and are never promoted
        themselves), then each copy gets the shadows it still lacks. Asked whatever our own
        ``shadow_copies``: ``lost`` made the copies under its setting, maybe another than ours now."""
        try:
            await self.adoptions.ask_all(rows, lost)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the copies still need their shadows
            log.exception("asking the peers to adopt the shadows of %d promoted message(s) of %s failed",
                          len(rows), lost)
        await self._reshadow_all(rows, exclude=lost)

    async def _reshadow_all(self, rows: list[dict], exclude: str | None, track_failure: bool = True) -> list[dict]:
        """Make each copy redundant again, RESHADOW_CONCURRENCY at a time (never a coroutine per
        message: a promotion may hold tens of thousands); returns the rows that got a shadow. A copy
        whose handling fails is left unprotected (retried every heartbeat round) and counted
        towards the Poison queue; the others go on."""
        made: list[dict] = []
        for i in range(0, len(rows), RESHADOW_CONCURRENCY):
            batch = rows[i:i + RESHADOW_CONCURRENCY]
            done = await asyncio.gather(*(self._reshadow_isolated(r, exclude, track_failure) for r in batch))
            made += [r for r, ok in zip(batch, done, strict=True) if ok]
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
            body, params, holders = await self.store.aread(lambda c: sq.reshadow_inputs(c, mid))
            # The GUID its other copies carry (a promoted copy's own among them), so that whoever
            # promotes it after us names every copy in one XSHADOWADOPT; a new one only for a
            # message no copy of which has one.
            shared, busy = await self.store.aread(lambda c: sq.message_guid(c, mid, row.get("shadow_guid")))
            addrs = list(params)
            wanted = self.sr.shadow_copies
            result = ShadowResult(None, "No suitable shadow servers")
            guid = shared or str(uuid.uuid4())
            # Two copies on one peer protect against nothing more than one: holders count by peer.
            missing = wanted - len({h for h, _ in holders})
            if self.enabled and body is not None and addrs and missing > 0:
                msg = NewMessage(network_message_id=row["network_message_id"], sender=row["sender"], data=body,
                                 recipients={}, received_at=now, expires_at=now, subject=row.get("subject") or "",
                                 smtputf8=bool(row.get("smtputf8")), body_type=row.get("body_type") or "",
                                 dsn_mail=row.get("dsn_params") or "", dsn_rcpt={a.lower(): p for a, p in params.items() if p})
                # New copies rank after the shadows it has (no two shadows of a message share a rank).
                first = min(MAX_SHADOW_RANK - missing + 1, 1 + max((r for _, r in holders), default=0))
                result = await self.make_shadow(msg, guid, addrs,
                                                exclude=[e for e in (exclude, *(h for h, _ in holders), *busy,
                                                                     *self.adoptions.pending_peers(mid)) if e],
                                                copies=missing, first_rank=max(1, first))
            # Recorded with the time the copies exist (not the start): a peer's new queue database
            # first seen by this very copy's session must not count it among the lost (reprotect).
            made_at = time.time()
            state = await self.store.write(lambda c: sq.settle_reshadow(
                c, mid, [(p, r) for p, r, _ in result.holders], guid, result.uncertain, bool(addrs), made_at, wanted,
                result.databases))
            if not addrs:
                return False
            for peer, _rank, reply in result.holders:
                self.events.track("HAREDIRECT", "SMTP", row, recipients=addrs, source_context=f"{peer}={reply}")
            if not result.peer and not holders and state == mq.QUEUED and track_failure:
                self.events.track("HAREDIRECTFAIL", "SMTP", row, recipients=addrs, source_context=result.reply)
            return bool(result.peer) or (missing <= 0 and bool(holders))
