"""Receive worker processes: the frontend served by several processes of one node.

It owns ``frontend.workers``: the node's process (the owner: delivery, the Shadow
Redundancy Manager, the transport connector's X-verbs, the tracking log and the
metrics) serves the frontend itself and starts ``workers - 1`` receive processes
that bind the same address with SO_REUSEPORT, so the kernel spreads new sessions
over all of them. A worker runs the whole accept path (the local commit through
its own group-commit writer on the shared queue database in WAL mode, the shadow
copy to a peer, the 250) and forwards what the owner must know over a socket
pair: tracking rows, metric moves, and "queue changed" after a commit that made
work due, so the scheduler takes a worker's message at once (its open sessions
are in the shared session table, which the metrics read).
The owner restarts a worker that dies; a worker dies with the owner
(PR_SET_PDEATHSIG, and the socket pair's end). The worker's side is
node/receiver.py. Nothing here delivers, runs heartbeats or promotions, or
serves X-verbs.

The frontend's connection limits are checked against the sessions of every
process (node/sessions.py); its command rate per source is split between the
processes (rounded up).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import pickle
import signal
import struct
import subprocess
import sys
import time
from typing import Any

from transportd.config import Config
from transportd.node.sessions import SessionTable

log = logging.getLogger("transportd.node.workers")

FRAME = struct.Struct("!I")
TERMINAL = {"inc", "dec", "set", "observe", "on_event"}  # metric calls a worker forwards
RESTART_DELAYS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # a worker dying again soon waits longer


def per_process(cfg: Config, processes: int) -> Config:
    """The config one of ``processes`` receive processes runs with: the frontend's command rate
    per source divided between them (rounded up). The connection limits stay the node's: every
    process checks them against the sessions of all (``node.sessions``)."""
    if processes <= 1:
        return cfg
    fe = cfg.frontend
    return dataclasses.replace(cfg, frontend=dataclasses.replace(
        fe, max_command_rate=math.ceil(fe.max_command_rate / processes)))


def encode(obj: Any) -> bytes:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return FRAME.pack(len(body)) + body


def replay(obj: Any, steps: tuple) -> Any:
    """Apply a forwarded metric call (attribute names and calls' arguments, in order) to ``obj``."""
    for step in steps:
        obj = getattr(obj, step) if isinstance(step, str) else obj(*step[0], **step[1])
    return obj


async def read_frame(reader: asyncio.StreamReader) -> Any:
    head = await reader.readexactly(FRAME.size)
    return pickle.loads(await reader.readexactly(FRAME.unpack(head)[0]))


# ====================================================================== the owner's side

class WorkerSupervisor:
    """Starts the receive workers, applies what they report, restarts one that dies, stops them."""

    def __init__(self, cfg: Config, count: int, events: Any, queue_changed: asyncio.Event,
                 log_format: str, sessions: SessionTable):
        self.cfg = cfg
        self.sessions = sessions
        self.count = count  # worker processes besides the owner
        self.events = events
        self.queue_changed = queue_changed
        self.log_format = log_format
        self.procs: dict[int, subprocess.Popen] = {}
        self.restarts = 0
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values() if p.poll() is None]

    async def start(self) -> None:
        for index in range(1, self.count + 1):
            self._tasks.append(asyncio.ensure_future(self._keep(index)))

    async def _keep(self, index: int) -> None:
        """Run worker ``index``; when it dies, start it again (waiting longer if it keeps dying)."""
        failures = 0
        while not self._stopping:
            started = time.monotonic()
            code = await self._run_one(index)
            if self._stopping:
                return
            failures = 0 if time.monotonic() - started > 60 else failures + 1
            delay = RESTART_DELAYS[min(failures, len(RESTART_DELAYS)) - 1] if failures else RESTART_DELAYS[0]
            log.error("receive worker %d exited (%s); starting it again in %gs", index,
                      f"signal {-code}" if code is not None and code < 0 else f"code {code}", delay)
            self.sessions.clear(index)  # its sessions are gone with it
            self.restarts += 1
            self.events.metrics.worker_restarts.inc()
            await asyncio.sleep(delay)

    async def _run_one(self, index: int) -> int | None:
        import socket
        ours, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", "from transportd.node.receiver import worker_entry; worker_entry()"],
                stdin=subprocess.PIPE, pass_fds=(theirs.fileno(), self.sessions.fd), close_fds=True)
        except OSError as exc:
            ours.close()
            theirs.close()
            log.error("cannot start receive worker %d: %s", index, exc)
            return None
        theirs_fd = theirs.fileno()
        try:
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps({"cfg": self.cfg, "index": index, "fd": theirs_fd, "owner": os.getpid(),
                                           "log_format": self.log_format, "sessions_fd": self.sessions.fd,
                                           "processes": self.sessions.processes}))
            proc.stdin.close()
        except OSError:
            pass
        finally:
            theirs.close()
        self.procs[index] = proc
        reader, writer = await asyncio.open_connection(sock=ours)
        try:
            while True:
                try:
                    frame = await read_frame(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
                self._apply(index, frame)
        finally:
            writer.close()
        while proc.poll() is None:  # its end of the pair is closed: it is going or gone
            await asyncio.sleep(0.05)
        return proc.returncode

    def _apply(self, index: int, frame: Any) -> None:
        try:
            kind = frame[0]
            if kind == "wake":
                self.queue_changed.set()
            elif kind == "track":
                self._track(index, frame[1], frame[2])
            elif kind == "metric":
                replay(self.events.metrics, frame[1])
        except Exception as exc:  # noqa: BLE001 - a report that cannot be applied is logged, mail goes on
            log.error("receive worker %d: cannot apply %r: %s", index, frame[:1], exc)

    def _track(self, index: int, args: Any, fields: dict) -> None:
        """A worker's tracking row; one the file refuses (a full disk) is kept by the log and written
        before the next one, as the node's own are, and said so."""
        tracking = self.events.tracking
        try:
            tracking.write(*args, **fields)
        except OSError as exc:
            log.error("cannot write tracking log (a row of receive worker %d): %s; %d row(s) kept to write "
                      "when it can (%d given up)", index, exc, tracking.pending_rows, tracking.dropped_rows)

    async def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every worker (each finishes the sessions it can within its grace), SIGKILL the rest."""
        self._stopping = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
