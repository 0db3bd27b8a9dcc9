"""Shadow copies: ``shadow_copies`` of a message made at once, each on its own peer, each with its rank.

It owns one message's copies: a slot per copy trying the candidate peers in
placement order (a peer held or being tried by another slot is skipped), a fair
share of *shadow_copy_timeout* per peer still to try, one attempt on one peer
(XSHADOWREQUEST, then MAIL ``XSHADOW=`` [``XSHADOWRANK=``], RCPT, BDAT), and
which peers may hold a copy we do not count (they get a discard event). Which
peers are candidates is the Shadow Redundancy Manager's (placement), the wire is
peers.py's; no SQL, no tracking here.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable

from transportd.errors import PEER_FAILURES
from transportd.queue.messages import NewMessage
from transportd.redundancy.peers import PeerPool, PeerSession
from transportd.redundancy.protocol import Peer
from transportd.smtp.dsnparams import DsnRequest
from transportd.smtp.envelope import message_parameters


@dataclass
class ShadowResult:
    peer: str | None  # the first peer that holds a copy (None: no shadow made)
    reply: str  # the peer's DATA reply, or the reasons no shadow could be made
    # Peers that may hold a copy although we do not count it (the session broke after DATA):
    # they get a discard event for the GUID, so no copy is left behind forever.
    uncertain: tuple[str, ...] = ()
    # Every copy made: (peer, rank, its reply), in rank order (N-way: shadow_copies of them).
    holders: tuple[tuple[str, int, str], ...] = ()
    failures: str = ""  # why copies are missing when fewer than asked were made
    # The queue database ID each holder named in its reply (a peer that does not say is absent):
    # recorded with the shadow, so the copy is known lost when that peer has another database.
    databases: dict[str, str] = field(default_factory=dict)

    @property
    def peers(self) -> list[str]:
        return [h[0] for h in self.holders]


class ShadowCopier:
    """Makes one message's shadow copies over the peer pool (the manager picks the candidates)."""

    def __init__(self, sr: Any, pool: PeerPool, queue_database_id: Callable[[], str]):
        self.sr = sr
        self.pool = pool
        self.queue_database_id = queue_database_id

    async def make(self, msg: NewMessage, guid: str, recipients: list[str], candidates: list[Peer],
                   copies: int, first_rank: int = 1) -> ShadowResult:
        """Copy ``msg`` to ``copies`` peers before the sender gets its 250, all at once, each slot
        trying ``candidates`` in order (placement with its retries); slot k's copy carries rank
        ``first_rank + k``. A peer holds at most one copy of a message."""
        # The copy travels as the message came: SMTPUTF8 and BODY=8BITMIME when it needs them.
        params = message_parameters(msg.sender, recipients, msg.data, smtputf8=msg.smtputf8,
                                    body_type=msg.body_type)
        dsn = DsnRequest(msg.dsn_mail, msg.dsn_rcpt) if msg.dsn_mail or msg.dsn_rcpt else None  # RFC 3461
        if not candidates:
            return ShadowResult(None, "No suitable shadow servers")
        reasons: list[str] = []
        uncertain: list[str] = []
        held: list[tuple[str, int, str]] = []
        claimed: set[str] = set()  # peers a slot holds or is trying now
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.sr.shadow_copy_timeout
        timed_out: set[str] = set()
        databases: dict[str, str] = {}

        async def slot(rank: int) -> None:
            for i, peer in enumerate(candidates):
                if peer.name in timed_out or peer.name in claimed:
                    continue  # a peer that hung once (partitioned, paused) would eat the others' time
                remaining = deadline - loop.time()
                if remaining <= 0:
                    reasons.append(f"no shadow within shadow_copy_timeout ({self.sr.shadow_copy_timeout:g}s)")
                    return
                claimed.add(peer.name)
                # Each distinct peer still to try gets a fair share of what is left, so one silent
                # peer cannot leave a healthy one untried.
                left = 1 + len({p.name for p in candidates[i:] if p.name not in timed_out and p.name not in claimed})
                accepted, reply, dbid = await self._copy_to(peer, msg, guid, recipients, params,
                                                            remaining / left, timed_out, uncertain, rank, dsn)
                if accepted:
                    held.append((peer.name, rank, reply))
                    if dbid:
                        databases[peer.name] = dbid
                    return
                claimed.discard(peer.name)
                reasons.append(f"{peer.name}: {reply}")

        await asyncio.gather(*(slot(first_rank + k) for k in range(copies)))
        held.sort(key=lambda h: h[1])
        why = "; ".join(dict.fromkeys(reasons)) or "No suitable shadow servers"
        names = {h[0] for h in held}
        if not held:
            return ShadowResult(None, why, tuple(uncertain))
        return ShadowResult(held[0][0], held[0][2], tuple(u for u in uncertain if u not in names), tuple(held),
                            why if len(held) < copies else "", databases)

    async def _copy_to(self, peer: Peer, msg: NewMessage, guid: str, recipients: list[str], params: list[str],
                       limit: float, timed_out: set[str], uncertain: list[str], rank: int = 1,
                       dsn: DsnRequest | None = None) -> tuple[bool, str, str | None]:
        """One attempt on one peer: (whether it holds the copy, its reply or why not, the queue
        database ID it names as holding the copy)."""
        s: PeerSession | None = None
        ok = False
        try:
            async with asyncio.timeout(limit):
                s = await self.pool.session(peer)
                await s.shadow_request(self.queue_database_id())
                result = await s.copy(msg.sender, params, recipients, msg.data, guid, rank, dsn)
                ok = True  # the session is fine, whatever the peer answered
                if result.held and peer.name not in uncertain:
                    uncertain.append(peer.name)  # refused, yet stored: it gets a discard event
                return result.accepted, result.reply, result.queue_database_id
        except PEER_FAILURES as exc:
            # A hung TLS handshake comes wrapped (TlsRequired, from the time-out): timed out too.
            if isinstance(exc, asyncio.TimeoutError) or isinstance(exc.__cause__, asyncio.TimeoutError):
                timed_out.add(peer.name)
            if s is not None and s.data_sent and peer.name not in uncertain:
                uncertain.append(peer.name)  # it may hold a copy we do not count
            return False, str(exc) or exc.__class__.__name__, None
        finally:
            if s is not None:
                self.pool.release(s, ok)
