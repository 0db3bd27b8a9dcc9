"""Sessions to peers' transport connectors: the pool, the one AUTH, the shadow redundancy exchanges.

It owns opening an authenticated session to a boundary peer (EHLO, STARTTLS
where configured, AUTH PLAIN with this node's FQDN and the cluster secret: the
only place a peer is authenticated), reusing idle sessions, and the client side
of each exchange over such a session, driven by the sans-I/O
``ClientConnection`` (redundancy/connection.py) over the stream of
smtp/wire.py: a shadow copy (XSHADOWREQUEST once per session, then MAIL
``XSHADOW=``, RCPT and ``BDAT <n> LAST`` with the body in one write), the XSHADOW +
XQDISCARD exchange (heartbeat and hop-by-hop start), XRESUBMIT. It never reads
or writes the queue database and decides nothing: the Shadow Redundancy
Manager does.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from transportd.config import peer_tls_options
from transportd.errors import PEER_FAILURES, NoShadowRequests, ProtocolError
from transportd.redundancy.connection import (
    Adopted,
    ClientConnection,
    CommandRefused,
    DiscardBatch,
    PrimaryIdentified,
    ResubmitAnswered,
    SendBody,
    ShadowAccepted,
    ShadowRefused,
    ShadowRequestAccepted,
    StatusAnswered,
    TransactionReplies,
)
from transportd.redundancy.protocol import (
    DELAY_DISCARDS_KEYWORD,
    FAILED_DISCARDS_KEYWORD,
    MAX_STATUS_BATCH,
    NOTIFY_DISCARDS_KEYWORD,
    RCPT_DISCARDS_KEYWORD,
    Peer,
    heartbeat_period,
)
from transportd.smtp.dsnparams import DsnRequest
from transportd.smtp.wire import SmtpWire

DISCARD_BATCH = 50
IDLE_SESSIONS_PER_PEER = 16
# How often the pool looks, while it keeps idle sessions, for those the peer closed (its
# connection_inactivity_timeout, a restart): each is closed here too, not left in CLOSE-WAIT
# until the next copy to that peer.
IDLE_SWEEP_INTERVAL = 1.0


def tls_options(cfg: Any) -> dict[str, Any]:
    """Options for a session to a peer (smtp/wire.py): STARTTLS with the cluster CA where configured."""
    return peer_tls_options(cfg)


@dataclass
class ShadowCopyReply:
    accepted: bool
    reply: str  # the peer's reply to the copy (or the first refusal of its MAIL or a RCPT)
    held: bool = False  # refused, yet the peer stored the data: it gets a discard event
    queue_database_id: str | None = None  # the peer's queue database that holds the copy, if it says


class PeerSession:
    """One authenticated session to a peer's transport connector and its protocol state."""

    def __init__(self, client: SmtpWire, peer: Peer, local_fqdn: str):
        self.client = client
        self.peer = peer
        self.conn = ClientConnection(local_fqdn)
        self.data_sent = False  # the last copy's DATA went out: the peer may hold it

    @property
    def usable(self) -> bool:
        """Connected, and nothing unread waits (a peer that stops answers its idle sessions 421)."""
        return self.client.idle

    async def _exchange(self, line: bytes) -> list[Any]:
        verb, _, arg = line.rstrip(b"\r\n").partition(b" ")
        resp = await self.client.execute_command(verb, *([arg] if arg else []))
        return self.conn.receive_reply(resp.code, resp.message.splitlines())

    async def shadow_request(self, queue_database_id: str) -> None:
        """XSHADOWREQUEST, once per session: this session carries our shadow copies from now on."""
        if self.conn.shadow_requested:
            return
        events = await self._exchange(self.conn.send_shadow_request(queue_database_id))
        if not any(isinstance(e, ShadowRequestAccepted) for e in events):
            raise ProtocolError(_refusal("XSHADOWREQUEST", events))

    async def copy(self, sender: str, params: list[str], recipients: list[str], data: bytes,
                   guid: str, rank: int = 1, dsn: DsnRequest | None = None) -> ShadowCopyReply:
        """MAIL ``XSHADOW=<guid>``, RCPT and ``BDAT <n> LAST`` (DATA where the peer offers no
        CHUNKING) in one write, the replies read as they come: the copy counts only when the peer
        says 2.6.0. A refused copy leaves the session usable."""
        wire = self.client
        self.data_sent = False
        group = self.conn.send_shadow_copy(sender, params, recipients, data, guid,
                                           chunking=wire.supports_extension("chunking"), rank=rank,
                                           dsn=dsn if wire.supports_extension("dsn") else None)
        self.data_sent = True  # from the write on, the peer may hold the copy
        event = await self._group(wire, group)
        if isinstance(event, ShadowAccepted):
            return ShadowCopyReply(True, f"250 {event.reply_text}", queue_database_id=event.queue_database_id)
        assert isinstance(event, ShadowRefused)
        return ShadowCopyReply(False, f"{event.code} {event.text}", held=event.held)

    async def relay(self, sender: str, params: list[str], recipients: list[str], data: bytes,
                    guid: str | None, dsn: DsnRequest | None = None) -> TransactionReplies:
        """A message relayed to the peer (hop by hop with ``guid``: MAIL ``XSHADOW=``), as one
        pipelined group like ``copy``; every reply, for the caller to read per recipient."""
        wire = self.client
        group = self.conn.send_transaction(sender, params, recipients, data, guid=guid,
                                           chunking=wire.supports_extension("chunking"),
                                           dsn=dsn if wire.supports_extension("dsn") else None)
        event = await self._group(wire, group)
        assert isinstance(event, TransactionReplies)
        return event

    async def _group(self, wire: SmtpWire, group: bytes) -> Any:
        """Write a pipelined group and read its replies as they come, until the connection says
        how it ended (the body after a 354 written when it asks)."""
        wire.write(group)
        while True:
            reply = await wire.read_reply()
            for event in self.conn.receive_reply(reply.code, reply.message.split("\n")):
                if isinstance(event, SendBody):
                    wire.write(event.data)
                else:
                    return event

    @property
    def is_connected(self) -> bool:
        return self.client.is_connected

    def supports_extension(self, name: str) -> bool:
        return self.client.supports_extension(name)

    async def rset(self) -> Any:
        return await self.client.rset()

    async def identify(self) -> str:
        """XSHADOW: announce ourselves as a shadow; returns the primary's queue database ID."""
        events = await self._exchange(self.conn.send_xshadow())
        for e in events:
            if isinstance(e, PrimaryIdentified):
                return e.queue_database_id
        raise ProtocolError(_refusal("XSHADOW", events))

    async def take_discards(self) -> list[tuple[str, str | None]]:
        """XQDISCARD until a batch is shorter than asked: the ids the primary discarded.

        A malformed reply raises ProtocolError; the session must then end without QUIT (a QUIT
        acknowledges ids we did not apply): ``close()`` does that."""
        entries: list[tuple[str, str | None]] = []
        recipients = self.client.supports_extension(RCPT_DISCARDS_KEYWORD.lower())  # per-recipient entries too
        failed = recipients and self.client.supports_extension(FAILED_DISCARDS_KEYWORD.lower())  # Failed= too
        # ... and the recipients delivered whose success notice is still queued there
        notify = failed and self.client.supports_extension(NOTIFY_DISCARDS_KEYWORD.lower())
        # ... and that a message's delay notice went to its sender (the copy is kept, noted so)
        delay = notify and self.client.supports_extension(DELAY_DISCARDS_KEYWORD.lower())
        while True:
            events = await self._exchange(self.conn.send_discard(DISCARD_BATCH, recipients, failed, notify, delay))
            batch = next((e for e in events if isinstance(e, DiscardBatch)), None)
            if batch is None:
                raise ProtocolError(_refusal("XQDISCARD", events))
            entries.extend(batch.entries)
            if batch.complete:
                return entries

    async def status(self, guids: list[str]) -> dict[str, str]:
        """XQSTATUS, up to MAX_STATUS_BATCH GUIDs a command (after ``identify``): GUID -> Held,
        Done or Unknown. A refusal or a malformed reply raises ProtocolError."""
        out: dict[str, str] = {}
        guids = list(dict.fromkeys(guids))
        for i in range(0, len(guids), MAX_STATUS_BATCH):
            events = await self._exchange(self.conn.send_status(guids[i:i + MAX_STATUS_BATCH]))
            answered = next((e for e in events if isinstance(e, StatusAnswered)), None)
            if answered is None:
                raise ProtocolError(_refusal("XQSTATUS", events))
            out.update(answered.statuses)
        return out

    async def adopt(self, old_primary: str, rank: int, guids: list[str]) -> list[tuple[str, int]] | None:
        """XSHADOWADOPT: we promoted these shadows of ``old_primary`` (ours had ``rank``); returns
        (GUID, rank) of each copy the peer held and now keeps as our shadow, or None when the peer
        refused the verb for good (5xx: an older node that does not know it, shadow redundancy
        disabled there): it adopts none, and asking it again (more batches, every heartbeat) would
        only end the session (aiosmtpd drops a client after five unknown commands). A 4xx
        refusal raises ProtocolError: asked again later."""
        events = await self._exchange(self.conn.send_adopt(old_primary, rank, guids))
        for e in events:
            if isinstance(e, Adopted):
                return list(e.entries)
        refused = next((e for e in events if isinstance(e, CommandRefused)), None)
        if refused is not None and 400 <= refused.code < 500:
            raise ProtocolError(_refusal("XSHADOWADOPT", events))
        return None

    async def resubmit(self, destination: str, start: float, end: float) -> str:
        events = await self._exchange(self.conn.send_resubmit(destination, start, end))
        for e in events:
            if isinstance(e, ResubmitAnswered):
                return f"{e.code} {e.text}"
        return _refusal("XRESUBMIT", events)

    @property
    def peer_queue_database_id(self) -> str | None:
        return self.conn.peer_queue_database_id

    async def quit(self) -> None:
        """End the session; a QUIT acknowledges the discards taken on it, so after a protocol
        violation the connection is only closed."""
        if self.conn.discards_unapplied:
            self.close()
            return
        try:
            await asyncio.wait_for(self.client.quit(), 5)
        except Exception:  # noqa: BLE001 - the session is over either way
            self.close()

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001
            pass


