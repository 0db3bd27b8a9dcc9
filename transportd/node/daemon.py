"""The node: one process, one event loop, wiring receive, the queue database, delivery and logs.

It owns start-up (open or repair the queue database, crash recovery of
messages left Active, the listeners), the accept path behind the frontend's
DATA (prepare headers, bifurcate, durable commit, RECEIVE), and shutdown on
SIGTERM/SIGINT. Tracking-log failures are reported on the operational log and
never turn an acknowledged message into an error.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import signal
import socket
import ssl
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from aiosmtpd.smtp import Envelope, Session

from transportd import __version__
from transportd import faults
from transportd.queue import messages as mq
from transportd.config import Config
from transportd.node.delivery import DeliveryAgent
from transportd.queue.mailbox import MailboxStore
from transportd.queue.messages import NewMessage
from transportd.node.metrics import NodeMetrics
from transportd.smtp.server import (ConnectionCounter, FrontendHandler, MessageRejected, new_network_message_id,
                      prepare_message, received_as, smtp_factory)
from transportd.smtp.replies import S451_NOT_REDUNDANT, S451_STORE_UNAVAILABLE, S554_HOP_COUNT, S554_NO_VALID_RECIPIENTS
from transportd.redundancy.manager import (ShadowManager, ShadowResult, _network_id_from, discard_uncertain_job,
                     record_shadow_job)
from transportd.redundancy.server import TransportHandler, TransportSMTP, make_peer_authenticator
from transportd.queue.routing import bifurcate
from transportd.queue.store import QueueStore, StoreError, meta
from transportd.tracking import TrackingLog

log = logging.getLogger("transportd")

# Operational log level of the line each tracking event also writes (RECEIVE has its own "queued" line).
EVENT_LOG_LEVELS = {e: logging.INFO for e in ("DELIVER", "DUPLICATEDELIVER", "SEND", "SENDEXTERNAL", "DEFER",
                                              "FAIL", "DSN", "DROP", "RESUBMIT", "HAREDIRECTFAIL")}
EVENT_LOG_LEVELS["POISONMESSAGE"] = logging.WARNING


# meta key written by a clean stop; its absence at start means the node crashed.
CLEAN_STOP = "clean_stop"


def message_ids(row: dict) -> dict[str, Any]:
    """``extra=`` for a log line about a message: its internal and network message ids."""
    return {"internal_message_id": row.get("id"), "network_message_id": row.get("network_message_id") or ""}


def address_of(host: str) -> str:
    """The IP address a listener's host name resolves to (MSGTRK's server-ip is an address)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return host


def remember_config_path(conn: Any, path: str) -> None:
    conn.execute(meta.delete().where(meta.c.key == "config_path"))
    conn.execute(meta.insert().values(key="config_path", value=path))


