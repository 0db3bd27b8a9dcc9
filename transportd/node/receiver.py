"""One receive worker process: the frontend's accept path, and nothing else, beside the node's owner.

It owns running the frontend receive connector in a worker (node/workers.py
starts it): the shared queue database opened as it is (never created, repaired or
recovered: the owner did that before starting any worker) with this process's own
group-commit writer, the accept path with shadow copies through its own peer
sessions, and the link back to the owner (tracking rows, metric moves, open
sessions, "queue changed"). It stops on SIGTERM after closing its listener and
letting the sessions in progress finish (up to a few seconds), or at once when
the owner's end of the link closes. It never delivers, never serves X-verbs and
never writes the tracking log itself.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import pickle
import signal
import socket
import sys
from typing import Any

from transportd.config import Config, frontend_bindings
from transportd.errors import StoreError
from transportd.node.accept import AcceptPath
from transportd.node.events import NodeEvents
from transportd.node.sessions import SessionTable
from transportd.node.workers import TERMINAL, encode
from transportd.queue.store import QueueStore
from transportd.redundancy.manager import ShadowManager
from transportd.smtp.frontend import FrontendHandler
from transportd.smtp.server import (
    implicit_tls_bindings,
    say_shutting_down,
    serve_binding,
    smtp_factory,
)
from transportd.smtp.tls import server_tls

log = logging.getLogger("transportd.node.receiver")


class Forward:
    """A metric or tracking log in the owner's process, reached through the worker's socket pair:
    attribute reads and calls are recorded and sent when a terminal call (inc, observe,
    write...) is made."""

    def __init__(self, send: Any, kind: str, steps: tuple = ()):
        self._send = send
        self._kind = kind
        self._steps = steps

    def __getattr__(self, name: str) -> Forward:
        return Forward(self._send, self._kind, (*self._steps, name))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._kind == "track":
            self._send(("track", args, kwargs))
            return None
        steps = (*self._steps, (args, kwargs))
        if self._steps and self._steps[-1] in TERMINAL:
            self._send(("metric", steps))
            return None
        return Forward(self._send, self._kind, steps)


class ForwardedTracking:
    """A worker's tracking log: each row goes to the owner, whose log writes it (and keeps the
    rows a full volume refuses: none wait here)."""
    pending_rows = dropped_rows = 0

    def __init__(self, send: Any):
        self.write = Forward(send, "track")

    def close(self) -> None:
        pass


def _die_with_owner(owner: int) -> None:
    """PR_SET_PDEATHSIG: the kernel kills this worker when the owner dies (even by SIGKILL)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != owner:  # the owner died before the call
        os._exit(1)


def worker_entry() -> None:
    """The worker process: its settings come pickled on stdin from the owner (never a file)."""
    spec = pickle.loads(sys.stdin.buffer.read())
    _die_with_owner(spec["owner"])
    cfg: Config = spec["cfg"]
    from transportd.node.logs import setup_logging
    setup_logging(cfg.node.log_level, spec["log_format"], f"{cfg.node.name}/w{spec['index']}")
    try:
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    sys.exit(asyncio.run(ReceiveWorker(cfg, spec["index"], spec["fd"],
                                           SessionTable(spec["processes"], spec["sessions_fd"])).run()))


class ReceiveWorker:
    def __init__(self, cfg: Config, index: int, fd: int, sessions: SessionTable):
        self.cfg = cfg
        self.index = index
        self.sessions = sessions
        self.fd = fd
        self._writer: asyncio.StreamWriter | None = None

    def send(self, frame: tuple) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(encode(frame))

    async def run(self) -> int:
        cfg = self.cfg
        reader, self._writer = await asyncio.open_connection(sock=socket.socket(fileno=self.fd))
        try:
            store = QueueStore.open(cfg.db_path, create=False, repair=False, node_name=cfg.node.name)
        except StoreError as exc:
            log.error("receive worker %d cannot open the queue database: %s", self.index, exc)
            return 1
        store.start_writer()
        events = NodeEvents(cfg, Forward(self.send, "metric"), store, ForwardedTracking(self.send))
        shadow = ShadowManager(cfg, store, events)
        accept_path = AcceptPath(cfg, store, events, shadow)
        fe = cfg.frontend
        self.sessions.clear(self.index)
        counter = self.sessions.counter(self.index, fe.max_inbound_connection, fe.max_inbound_connection_per_source)
        loop = asyncio.get_running_loop()
        handler = FrontendHandler(cfg, accept_path.accept, "frontend")
        tls = server_tls(fe.tls_certificate, fe.tls_key, cfg.node.tls_certificate_check_interval, "frontend")
        factory = smtp_factory(cfg, handler, counter, tls)
        servers = [await serve_binding(listen, factory, reuse_port=True) for listen in fe.listen]
        for listen, implicit, options in implicit_tls_bindings(cfg, handler, counter, tls):
            servers.append(await serve_binding(listen, implicit, reuse_port=True, **options))
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, lambda: None)  # Ctrl-C reaches the owner, which stops us
        loop.add_signal_handler(signal.SIGHUP, lambda: None)  # a hangup of the group: the owner says it
        tasks = [asyncio.ensure_future(self._report(store, stop)),
                 asyncio.ensure_future(self._owner_gone(reader, stop))]
        log.info("receive worker %d (pid %d) serving the frontend on %s", self.index, os.getpid(),
                 frontend_bindings(cfg))
        await stop.wait()
        for server in servers:
            server.close()
        say_shutting_down()
        try:
            await asyncio.wait_for(asyncio.gather(*(server.wait_closed() for server in servers)), 5)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - stopping anyway
            pass
        shadow.pool.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        store.close()
        self._writer.close()
        return 0

    async def _report(self, store: QueueStore, stop: asyncio.Event) -> None:
        """'Queue changed' as soon as a commit made work due (open sessions are in the shared table)."""
        changed = store.queue_changed
        while not stop.is_set():
            try:
                await asyncio.wait_for(changed.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
            if changed.is_set():
                changed.clear()
                self.send(("wake",))

    async def _owner_gone(self, reader: asyncio.StreamReader, stop: asyncio.Event) -> None:
        try:
            await reader.read()  # the owner never writes: EOF means it is gone
        finally:
            if not stop.is_set():
                log.error("receive worker %d: the node's owner process is gone; stopping", self.index)
            stop.set()