def _refusal(verb: str, events: list[Any]) -> str:
    for e in events:
        if isinstance(e, CommandRefused):
            return f"{verb} answered {e.code} {e.text}"
    return f"{verb}: no answer understood"


async def authenticate(client: SmtpWire, local_fqdn: str, secret: str) -> None:
    """Prove cluster membership on a session to a peer: AUTH PLAIN, user = our FQDN."""
    await client.auth_plain(local_fqdn, secret)


async def open_session(peer: Peer, *, local_fqdn: str, secret: str, tls: dict[str, Any], timeout: float,
                       shadows: bool = True, connect_timeout: float | None = None) -> PeerSession:
    """An authenticated session to ``peer``; ``shadows``: for making shadow copies (the peer must
    offer XSHADOWREQUEST). A heartbeat needs only XSHADOW + XQDISCARD, which a peer with shadow
    redundancy disabled still answers for the copies others hold of its mail."""
    host, _, port = peer.transport.rpartition(":")
    client = SmtpWire(host.strip("[]"), int(port), local_hostname=local_fqdn, timeout=timeout, **tls)
    await client.connect(**({"timeout": connect_timeout} if connect_timeout else {}))
    try:
        await client.ehlo()
        await start_peer_session(client, peer.name, local_fqdn=local_fqdn, secret=secret, shadows=shadows)
    except BaseException:
        client.close()
        raise
    return PeerSession(client, peer, local_fqdn)


