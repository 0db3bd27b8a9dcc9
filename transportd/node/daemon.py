"""The node: one process, one event loop; it builds every part, starts them in order and stops them.

It owns start-up (open or repair the queue database, crash recovery and the
crash count of the Poison queue, the tracking log, the metrics endpoint, the
listeners of the frontend and transport connectors with their TLS), wiring the
parts together (accept path, Shadow Redundancy Manager, scheduler and
connectors, event fan-out), and a clean stop on SIGTERM/SIGINT (the clean-stop
mark a crash lacks). It holds no message logic of its own.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from transportd import __version__
from transportd.config import Config, frontend_bindings, tracking_fields, worker_count
from transportd.errors import NodeNameMismatch, StoreError
from transportd.node import datalock
from transportd.node.accept import AcceptPath
from transportd.node.connectors import DeliveryDrain, MailboxConnector, PeerConnector, SmtpConnector
from transportd.node.events import NodeEvents
from transportd.node.handling import HandlingMark
from transportd.node.maintenance import Maintenance
from transportd.node.metrics import NodeMetrics
from transportd.node.outcomes import OutcomeRecorder
from transportd.node.scheduler import Scheduler
from transportd.node.sessions import NodeSessions, SessionTable
from transportd.node.workers import WorkerSupervisor, per_process
from transportd.queue import admin
from transportd.queue import messages as mq
from transportd.queue import shadows as sq
from transportd.queue.delivered import DeliveredLog
from transportd.queue.mailbox import MailboxStore
from transportd.queue.routing import MAILBOX, PEER, route_config
from transportd.queue.store import DATABASE_ERRORS, QueueStore, db_error_text
from transportd.redundancy.manager import ShadowManager
from transportd.redundancy.server import TransportHandler, TransportSMTP, make_peer_authenticator
from transportd.smtp.frontend import FrontendHandler
from transportd.smtp.server import (
    ConnectionCounter,
    check_unused,
    implicit_tls_bindings,
    say_shutting_down,
    serve_binding,
    smtp_factory,
)
from transportd.smtp.tls import server_tls
from transportd.tracking import TrackingLog

log = logging.getLogger("transportd")


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


async def reroute_at_start(cfg: Config, store: QueueStore) -> None:
    """Queued mail goes by the routing of the configuration the node starts with
    (``mq.reroute_queued``): a changed smart host, send connector or mailbox database owner
    applies to the messages already waiting, not only to new ones."""
    moved, held = await store.write(lambda c: mq.reroute_queued(
        c, lambda address: route_config(address, cfg), time.time()))
    for (old, new), n in sorted(moved.items()):
        log.info("routing: %d queued recipient(s) of queue %s now go to queue %s (the configuration's "
                 "routing changed)", n, old, new)
    for (old, new), n in sorted(held.items()):
        log.warning("routing: %d queued recipient(s) of the suspended queue %s route to queue %s now; they "
                    "stay held there (the hold is the queue's); to send them by the new route, stop the node, "
                    "run 'transportd queue resume %s' and start it again", n, old, new, old)


class Node:
    def __init__(self, cfg: Config, log_format: str = "text"):
        self.cfg = cfg
        self.log_format = log_format
        self.workers: WorkerSupervisor | None = None
        self.store: QueueStore | None = None
        self.metrics = NodeMetrics(cfg.node.name, cfg.metrics.max_queue_series)
        self.events = NodeEvents(cfg, self.metrics)
        self.mailboxes = MailboxStore(cfg.mailbox_dir, cfg.node.name)
        self.delivered = DeliveredLog(cfg.mailbox_dir)
        self.shadow: ShadowManager | None = None
        self.accept_path: AcceptPath | None = None
        self.scheduler: Scheduler | None = None
        self.servers: list[asyncio.AbstractServer] = []
        self._tasks: list[asyncio.Task] = []
        self._data_lock: int | None = None

    async def start(self) -> None:
        cfg = self.cfg
        if cfg.data_dir.exists() and not cfg.data_dir.is_dir():
            raise OSError(f"node.data_dir: {cfg.data_dir} is not a folder")
        if cfg.tracking.message_tracking_log_enabled and cfg.tracking_dir.exists() and not cfg.tracking_dir.is_dir():
            raise OSError(f"tracking.message_tracking_log_path: {cfg.tracking_dir} is not a folder")
        try:
            cfg.data_dir.mkdir(parents=True, exist_ok=True)
            self._data_lock = datalock.take(cfg.data_dir)  # one node per data dir (DataDirInUse: an OSError)
        except datalock.DataDirInUse:
            raise
        except OSError as exc:  # a read-only mount, no permission: the key, the folder and the reason
            raise OSError(f"node.data_dir {cfg.data_dir}: {exc.strerror or exc}") from None
        self.events.handling, crashed_in = HandlingMark.open(cfg.data_dir)
        self.store = store = QueueStore.open(cfg.db_path, create=True, repair=True, node_name=cfg.node.name)
        check_node_name(cfg, store)
        store.start_writer()
        self.events.store = store
        self.metrics.watch_store(store)
        if cfg.metrics.listen:
            try:
                self.metrics.serve(cfg.metrics.listen)
            except OSError as exc:
                raise listen_error("metrics.listen", cfg.metrics.listen, exc) from None
        if cfg.path is not None:
            # The CLI run with only --data-dir reads this node's config (routing, tracking path) from here.
            await store.write(lambda c: mq.remember_config_path(c, str(Path(cfg.path).resolve())))
        threshold = self.events.poison_threshold
        poisoned, recovered = await store.write(
            lambda c: mq.recover_at_start(c, threshold, [mid for mid, _ in crashed_in]))
        self.events.handling.clear()  # counted (a start that failed before this counts them next time)
        if recovered:
            log.info("crash recovery: %d recipient(s) left Active are Ready again", recovered)
        await reroute_at_start(cfg, store)
        await self._move_legacy_delivered_to(store)
        if cfg.tracking.message_tracking_log_enabled:
            host, _, _ = cfg.frontend.listen[0].rpartition(":")
            try:
                self.events.tracking = TrackingLog(
                    cfg.tracking_dir, cfg.node.name, server_ip=address_of(host.strip("[]")),
                    max_file_size=cfg.tracking.message_tracking_log_max_file_size, software_version=__version__,
                    fields=tracking_fields(cfg),
                    subject_logging=cfg.tracking.message_tracking_log_subject_logging_enabled)
            except OSError as exc:  # the path is a file, or cannot be made
                raise OSError(f"tracking.message_tracking_log_path {cfg.tracking_dir}: "
                              f"{exc.strerror or exc}") from None
        steps = dict(crashed_in)
        for row in poisoned:
            self.metrics.internal_failures.labels("crash").inc()
            self.events.poisoned(row, f"the node crashed while handling it (step {steps.get(row['id'], '?')})")
        self.shadow = ShadowManager(cfg, store, self.events)
        if self.shadow.enabled:
            # shadow_copies raised since the queued mail came: it gets the new protection too.
            wanted = cfg.shadow_redundancy.shadow_copies
            partial = await store.write(lambda c: sq.want_shadow_copies(c, wanted))
            if partial:
                log.info("shadow_copies is %d: %d queued message(s) with fewer shadows get the missing ones "
                         "in the heartbeat rounds to come", wanted, partial)
        self.accept_path = AcceptPath(cfg, store, self.events, self.shadow)
        recorder = OutcomeRecorder(cfg, store, self.events)
        drain, handling = DeliveryDrain(), self.events.handling
        self.scheduler = Scheduler(cfg, store, recorder,
                                   Maintenance(cfg, store, self.events, recorder, self.delivered),
                                   {MAILBOX: MailboxConnector(cfg, store, self.mailboxes, self.delivered,
                                                              handling=handling),
                                    PEER: PeerConnector(cfg, store, self.shadow, handling=handling, drain=drain),
                                    "smtp": SmtpConnector(cfg, store, handling=handling, drain=drain)},
                                   on_pass=self.metrics.scheduler_passes.inc, drain=drain)
        self._tasks.append(asyncio.ensure_future(self.scheduler.run()))
        await self._listen_frontend()
        if cfg.transport.listen:
            await self._listen_transport()
        self.shadow.start()
        log.info("transportd %s node %s (site %s) serving frontend on %s; queue database %s (ID %s)",
                 __version__, cfg.node.name, cfg.node.site, frontend_bindings(cfg), cfg.db_path,
                 store.queue_database_id)
        if "." not in cfg.node.name:
            log.warning("node.name %r is not fully qualified: next hops that check the EHLO name (RFC 5321 "
                        "4.1.1.1; Postfix's reject_non_fqdn_helo_hostname) may refuse this node's mail; set "
                        "node.name to its FQDN", cfg.node.name)

    async def _serve(self, key: str, listen: str, factory: Any, reuse_port: bool = False, **tls: Any) -> None:
        try:
            if reuse_port:  # the workers join this listener; nobody else's may be joined
                check_unused(listen)
            self.servers.append(await serve_binding(listen, factory, reuse_port=reuse_port or None, **tls))
        except OSError as exc:
            raise listen_error(key, listen, exc) from None

    async def _listen_frontend(self) -> None:
        """The frontend in this process and, with ``frontend.workers`` > 1, in receive workers
        bound to the same address (SO_REUSEPORT), each with its share of the limits."""
        processes = worker_count(self.cfg)
        cfg = per_process(self.cfg, processes)
        fe = cfg.frontend
        if processes > 1:
            sessions = SessionTable(processes)
            counter = sessions.counter(0, fe.max_inbound_connection, fe.max_inbound_connection_per_source)
            self.metrics.watch_connections("frontend", NodeSessions(sessions, fe.max_inbound_connection))
        else:
            counter = ConnectionCounter(fe.max_inbound_connection, fe.max_inbound_connection_per_source)
            self.metrics.watch_connections("frontend", counter)
        handler = FrontendHandler(cfg, self.accept_path.accept, "frontend")
        tls = server_tls(fe.tls_certificate, fe.tls_key, cfg.node.tls_certificate_check_interval, "frontend")
        factory = smtp_factory(cfg, handler, counter, tls)
        for listen in fe.listen:  # one server per binding, all sharing the session counter and limits
            await self._serve("frontend.listen", listen, factory, reuse_port=processes > 1)
        for listen, implicit, options in implicit_tls_bindings(cfg, handler, counter, tls):
            await self._serve("frontend.implicit_tls_listen", listen, implicit, reuse_port=processes > 1, **options)
        if processes > 1:
            self.workers = WorkerSupervisor(cfg, processes - 1, self.events, self.store.queue_changed,
                                            self.log_format, sessions)
            await self.workers.start()

    async def _listen_transport(self) -> None:
        cfg = self.cfg
        tls_context = server_tls(cfg.transport.tls_certificate, cfg.transport.tls_key,
                                 cfg.node.tls_certificate_check_interval, "transport")
        counter = ConnectionCounter(cfg.frontend.max_inbound_connection,
                                    max(cfg.frontend.max_inbound_connection_per_source, 100))
        self.metrics.watch_connections("transport", counter)
        handler = TransportHandler(cfg, self.accept_path.accept, self.shadow)
        for name in sorted(self.shadow.former_peers):
            log.warning("%s, no longer a configured peer, holds shadows of this node's messages: it may still "
                        "authenticate for its heartbeats (XSHADOW, XQDISCARD, XQSTATUS), nothing else", name)
        authenticator = make_peer_authenticator({p.name for p in cfg.peers} | self.shadow.former_peers,
                                                cfg.cluster.secret)
        await self._serve("transport.listen", cfg.transport.listen, smtp_factory(
            cfg, handler, counter, tls_context, smtp_class=TransportSMTP, authenticator=authenticator,
            auth_require_tls=tls_context is not None, require_tls=tls_context is not None,
            chunking=cfg.transport.chunking_enabled))
        log.info("transport connector for %d peer(s) on %s%s", len(cfg.peers), cfg.transport.listen,
                 " (STARTTLS required)" if tls_context else "")

    async def _move_legacy_delivered_to(self, store: QueueStore) -> None:
        """DeliveredTo rows an older version kept in the queue database go to the mailbox store's
        records (copied, then dropped here: a crash in between only copies them again)."""
        moved = 0
        try:
            while rows := await store.aread(lambda c: mq.legacy_delivered_to(c)):
                await asyncio.to_thread(self.delivered.merge, rows)
                await store.write(lambda c, r=rows: mq.drop_legacy_delivered_to(c, r))
                moved += len(rows)
        except (OSError, StoreError) as exc:  # tried again at the next start; duplicates possible meanwhile
            log.error("cannot move DeliveredTo records from the queue database: %s", exc)
        if moved:
            log.info("%d DeliveredTo record(s) moved from the queue database to %s", moved, self.delivered.path)

    async def stop(self) -> None:
        # Deliveries first: no new work from now on, while a transaction under way gets its grace
        # (delivery.stop_grace_time) as the listeners and receive workers stop beside it.
        deliveries = asyncio.ensure_future(self.scheduler.stop()) if self.scheduler is not None else None
        if self.shadow is not None:
            self.shadow.accepting = False
        for s in self.servers:
            s.close()
        told = say_shutting_down()
        if told:
            log.info("told %d open session(s) 421 4.3.2 Service shutting down", told)
        if self.workers is not None:
            await self.workers.stop()
        for s in self.servers:
            try:
                await asyncio.wait_for(s.wait_closed(), 2)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001
                pass
        if self.shadow is not None:
            await self.shadow.stop()
        if deliveries is not None:
            await deliveries
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.metrics.close()
        if self.store is not None:
            try:  # no crash: the next start counts nothing against the messages (node/handling.py)
                cut = await self.store.write(mq.mark_clean_stop)
                if cut:
                    log.info("%d recipient(s) whose delivery the stop cut are Ready again", cut)
            except Exception as exc:  # noqa: BLE001 - the handling mark is empty: the next start counts none
                log.error("cannot mark the clean stop: %s", exc)
            self.store.close()
        self.delivered.close()
        self.events.tracking.close()
        if self.events.tracking.pending_rows:
            log.error("%d tracking row(s) kept after failed writes could not be written at the stop",
                      self.events.tracking.pending_rows)
        self.release_data_dir()
        log.info("node %s stopped", self.cfg.node.name)

    def release_data_dir(self) -> None:
        """The data dir's lock, given back (another node may start on it)."""
        self.events.handling.close()
        if self._data_lock is not None:
            os.close(self._data_lock)
            self._data_lock = None


