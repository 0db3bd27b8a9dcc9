"""A loopback TCP fault proxy placed on the links between cluster nodes.

Each directed peer link (node A's sessions to node B's transport connector) goes
through its own listening port here, so the nemesis can act on the link between
two nodes without touching the nodes: ``cut`` (a partition: connections are
accepted and bytes are swallowed, so the peer runs into its timeouts), ``delay``
(every chunk held back, both directions), ``reset`` (every open connection ends
with a TCP RST and new ones are reset at once) and ``ok``. It runs its own event
loop in a daemon thread and only ever listens on 127.0.0.0/8.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from dataclasses import dataclass, field


@dataclass
class Link:
    name: str
    listen: tuple[str, int]
    target: tuple[str, int]
    mode: str = "ok"          # ok | cut | reset
    delay: float = 0.0
    conns: set = field(default_factory=set)
    opened: int = 0


def _abort_with_rst(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class FaultProxy:
    def __init__(self) -> None:
        self.links: dict[str, Link] = {}
        self.loop = asyncio.new_event_loop()
        self._servers: list[asyncio.AbstractServer] = []
        self._thread = threading.Thread(target=self.loop.run_forever, name="fault-proxy", daemon=True)

    # -- set-up (harness thread) -----------------------------------------------------

    def add(self, name: str, listen: tuple[str, int], target: tuple[str, int]) -> Link:
        if not listen[0].startswith("127.") or not target[0].startswith("127."):
            raise ValueError("the fault proxy stays on loopback")
        link = Link(name, listen, target)
        self.links[name] = link
        return link

    def start(self) -> None:
        self._thread.start()
        for link in self.links.values():
            fut = asyncio.run_coroutine_threadsafe(self._listen(link), self.loop)
            self._servers.append(fut.result(10))

    async def _listen(self, link: Link) -> asyncio.AbstractServer:
        return await asyncio.start_server(lambda r, w: self._serve(link, r, w), host=link.listen[0],
                                          port=link.listen[1], reuse_address=True)

    def stop(self) -> None:
        async def close() -> None:
            for s in self._servers:
                s.close()
            for link in self.links.values():
                for w in list(link.conns):
                    w.transport.abort()
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)

    # -- faults (harness thread) -----------------------------------------------------

    def set(self, names: list[str], mode: str = "ok", delay: float = 0.0) -> None:
        """Put links into a mode; ``reset`` and ``cut`` also end (RST) every open connection."""
        def apply() -> None:
            for n in names:
                link = self.links[n]
                link.mode, link.delay = mode, delay
                if mode in ("reset", "cut"):
                    for w in list(link.conns):
                        _abort_with_rst(w)
        self.loop.call_soon_threadsafe(apply)

    def heal(self) -> None:
        self.set(list(self.links), "ok", 0.0)

    # -- connections (proxy loop) ----------------------------------------------------

    async def _serve(self, link: Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link.opened += 1
        if link.mode == "reset":
            _abort_with_rst(writer)
            return
        link.conns.add(writer)
        upstream: asyncio.StreamWriter | None = None
        try:
            if link.mode == "cut":
                while await reader.read(65536):  # a black hole: the peer waits for its timeouts
                    pass
                return
            try:
                up_reader, upstream = await asyncio.open_connection(*link.target)
            except OSError:
                _abort_with_rst(writer)
                return
            link.conns.add(upstream)
            await asyncio.gather(self._pump(link, reader, upstream), self._pump(link, up_reader, writer),
                                 return_exceptions=True)
        finally:
            link.conns.discard(writer)
            if upstream is not None:
                link.conns.discard(upstream)
                upstream.transport.abort()
            writer.transport.abort()

    async def _pump(self, link: Link, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await src.read(65536)
                if not data:
                    break
                if link.mode == "cut":
                    continue  # swallowed
                if link.delay:
                    await asyncio.sleep(link.delay)
                dst.write(data)
                await dst.drain()
        finally:
            dst.transport.abort() if link.mode != "ok" else _close(dst)


def _close(w: asyncio.StreamWriter) -> None:
    try:
        if w.can_write_eof():
            w.write_eof()
    except (OSError, RuntimeError):
        w.transport.abort()