async def start_peer_session(client: SmtpWire, peer_name: str, *, local_fqdn: str, secret: str,
                             shadows: bool) -> None:
    """AUTH on a session whose EHLO is done; ``shadows``: the peer must offer XSHADOWREQUEST."""
    if shadows and not client.supports_extension("xshadowrequest"):
        raise NoShadowRequests(f"{peer_name} does not advertise XSHADOWREQUEST")
    await authenticate(client, local_fqdn, secret)


class PeerPool:
    """Idle authenticated sessions per peer, reused for shadow copies; one the peer closed
    meanwhile is closed here too within IDLE_SWEEP_INTERVAL."""

    def __init__(self, cfg: Any, peers: list[Peer]):
        self.cfg = cfg
        self.local_fqdn = cfg.node.name.lower()
        self.by_name = {p.name: p for p in peers}
        self.tls = tls_options(cfg)
        self._idle: dict[str, list[PeerSession]] = {}
        self._no_shadows_until: dict[str, float] = {}  # peers that did not offer XSHADOWREQUEST lately
        self._sweep: asyncio.TimerHandle | None = None  # while idle sessions are kept
        self.closing = False

    @property
    def _timeout(self) -> float:
        return max(5.0, min(30.0, heartbeat_period(self.cfg.shadow_redundancy)))

    def takes_shadows(self, peer: Peer) -> bool:
        """False for a while after the peer's EHLO lacked XSHADOWREQUEST (a 2010-mode node or one with
        shadow redundancy off): placement goes to the other peers without a session each time."""
        return time.monotonic() >= self._no_shadows_until.get(peer.name, 0.0)

    async def open(self, peer: Peer, shadows: bool = True) -> PeerSession:
        try:
            return await open_session(peer, local_fqdn=self.local_fqdn, secret=self.cfg.cluster.secret,
                                      tls=self.tls, timeout=self._timeout, shadows=shadows)
        except NoShadowRequests:
            self._no_shadows_until[peer.name] = time.monotonic() + max(30.0, heartbeat_period(self.cfg.shadow_redundancy))
            raise

    async def session(self, peer: Peer) -> PeerSession:
        """An idle session to ``peer`` if one is still connected, else a new one."""
        idle = self._idle.setdefault(peer.name, [])
        while idle:
            s = idle.pop()
            if s.usable:
                return s
            s.close()
        return await self.open(peer)

    def release(self, s: PeerSession, ok: bool) -> None:
        if ok and s.usable and not self.closing:
            idle = self._idle.setdefault(s.peer.name, [])
            if len(idle) < IDLE_SESSIONS_PER_PEER:
                idle.append(s)
                if self._sweep is None:
                    self._sweep = asyncio.get_running_loop().call_later(IDLE_SWEEP_INTERVAL, self._drop_closed)
                return
        s.close()

    def _drop_closed(self) -> None:
        """Close the idle sessions the peer closed (or that have something unread: a 421 before
        its close); look again in a while if any are left."""
        self._sweep = None
        for name, idle in list(self._idle.items()):
            for s in [s for s in idle if not s.usable]:
                idle.remove(s)
                s.close()
            if not idle:
                del self._idle[name]
        if self._idle and not self.closing:
            self._sweep = asyncio.get_running_loop().call_later(IDLE_SWEEP_INTERVAL, self._drop_closed)

    def close(self) -> None:
        self.closing = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for sessions in self._idle.values():
            for s in sessions:
                s.close()
        self._idle.clear()


async def ask_resubmit(cfg: Any, peer: Peer, destination: str, start: float, end: float) -> str:
    """XRESUBMIT to one peer (the operator's Safety Net resubmit); returns its reply or the error."""
    s: PeerSession | None = None
    try:
        s = await open_session(peer, local_fqdn=cfg.node.name.lower(), secret=cfg.cluster.secret,
                               tls=tls_options(cfg), timeout=30.0, shadows=False)
        reply = await s.resubmit(destination, start, end)
        await s.quit()
        return reply
    except PEER_FAILURES as exc:
        if s is not None:
            s.close()
        return f"failed: {str(exc) or exc.__class__.__name__}"