def check_node_name(cfg: Config, store: QueueStore) -> None:
    """The queue database was run under another node.name (a renamed node, or a node started on a
    copy of another's data dir): refused while it holds mail peers know under that name or that
    the other node may deliver too (each message would be delivered twice); else the new name is
    recorded."""
    name = cfg.node.name
    recorded, held = store.transaction(lambda c: admin.adopt_node_name(c, name))
    if held:
        what = ", ".join(f"{n} {label}" for label, n in held.items())
        raise NodeNameMismatch(
            f"node.name: {name}: the queue database {cfg.db_path} was run as node {recorded} and holds {what} "
            f"under that name; start it with node.name = {recorded!r}, or drain it first under its old name "
            "(transportd redirect, until it holds nothing), or start it on an empty node.data_dir")
    if recorded is not None and recorded.lower() != name.lower():
        log.warning("node.name changed from %s to %s (its queue database holds nothing under the old name)",
                    recorded, name)


def listen_error(key: str, listen: str, exc: OSError) -> OSError:
    """A listener that could not be opened (an address in use, not on this host...), as the one
    line that stops the start: the key, the address and the reason."""
    if isinstance(exc, socket.gaierror):  # a host that does not resolve: its errno is no OS error
        reason = f"no such address ({exc.strerror})"
    else:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
    return OSError(f"{key} {listen}: cannot listen: {reason}")


