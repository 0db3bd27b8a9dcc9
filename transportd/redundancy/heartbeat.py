"""Watching primaries: the heartbeat (XSHADOW + XQDISCARD) and what its answers decide.

It owns, for every primary we hold shadows or forks for: polling it each
*ShadowHeartbeatFrequency* (every primary at once, each exchange bounded in
time), applying the discard ids it hands out (on a heartbeat session or any
hop-by-hop session), remembering its queue database ID, and promoting its
shadows when it has been unreachable for *ShadowResubmitTimeSpan*
(ShadowHeartbeatFailure) or answers with a new queue database ID
(ShadowStateChange). And, for every peer that names its queue database ID (any
of the above, or its reply to a shadow copy of ours), whether it still has the
database that took our copies: the shadows of our messages it held in another
one are made again (the manager's ``reprotect``). The rules themselves are pure
functions in protocol.py; the sessions are peers.py's; the copies are
shadow_queue.py's. No SQL here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from transportd.errors import PEER_FAILURES, ProtocolError
from transportd.queue import shadows as sq
from transportd.queue.store import QueueStore
from transportd.redundancy.events import EventSink
from transportd.redundancy.peers import PeerPool, PeerSession
from transportd.redundancy.protocol import (
    STATUS_KEYWORD,
    UNKNOWN,
    Peer,
    after_heartbeat,
    heartbeat_period,
    state_change_rank,
    unreachable_since,
)
from transportd.redundancy.shadow_queue import ShadowQueues

log = logging.getLogger("transportd.redundancy.heartbeat")

STATUS_PER_HEARTBEAT = 200  # old copies (and as many forks) a heartbeat asks a primary about (XQSTATUS)
LOST_BY_PRIMARY = "ShadowUnknownToPrimary"  # the promotion's reason: the live primary does not know the message


def primary_to_poll(pool: PeerPool, primary: str, ctx: dict | None, warned: set[str]) -> Peer | None:
    """Where to poll ``primary``: the configured peer, else (taken out of ``[[peers]]`` while we
    hold its shadows) its transport connector as last configured, or None when never recorded.

    A primary taken out of the configuration may still run and deliver what it holds: promoting
    its shadows because it is no longer configured would deliver each message twice. It is
    polled where it was, authenticated as to any peer; its answers decide as for any primary
    (one that is really gone fails its heartbeats and its shadows are promoted)."""
    peer = pool.by_name.get(primary)
    if peer is not None or not ctx or not ctx.get("transport"):
        return peer
    if primary not in warned:
        warned.add(primary)
        log.warning("shadows are held for %s, which is no longer a configured peer: it is still polled at its "
                    "last configured transport address %s until they are gone (promoted when it stays "
                    "unreachable for shadow_resubmit_time_span)", primary, ctx["transport"])
    return Peer(primary, "", ctx["transport"])


class Heartbeat:
    def __init__(self, cfg: Any, store: QueueStore, events: EventSink, pool: PeerPool, shadows: ShadowQueues,
                 spawn: Callable[[Any, str], Any], reprotect: Callable[[str, str, float | None], Awaitable[int]]):
        self.cfg = cfg
        self.sr = cfg.shadow_redundancy
        self.store = store
        self.events = events
        self.pool = pool
        self.shadows = shadows
        self._spawn = spawn
        self._reprotect = reprotect  # our messages shadowed on a peer that lost its queue database
        self._seen_lock = asyncio.Lock()
        # Primaries whose ShadowStateChange promotion is running (primary -> its new queue database ID).
        self._state_changes: dict[str, str] = {}
        # The queue database ID each peer last named, once our shadows there were checked against it.
        self._holder_ids: dict[str, str] = {}
        # Per primary, the last old copy asked about (shadow id, fork time): each one's turn comes.
        self._verified: dict[str, tuple[int, float]] = {}
        self._unconfigured: set[str] = set()  # primaries polled though no longer configured (warned once)

    @property
    def exchange_limit(self) -> float:
        """The longest one heartbeat exchange may take (connect, AUTH, XSHADOW, XQDISCARD)."""
        return min(30.0, max(1.0, heartbeat_period(self.sr) / 2))

    async def _context(self, primary: str, **values: Any) -> None:
        if (peer := self.pool.by_name.get(primary)) is not None:  # where to poll it once it is no longer configured
            values.setdefault("transport", peer.transport)
        await self.store.write(lambda c: sq.upsert_context(c, primary, **values))

    # ------------------------------------------------------------------ queue database IDs

    async def primary_seen(self, primary: str, dbid: str) -> None:
        """A primary announced its queue database ID: promote at once on a change.

        Shielded: it runs inside the announcing peer's session, and a peer that gives up and
        disconnects cancels that handler; a promotion cut off after its first step would leave the
        promoted copies unscheduled until a restart. One at a time, so two sessions announcing the
        same new ID promote once."""
        await asyncio.shield(self._primary_seen(primary, dbid))

    async def _primary_seen(self, primary: str, dbid: str) -> None:
        async with self._seen_lock:
            ctx = await self.store.aread(lambda c: sq.shadow_context(c, primary))
            recorded = ctx["queue_database_id"] if ctx else None
            if not recorded:
                await self._context(primary, queue_database_id=dbid)
            elif recorded != dbid and self._state_changes.get(primary) != dbid:
                log.warning("primary %s has a new queue database ID (%s, was %s): promoting its shadows",
                            primary, dbid, recorded)
                # In the background, out of the lock: the peer waits for its reply, and other
                # sessions' shadow requests must not wait for a promotion of thousands.
                self._state_changes[primary] = dbid
                self._spawn(self._state_change(primary, dbid, time.time()), f"promoting the shadows of {primary}")
                return  # our copies it held are looked at once the promotion is done
            # Not trusted for our copies: ones it took in another queue database of its are gone
            # even when this is the first ID we record for it.
            self.holder_seen(primary, dbid)

    def holder_seen(self, peer: str, dbid: str, changed_at: float | None = None) -> None:
        """``peer`` named its queue database ``dbid`` (its XSHADOWREQUEST, its answer to XSHADOW,
        its reply to a shadow copy of ours). Shadows of our messages that it took in another of its
        queue databases are gone: they are made again in the background (``reprotect``); with
        ``changed_at`` (a change of its ID seen then), so are those recorded before then without
        a database (a peer that does not name it). Looked at once per ID a peer names, not on
        every contact; a look that fails is done again at its next contact."""
        if changed_at is None and self._holder_ids.get(peer) == dbid:
            return
        self._holder_ids[peer] = dbid
        self._spawn(self._reprotect_lost(peer, dbid, changed_at), f"re-making the shadows {peer} lost")

    async def _reprotect_lost(self, peer: str, dbid: str, changed_at: float | None) -> None:
        try:
            await self._reprotect(peer, dbid, changed_at)
        except BaseException:
            if self._holder_ids.get(peer) == dbid:
                del self._holder_ids[peer]
            raise

    async def _state_change(self, primary: str, dbid: str, seen_at: float) -> None:
        try:
            # Rank 1 at once; copies of a higher rank (N-way) when their delay has passed
            # (``_old_ranks``, in the heartbeats that follow).
            await self.shadows.promote(primary, "ShadowStateChange", keep_dbid=dbid, max_rank=1)
            # Recorded only once every rank-1 copy is promoted: a crash half-way finds the change again.
            await self._context(primary, queue_database_id=dbid, state_changed_at=time.time())
        finally:
            if self._state_changes.get(primary) == dbid:
                del self._state_changes[primary]
        # The shadow copies it held of *our* messages went with its old database: make them again.
        # Only those: a copy made on the new database (this very session's, say) is current.
        self.holder_seen(primary, dbid, seen_at)

    async def _old_ranks(self, primary: str, dbid: str | None, changed_at: float, now: float) -> None:
        """Shadows made from ``primary``'s old queue database, of a rank above 1 (N-way): promoted
        when their delay since the change has passed, unless rank 1 adopted them meanwhile."""
        rank = state_change_rank(since_change=now - changed_at, rank_delay=self.sr.shadow_rank_delay)
        await self.shadows.promote(primary, "ShadowStateChange", keep_dbid=dbid, max_rank=rank)
        if not await self.store.aread(lambda c: sq.waiting_ranks(c, primary, rank, keep_dbid=dbid)):
            await self._context(primary, state_changed_at=None)

    # ------------------------------------------------------------------ hop-by-hop sessions

    async def hop_session_start(self, session: PeerSession) -> str:
        """XSHADOW and the discard exchange on a hop-by-hop delivery session to a primary.

        Returns the peer's queue database ID (a changed one promotes what we hold for it). The
        discard exchange runs on every session to the primary and counts as a heartbeat; after a
        malformed discard reply every shadow of it is kept and the session ends without QUIT."""
        peer_name = session.peer.name
        dbid = await session.identify()
        await self.primary_seen(peer_name, dbid)
        try:
            discarded = await session.take_discards()
        except ProtocolError as exc:
            log.error("XQDISCARD on a session to %s: protocol violation: %s; keeping every shadow of it",
                      peer_name, exc)
            return dbid
        await self._context(peer_name, last_heartbeat_at=time.time(), consecutive_failures=0, last_error=None,
                            unreachable_since=None, down_since=None)  # it answered: not down
        if discarded:
            await self.shadows.discard(peer_name, discarded, time.time())
        return dbid

    # ------------------------------------------------------------------ heartbeats

    async def round(self) -> None:
        """One heartbeat to every primary at once: a black-holed primary does not delay the others."""
        primaries = await self.store.aread(sq.primaries_to_poll)
        # The others' failures are of polls long past (``shadow list``, the consecutive-failures gauge).
        await self.store.write(lambda c: sq.settle_unpolled(c, primaries))
        results = await asyncio.gather(*(self.heartbeat(p) for p in primaries), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                log.error("a heartbeat failed unexpectedly: %r", r, exc_info=r)

    async def _exchange(self, primary: str, ctx: dict | None, now: float
                        ) -> tuple[bool, str | None, str]:
        """XSHADOW (+ XQDISCARD unless the ID changed) with ``primary``: (ok, answered ID, error)."""
        recorded = ctx["queue_database_id"] if ctx else None
        peer = primary_to_poll(self.pool, primary, ctx, self._unconfigured)
        if peer is None:
            return False, None, f"{primary} is not a configured peer and its transport address was never recorded"
        s: PeerSession | None = None
        answered: str | None = None
        ok = False
        discarded: list = []
        try:
            async with asyncio.timeout(self.exchange_limit):  # a black-holed primary costs one limit
                s = await self.pool.open(peer, shadows=False)
                answered = await s.identify()
                if recorded and answered != recorded:
                    return True, answered, ""  # the exchange worked; the state changed
                discarded = await s.take_discards()
                ok = True
            # Applied outside the exchange's limit: a large batch is a write to the queue database
            # and a tracking row per copy, not the primary's answer. Cut by the limit, the copies
            # were removed and their HADISCARD rows never written.
            if discarded:
                await self.shadows.discard(primary, discarded, now)
            async with asyncio.timeout(self.exchange_limit):
                lost = await self._unknown_to(s, primary, now)
                await s.quit()  # acknowledges the discards we just applied
            if lost:
                log.warning("primary %s does not know %d message(s) we hold shadows of (its queue database lost "
                            "them, or never committed them): promoting those copies: %s", primary, len(lost),
                            ", ".join(lost[:20]) + (" ..." if len(lost) > 20 else ""))
                await self.shadows.promote(primary, LOST_BY_PRIMARY, guids=lost)
            return True, answered, ""
        except ProtocolError as exc:
            log.error("heartbeat to %s: %s; keeping every shadow of it", primary, exc)
            return False, answered, f"protocol violation: {exc}"
        except PEER_FAILURES as exc:
            return ok, answered, "" if ok else (str(exc) or exc.__class__.__name__)
        finally:
            if s is not None:
                s.close()  # heartbeat sessions are not reused for shadow copies

    async def _unknown_to(self, s: PeerSession, primary: str, now: float) -> list[str]:
        """XQSTATUS for the copies of ``primary`` held longer than *ShadowResubmitTimeSpan* (a
        message still being committed there is not asked about) and younger than the Safety Net's
        hold (the primary knows a message's GUID at least that long): the GUIDs it does not know,
        whose copies are the only ones left. Never asked of a primary that does not offer it."""
        if not s.supports_extension(STATUS_KEYWORD.lower()):
            return []
        after = self._verified.get(primary, (0, 0.0))
        copies = await self.store.aread(lambda c: sq.copies_to_verify(
            c, primary, before=now - self.sr.shadow_resubmit_time_span,
            since=now - self.cfg.safety_net.safety_net_hold_time, rank_delay=self.sr.shadow_rank_delay,
            after=after, limit=STATUS_PER_HEARTBEAT))
        shadows = [i for _, i, _ in copies if i]
        forks = [at for _, i, at in copies if not i]
        self._verified[primary] = (shadows[-1] if len(shadows) == STATUS_PER_HEARTBEAT else 0,
                                   forks[-1] if len(forks) == STATUS_PER_HEARTBEAT else 0.0)
        if not copies:
            return []
        try:
            statuses = await s.status([g for g, _, _ in copies])
        except ProtocolError as exc:  # the discard exchange worked: the heartbeat counts
            log.error("XQSTATUS to %s: %s; its copies are kept as they are", primary, exc)
            return []
        return [g for g, status in statuses.items() if status == UNKNOWN]

    async def heartbeat(self, primary: str) -> bool:
        """One XSHADOW + XQDISCARD exchange with ``primary`` and what it decides; True on success."""
        now = time.time()
        ctx = await self.store.aread(lambda c: sq.shadow_context(c, primary))
        recorded = ctx["queue_database_id"] if ctx else None
        ok, answered, error = await self._exchange(primary, ctx, now)
        failures = 0 if ok else (ctx["consecutive_failures"] if ctx else 0) + 1
        now = time.time()
        since = None if ok else unreachable_since(
            previous=ctx["unreachable_since"] if ctx else None, last_ok=ctx["last_heartbeat_at"] if ctx else None,
            now=now, heartbeat_frequency=heartbeat_period(self.sr), exchange_limit=self.exchange_limit)
        decision = after_heartbeat(ok=ok, unreachable_for=0.0 if since is None else now - since,
                                   recorded_dbid=recorded, answered_dbid=answered,
                                   resubmit_time_span=self.sr.shadow_resubmit_time_span, failures=failures,
                                   retry_count=self.sr.shadow_heartbeat_retry_count if self.sr.version == "2010"
                                   else None, rank_delay=self.sr.shadow_rank_delay)
        # Down since the first failure of this streak: a promotion span restarting does not move it.
        down_since = None if ok else (ctx.get("down_since") if ctx else None) or since
        values: dict[str, Any] = {"consecutive_failures": failures, "last_error": error or None,
                                  "unreachable_since": since, "down_since": down_since}
        state_change = decision.promote and decision.reason == "ShadowStateChange"
        if ok:
            values["last_heartbeat_at"] = now
            if answered and not state_change:  # a new ID is recorded once its promotion is done
                values["queue_database_id"] = answered
        await self._context(primary, **values)
        if ok and not state_change and ctx and ctx.get("state_changed_at"):
            await self._old_ranks(primary, answered, ctx["state_changed_at"], now)
        if not ok:
            self.events.metrics.heartbeat_failures.labels(primary).inc()
            log.warning("heartbeat to primary %s failed (%d in a row): %s", primary, failures, error)
            if down_since is not None and now - down_since >= self.cfg.safety_net.primary_safety_net_unreachable_time:
                await self.shadows.resubmit_requested(primary, now)
        if decision.promote:
            await self.shadows.promote(primary, decision.reason, keep_dbid=answered if state_change else None,
                                       max_rank=decision.rank)
            if state_change:
                await self._context(primary, queue_database_id=answered, state_changed_at=time.time())
            elif not await self.store.aread(lambda c: sq.waiting_ranks(c, primary, decision.rank)):
                # A new span starts. While shadows of a higher rank wait (N-way), the span runs on
                # so that they are promoted when their delay has passed too.
                await self._context(primary, consecutive_failures=0, unreachable_since=time.time())
        if answered:  # the copies of our messages it holds, as for any peer naming its database
            self.holder_seen(primary, answered, now if state_change else None)
        return ok