class NullTrackingLog:
    def write(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


class Node:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.store: QueueStore | None = None
        self.tracking: Any = NullTrackingLog()
        self.mailboxes = MailboxStore(cfg.mailbox_dir, cfg.node.name)
        self.delivery: DeliveryAgent | None = None
        self.shadow: ShadowManager | None = None
        self.servers: list[asyncio.AbstractServer] = []
        self._tasks: list[asyncio.Task] = []
        self._stopped = asyncio.Event()
        self.metrics = NodeMetrics(cfg.node.name)
        self.accepting: set[int] = set()  # messages between their local commit and their settle

    # ------------------------------------------------------------------ start and stop

    async def start(self) -> None:
        cfg = self.cfg
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        self.store = QueueStore.open(cfg.db_path, create=True, repair=True, node_name=cfg.node.name)
        self.store.start_writer()
        self.metrics.watch_store(self.store)
        if cfg.metrics.listen:
            self.metrics.serve(cfg.metrics.listen)
        if cfg.path is not None:
            # The CLI run with only --data-dir reads this node's config (routing, tracking path) from here.
            await self.store.write(lambda c: remember_config_path(c, str(Path(cfg.path).resolve())))
        threshold = self.poison_threshold

        def recover(conn):
            # A crash (no clean-stop mark) counts against each message it interrupted the delivery of.
            crashed = conn.execute(meta.select().where(meta.c.key == CLEAN_STOP)).first() is None
            conn.execute(meta.delete().where(meta.c.key == CLEAN_STOP))
            poisoned = mq.count_crashes(conn, threshold) if crashed else []
            return poisoned, mq.recover_after_restart(conn)
        poisoned, recovered = await self.store.write(recover)
        if recovered:
            log.info("crash recovery: %d recipient(s) left Active are Ready again", recovered)
        if cfg.tracking.message_tracking_log_enabled:
            host, _, _ = cfg.frontend.listen.rpartition(":")
            self.tracking = TrackingLog(cfg.tracking_dir, cfg.node.name, server_ip=address_of(host.strip("[]")),
                                        max_file_size=cfg.tracking.message_tracking_log_max_file_size,
                                        software_version=__version__)
        for row in poisoned:
            self.metrics.internal_failures.labels("crash").inc()
            self.poisoned(row, "the node crashed while delivering it")
        self.delivery = DeliveryAgent(self)
        self._tasks.append(asyncio.ensure_future(self.delivery.run()))
        tls_context = None
        if cfg.frontend.tls_certificate:
            tls_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            tls_context.load_cert_chain(cfg.frontend.tls_certificate, cfg.frontend.tls_key)
        counter = ConnectionCounter(cfg.frontend.max_inbound_connection,
                                    cfg.frontend.max_inbound_connection_per_source)
        handler = FrontendHandler(cfg, self.accept, "frontend")
        host, _, port = cfg.frontend.listen.rpartition(":")
        loop = asyncio.get_running_loop()
        server = await loop.create_server(smtp_factory(cfg, handler, counter, tls_context),
                                          host=host.strip("[]"), port=int(port), reuse_address=True)
        self.servers.append(server)
        self.shadow = ShadowManager(self)
        if cfg.transport.listen:
            await self._start_transport(loop)
        self.shadow.start()
        log.info("transportd %s node %s (site %s) serving frontend on %s; queue database %s (ID %s)",
                 __version__, cfg.node.name, cfg.node.site, cfg.frontend.listen, cfg.db_path,
                 self.store.queue_database_id)

    async def _start_transport(self, loop: asyncio.AbstractEventLoop) -> None:
        cfg = self.cfg
        tls_context = None
        if cfg.transport.tls_certificate:
            tls_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            tls_context.load_cert_chain(cfg.transport.tls_certificate, cfg.transport.tls_key)
        counter = ConnectionCounter(cfg.frontend.max_inbound_connection,
                                    max(cfg.frontend.max_inbound_connection_per_source, 100))
        handler = TransportHandler(cfg, self.accept, self.shadow)
        authenticator = make_peer_authenticator({p.name for p in cfg.peers}, cfg.cluster.secret)
        factory = smtp_factory(cfg, handler, counter, tls_context, smtp_class=TransportSMTP,
                               authenticator=authenticator, auth_require_tls=tls_context is not None,
                               require_tls=tls_context is not None)
        host, _, port = cfg.transport.listen.rpartition(":")
        server = await loop.create_server(factory, host=host.strip("[]"), port=int(port), reuse_address=True)
        self.servers.append(server)
        log.info("transport connector for %d peer(s) on %s%s", len(cfg.peers), cfg.transport.listen,
                 " (STARTTLS required)" if tls_context else "")

    async def stop(self) -> None:
        if self.shadow is not None:
            self.shadow.accepting = False
        for s in self.servers:
            s.close()
        for s in self.servers:
            try:
                await asyncio.wait_for(s.wait_closed(), 2)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001
                pass
        if self.shadow is not None:
            await self.shadow.stop()
        if self.delivery is not None:
            await self.delivery.stop()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.metrics.close()
        if self.store is not None:
            try:  # recipients left Active by this stop are not a crash's victims
                await self.store.write(lambda c: c.execute(meta.insert().values(key=CLEAN_STOP, value="1")))
            except Exception as exc:  # noqa: BLE001 - then the next start counts them, as after a crash
                log.error("cannot mark the clean stop: %s", exc)
            self.store.close()
        self.tracking.close()
        self._stopped.set()
        log.info("node %s stopped", self.cfg.node.name)

    # ------------------------------------------------------------------ accept path

    async def accept(self, envelope: Envelope, session: Session, connector: str) -> int:
        """Make the message durable and return its internal id (the 250 follows)."""
        assert self.store is not None
        cfg = self.cfg
        now = time.time()
        if not envelope.rcpt_tos:
            raise MessageRejected(S554_NO_VALID_RECIPIENTS)
        peer = session.peer or ("", 0)
        client_ip = str(peer[0])
        data = envelope.original_content or b""
        from transportd.redundancy.server import peer_name
        netid = (peer_name(session) and _network_id_from(data)) or new_network_message_id()
        prepared = prepare_message(data, node_name=cfg.node.name, client_ip=client_ip,
                                   helo=session.host_name or "", network_message_id=netid, now=now,
                                   connector=connector, tls=session.ssl is not None)
        smtputf8, body_type = received_as(envelope)
        msg = NewMessage(
            network_message_id=netid, data=prepared.data,
            sender="" if envelope.mail_from in (None, "<>") else envelope.mail_from,
            recipients=bifurcate(envelope.rcpt_tos, cfg), received_at=now,
            expires_at=now + cfg.delivery.message_expiration_timeout,
            message_id=prepared.message_id, submit_time=prepared.submit_time, subject=prepared.subject,
            client_ip=client_ip, client_hostname=session.host_name or "", origin="smtp",
            smtputf8=smtputf8, body_type=body_type,
        )
        hops = prepared.data[:65536].count(b"\nReceived:") + prepared.data[:9].lower().startswith(b"received:")
        if hops > cfg.frontend.max_hop_count:
            log.warning("message from %s looped (%d Received headers): refused", client_ip, hops,
                        extra=message_ids({"network_message_id": netid}))
            raise MessageRejected(S554_HOP_COUNT)
        hop_shadow = getattr(envelope, "xshadow_guid", None) and getattr(session, "xshadow_peer", None)
        if hop_shadow:
            # Hop-by-hop (PROTOCOL.md section 3): the sending peer keeps the shadow; we are primary.
            shadow_plan = [(session.xshadow_peer, envelope.xshadow_guid)]
            msg.redundancy = "shadowed"
        elif self.shadow is not None and self.shadow.enabled:
            shadow_plan = []
            msg.redundancy = "pending"
        else:
            shadow_plan = []
        guid = str(uuid.uuid4())
        recipients = list(dict.fromkeys(a for addrs in msg.recipients.values() for a in addrs))

        def commit(conn):
            mid = mq.enqueue(conn, msg)
            for node, g in shadow_plan:
                record_shadow_job(mid, node, g, now)(conn)
            return mid

        local = asyncio.ensure_future(self.store.write(commit))
        remote = None
        if msg.redundancy == "pending":
            remote = asyncio.ensure_future(self.shadow.make_shadow(msg, guid, recipients))
        try:
            internal_id = await local
        except StoreError as exc:
            log.error("queue database unavailable, answering 451: %s", exc,
                      extra=message_ids({"network_message_id": netid}))
            if remote is not None:
                # The peer may now hold a copy nobody will discard: ask it to, if the store lets us.
                result = await remote
                peers = tuple(p for p in (result.peer, *result.uncertain) if p)
                if peers:
                    try:
                        await self.store.write(discard_uncertain_job(peers, guid, now))
                    except StoreError:
                        log.error("could not queue a discard for shadow %s on %s; it expires on its own",
                                  guid, ", ".join(peers), extra=message_ids({"network_message_id": netid}))
            raise MessageRejected(S451_STORE_UNAVAILABLE) from None
        self.accepting.add(internal_id)  # "pending" belongs to this call until it settles
        try:
            shadow_result = None
            shadow_error: Exception | None = None
            if remote is not None:
                try:
                    shadow_result = await remote
                except Exception as exc:  # noqa: BLE001 - the local copy exists: settle it, never strand it
                    shadow_error = exc
                    shadow_result = ShadowResult(None, f"internal error: {exc.__class__.__name__}: {exc}")
            rejecting = (shadow_result is not None and not shadow_result.peer
                         and cfg.shadow_redundancy.reject_message_on_shadow_failure)
            if rejecting:
                await self._settle_redundancy(internal_id, msg, shadow_result, guid, now)  # raises 451 4.4.0
            row = {"id": internal_id, "network_message_id": netid, "message_id": prepared.message_id,
                   "sender": msg.sender, "subject": prepared.subject, "size": len(msg.data),
                   "client_ip": client_ip, "client_hostname": msg.client_hostname}
            self.track("RECEIVE", "SMTP", row, recipients=recipients,
                       source_context=f"{connector}", connector_id=f"{cfg.node.name}\\{connector}",
                       directionality="Incoming", client_ip=client_ip, client_hostname=msg.client_hostname)
            if shadow_result is not None:
                if shadow_result.peer:
                    self.track("HAREDIRECT", "SMTP", row, recipients=recipients,
                               source_context=f"{shadow_result.peer}={shadow_result.reply}")
                else:
                    self.track("HAREDIRECTFAIL", "SMTP", row, recipients=recipients,
                               source_context=shadow_result.reply)
                # Only now may delivery take it: its tracking rows never precede RECEIVE/HAREDIRECT.
                await self._settle_redundancy(internal_id, msg, shadow_result, guid, now)
                if shadow_error is not None:
                    await self.message_failed(row, "shadow", shadow_error)
            log.info("queued message %d (network id %s) from <%s> for %d recipient(s)",
                     internal_id, netid, msg.sender, sum(len(v) for v in msg.recipients.values()),
                     extra=message_ids({"id": internal_id, "network_message_id": netid}))
            if self.delivery is not None:
                self.delivery.wake()
            self.metrics.accept_latency.observe(time.time() - now)
            return internal_id
        finally:
            self.accepting.discard(internal_id)

    async def _settle_redundancy(self, internal_id: int, msg: NewMessage, result: Any, guid: str,
                                 now: float) -> None:
        """Record where the shadow went; with no shadow, accept unprotected or reject (451 4.4.0)."""
        from sqlalchemy import delete, update
        from transportd.queue.store import message_bodies, messages, recipients as recipients_t
        faults.check("settle", msg)
        if result.uncertain:
            await self.store.write(discard_uncertain_job(result.uncertain, guid, now))
        if result.peer:
            def ok(conn):
                record_shadow_job(internal_id, result.peer, guid, now)(conn)
                conn.execute(mq.UPDATE_MESSAGE, {"b_id": internal_id, "redundancy": "shadowed"})
            await self.store.write(ok)
        elif self.cfg.shadow_redundancy.reject_message_on_shadow_failure:
            def drop(conn):
                conn.execute(delete(recipients_t).where(recipients_t.c.message_id == internal_id))
                conn.execute(delete(message_bodies).where(message_bodies.c.message_id == internal_id))
                conn.execute(delete(messages).where(messages.c.id == internal_id))
            await self.store.write(drop)
            log.warning("no shadow could be made (%s): message refused with 451 4.4.0", result.reply,
                        extra=message_ids({"id": internal_id, "network_message_id": msg.network_message_id}))
            raise MessageRejected(S451_NOT_REDUNDANT)
        else:
            await self.store.write(lambda conn: conn.execute(
                update(messages).where(messages.c.id == internal_id).values(redundancy="unprotected")))
        if self.delivery is not None:
            self.delivery.wake()

    # ------------------------------------------------------------------ poison messages

    @property
    def poison_threshold(self) -> int | None:
        d = self.cfg.delivery
        return d.poison_threshold if d.poison_message_detection_enabled else None

    async def message_failed(self, row: dict, step: str, exc: BaseException) -> bool:
        """One message's handling failed with an internal error in ``step`` (any loop): log it with
        its ids and the error, count it towards the Poison queue. Never raises; returns True when
        the message was moved to the Poison queue now."""
        ids = message_ids(row)
        log.error("%s of message %s failed with an internal error: %s: %s", step, ids["internal_message_id"],
                  exc.__class__.__name__, exc, exc_info=exc, extra=ids)
        self.metrics.internal_failures.labels(step).inc()
        if row.get("id") is None or self.store is None:
            return False
        threshold = self.poison_threshold
        try:
            moved = await self.store.write(lambda c: mq.count_internal_failure(c, row["id"], threshold))
        except Exception as err:  # noqa: BLE001 - counting is best effort; the message stays where it is
            log.error("could not count the failure of message %s: %s", row.get("id"), err, extra=ids)
            return False
        if moved:
            self.poisoned(row, f"{step}: {exc.__class__.__name__}: {exc}")
        return moved

    def poisoned(self, row: dict, reason: str) -> None:
        """Tell that a message was moved to the Poison queue (after the commit that moved it)."""
        self.metrics.poisoned.inc()
        log.warning("message %s moved to the Poison queue after %d internal failure(s) (last: %s); "
                    "'transportd message resume %s' releases it, 'message remove' drops it",
                    row.get("id"), self.poison_threshold or 0, reason, row.get("id"), extra=message_ids(row))
        self.track("POISONMESSAGE", "QUEUE", row, source_context=f"PoisonThreshold={self.poison_threshold};{reason}"[:500])

    # ------------------------------------------------------------------ tracking helpers

    def track(self, event_id: str, source: str, row: dict, *, recipients: list[str] | None = None,
              **fields: Any) -> None:
        """Write one tracking row for a message row, move the metrics, log a line; never raises."""
        ids = message_ids(row)
        try:
            self.tracking.write(
                event_id, source,
                internal_message_id=row.get("id"), message_id=row.get("message_id") or "",
                network_message_id=row.get("network_message_id") or "",
                recipients=recipients or [], total_bytes=row.get("size"),
                message_subject=row.get("subject") or "", sender_address=row.get("sender") or "",
                return_path=row.get("sender") or "", **fields)
        except Exception as exc:  # noqa: BLE001 - logging must not fail mail
            log.error("cannot write tracking log (%s %s): %s", event_id, row.get("id"), exc, extra=ids)
        try:
            self.metrics.on_event(event_id, row, str(fields.get("source_context") or ""))
            level = EVENT_LOG_LEVELS.get(event_id, logging.DEBUG)
            if event_id != "RECEIVE" and log.isEnabledFor(level):
                status = fields.get("recipient_status")
                detail = (status[0] if status else "") or fields.get("source_context") or ""
                shown = ", ".join((recipients or [])[:5]) + (" ..." if len(recipients or []) > 5 else "")
                log.log(level, "%s message %s (network id %s)%s%s", event_id, ids["internal_message_id"],
                        ids["network_message_id"], f" for {shown}" if shown else "",
                        f": {detail}" if detail else "", extra=ids)
        except Exception as exc:  # noqa: BLE001 - metrics and logs must not fail mail
            log.error("cannot record %s for message %s: %s", event_id, row.get("id"), exc, extra=ids)

    def log_dsn(self, original: dict, dsn_id: int, dsn: NewMessage) -> None:
        self.track("DSN", "DSN", {"id": dsn_id, "network_message_id": dsn.network_message_id,
                                  "message_id": dsn.message_id, "sender": "", "subject": dsn.subject,
                                  "size": len(dsn.data)},
                   recipients=[a for v in dsn.recipients.values() for a in v],
                   reference=original.get("message_id") or "",
                   related_recipient_address=original.get("sender") or "",
                   source_context=f"original internal id {original.get('id')}; "
                                  f"network id {original.get('network_message_id')}")


# ---------------------------------------------------------------------- logging set-up

class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
               "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        for key in ("internal_message_id", "network_message_id", "node"):
            if hasattr(record, key):
                out[key] = getattr(record, key)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = [f"{k}={'-' if getattr(record, k) in (None, '') else getattr(record, k)}"
               for k in ("internal_message_id", "network_message_id") if hasattr(record, k)]
        return line + (" [" + " ".join(ids) + "]" if ids else "")


def setup_logging(level: str = "info", fmt: str = "text", name: str = "") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        prefix = f"{name} " if name else ""
        handler.setFormatter(TextFormatter(f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    for noisy in ("aiosmtpd", "aiosmtplib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("mail.log").setLevel(logging.ERROR)  # aiosmtpd's per-line chatter and deprecations


def serve(cfg: Config) -> int:
    """Run the node until SIGTERM/SIGINT. Returns the process exit code."""
    try:
        import uvloop  # noqa: F401
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    return asyncio.run(_serve(cfg))


async def _serve(cfg: Config) -> int:
    node = Node(cfg)
    try:
        await node.start()
    except OSError as exc:
        log.error("cannot start: %s", exc)
        if node.store is not None:
            node.store.close()
        return 1
    except StoreError as exc:
        log.error("cannot start: %s", exc)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"transportd: {cfg.node.name} ready on {cfg.frontend.listen}", file=sys.stderr, flush=True)
    await stop.wait()
    log.info("shutting down")
    await node.stop()
    return 0