def serve(cfg: Config, log_format: str = "text") -> int:
    """Run the node until SIGTERM/SIGINT. Returns the process exit code."""
    try:
        import uvloop  # noqa: F401
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    return asyncio.run(_serve(cfg, log_format))


async def _serve(cfg: Config, log_format: str) -> int:
    node = Node(cfg, log_format)
    try:
        await node.start()
    except OSError as exc:
        log.error("cannot start: %s", exc)
        if node.store is not None:
            node.store.close()
        node.release_data_dir()
        return 1
    except StoreError as exc:
        log.error("cannot start: %s", exc)
        node.release_data_dir()
        return 1
    except NodeNameMismatch as exc:  # as a bad config: exit 2, one line
        log.error("cannot start: %s", exc)
        node.store.close()
        node.release_data_dir()
        return 2
    except DATABASE_ERRORS as exc:  # e.g. a queue database file made read-only
        log.error("cannot start: queue database %s cannot be used: %s", cfg.db_path,
                  db_error_text(exc))
        if node.store is not None:
            node.store.close()
        node.release_data_dir()
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # A hangup (a closed terminal, a reload habit) must not kill the node as a crash would.
    loop.add_signal_handler(signal.SIGHUP, lambda: log.warning(
        "SIGHUP: nothing to reload, the node reads its configuration at start; to apply a change, "
        "stop it (SIGTERM) and start it again"))
    log.info("%s ready on %s", cfg.node.name, frontend_bindings(cfg))  # a log line: JSON with --log-format json
    await stop.wait()
    log.info("shutting down")
    await node.stop()
    return 0
