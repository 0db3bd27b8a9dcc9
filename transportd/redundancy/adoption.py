"""Adoption after a promotion (PROTOCOL.md section 9): the other shadows of a promoted message
become shadows of the new primary.

With ``shadow_copies`` > 1 a message of a lost primary has shadows on several peers. The one that
promotes asks every other peer to keep its copy as a shadow of the promoted message
(XSHADOWADOPT); a peer that keeps it never promotes it. Asked after every promotion, whatever
this node's own ``shadow_copies``: the copies were made under the primary's setting when the
message came, which a restart since may have changed (a shadow cannot tell how many siblings
its copy has). A peer that cannot be asked (down, cut
off) still holds its copy as the lost primary's shadow and, that primary being gone, promotes it
after its rank's delay: a second delivery. So a peer that could not be asked is asked again every
heartbeat round until it answers, for the promoted messages this node still has (a message
delivered meanwhile is adopted too, and its discard event follows at once: the peer's copy goes
to its Shadow Safety Net). The list of peers still to ask is kept in memory: after a restart the
rules of PROTOCOL.md 9 apply as written (the peer promotes; mailbox duplicate detection).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from transportd.errors import PEER_FAILURES, NoShadowRequests
from transportd.queue import shadows as sq
from transportd.queue.store import QueueStore
from transportd.redundancy.peers import PeerPool, PeerSession
from transportd.redundancy.protocol import MAX_ADOPT_BATCH, Peer

log = logging.getLogger("transportd.redundancy.adoption")


class Adoptions:
    """XSHADOWADOPT to the other shadow holders of promoted messages, and again to those that
    could not be asked."""

    def __init__(self, sr: Any, store: QueueStore, pool: PeerPool, peers: list[Peer],
                 queue_database_id: Callable[[], str]):
        self.sr = sr
        self.store = store
        self.pool = pool
        self.peers = peers
        self._queue_database_id = queue_database_id
        # peer -> our message id -> (the lost primary, our copy's GUID, our copy's rank)
        self._unasked: dict[str, dict[int, tuple[str, str, int]]] = {}

    async def ask_all(self, rows: list[dict], lost: str) -> int:
        """Ask every peer but ``lost`` to adopt its copies of the promoted ``rows``; returns how
        many copies were adopted. A peer that fails is remembered and asked again (``ask_again``)."""
        copies = {r["id"]: (lost, r["shadow_guid"], int(r.get("shadow_rank") or 1))
                  for r in rows if r.get("shadow_guid")}
        if not copies:
            return 0
        asked = [p for p in self.peers if p.name != lost and self.pool.takes_shadows(p)]
        # Pending before the first question: while a peer has not answered, no new shadow of
        # these messages is placed on it (it holds one already: ``pending_peers``).
        for peer in asked:
            self._unasked.setdefault(peer.name, {}).update(copies)
        # At once: a black-holed peer costs one shadow_copy_timeout, not one per peer before it.
        answers = await asyncio.gather(*(self._ask(peer, copies, quiet=False) for peer in asked))
        adopted = 0
        for peer, done in zip(asked, answers):
            if done is not None:
                self._answered(peer.name, copies)
                adopted += done
        return adopted

    async def ask_again(self) -> int:
        """One heartbeat round's retry: each peer not asked yet, for the promoted messages still in
        the queue database; returns how many copies were adopted."""
        adopted = 0
        for name, copies in list(self._unasked.items()):
            peer = next((p for p in self.peers if p.name == name), None)
            held = await self.store.aread(lambda c, ids=list(copies): sq.messages_present(c, ids))
            for mid in [m for m in copies if m not in held]:
                del copies[mid]
            if peer is None or not copies:
                self._unasked.pop(name, None)
                continue
            asked = dict(copies)
            done = await self._ask(peer, asked, quiet=True)
            if done is not None:
                self._answered(name, asked)
                adopted += done
        return adopted

    def pending_peers(self, message_id: int) -> set[str]:
        """The peers still to be asked to adopt their copy of our promoted message ``message_id``:
        each holds a copy of it already, so none gets a new shadow of it meanwhile (the copy it
        holds becomes one when it answers; a second copy on the same peer protects nothing)."""
        return {name for name, copies in self._unasked.items() if message_id in copies}

    def _answered(self, name: str, asked: dict[int, tuple[str, str, int]]) -> None:
        """``name`` answered for ``asked`` (copies added for it meanwhile stay to be asked)."""
        pending = self._unasked.get(name)
        if pending is None:
            return
        for mid in asked:
            pending.pop(mid, None)
        if not pending:
            del self._unasked[name]

    async def _ask(self, peer: Peer, copies: dict[int, tuple[str, str, int]], quiet: bool) -> int | None:
        """XSHADOWADOPT to ``peer`` for ``copies`` (by lost primary and rank, in batches), the copies
        it keeps recorded as our shadows; None when the peer could not be asked. A peer that takes
        no shadow requests (2010 mode, shadow redundancy disabled) or refuses the verb for good
        (an older node) has answered: it adopts nothing, and is not asked again."""
        by_guid = {guid: mid for mid, (_, guid, _) in copies.items()}
        groups: dict[tuple[str, int], list[str]] = {}
        for lost, guid, rank in copies.values():
            groups.setdefault((lost, rank), []).append(guid)
        adopted: list[tuple[str, int]] = []
        s: PeerSession | None = None
        ok = False
        try:
            async with asyncio.timeout(self.sr.shadow_copy_timeout):
                s = await self.pool.session(peer)
                await s.shadow_request(self._queue_database_id())
                await self._ask_batches(s, groups, adopted)
                ok = True
        except NoShadowRequests as exc:
            log.debug("not asking %s to adopt: %s", peer.name, exc)
            return 0
        except PEER_FAILURES as exc:
            (log.debug if quiet else log.warning)(
                "XSHADOWADOPT to %s for %d promoted message(s) failed: %s (asked again each heartbeat round)",
                peer.name, len(copies), exc)
        finally:
            if s is not None:
                self.pool.release(s, ok)
        if adopted:
            now = time.time()
            surplus = await self.store.write(lambda c: sq.record_adopted(
                c, peer.name, [(by_guid[g], g, rank) for g, rank in adopted], now))
            log.info("%s adopted %d shadow(s) of messages we promoted", peer.name, len(adopted))
            if surplus:
                # Two shadows of one rank would both take ownership should we be lost.
                log.warning("%s adopted %d shadow(s) at a rank another peer's shadow of the message holds: "
                            "discarded there (a new shadow ranked after the others follows if one is missing)",
                            peer.name, len(surplus))
        return len(adopted) if ok else None

    @staticmethod
    async def _ask_batches(s: PeerSession, groups: dict[tuple[str, int], list[str]],
                           adopted: list[tuple[str, int]]) -> None:
        """The XSHADOWADOPT lines of one session, what the peer kept appended to ``adopted`` (kept
        when a later line fails); a refusal of the verb for good ends them (the first line)."""
        for (lost, rank), guids in sorted(groups.items()):
            for i in range(0, len(guids), MAX_ADOPT_BATCH):
                kept = await s.adopt(lost, rank, guids[i:i + MAX_ADOPT_BATCH])
                if kept is None:
                    log.info("%s does not adopt shadows (XSHADOWADOPT refused): its copies of the messages "
                             "we promoted stay shadows of %s", s.peer.name, lost)
                    return
                adopted.extend(kept)
