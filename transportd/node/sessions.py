"""The frontend's open sessions counted over all of a node's receive processes.

With ``frontend.workers`` > 1 the kernel spreads connections over the owner and its workers
(SO_REUSEPORT), and not evenly: a client that keeps N sessions open has most of them on the
slowest process, since a session lasts longer there. Limits split between the processes would
refuse such a client far below the node's ``max_inbound_connection_per_source``. So every
process counts its sessions in one table in shared memory (a memfd the owner creates and hands
to each worker) and checks the node's limits against the sum over all processes.

The table has one row per process (the owner is row 0, worker i row i); a row holds the
process's open sessions per source-address bucket (CRC-32 of the address, 16,384 buckets) and its
total. A process writes only its own row, so no lock is needed; reading the other rows while
they change can admit at most the sessions accepted in the same instant by other processes. Two
source addresses in one bucket share its count: a limit can only be stricter for them, never
looser. A worker that dies leaves its row behind: the owner clears it before starting the worker
again, and a starting worker clears its own.
"""

from __future__ import annotations

import mmap
import os
import zlib

from transportd.smtp import replies

BUCKETS = 16_384
CELL = 4  # bytes of one counter (a native int)


class SessionTable:
    """The shared counters of ``processes`` receive processes, in a memfd (``fd``) both sides map."""

    def __init__(self, processes: int, fd: int | None = None):
        self.processes = processes
        self.row = BUCKETS + 1  # the buckets, then the process's total
        size = processes * self.row * CELL
        if fd is None:
            fd = os.memfd_create("transportd-frontend-sessions")
            os.ftruncate(fd, size)
        self.fd = fd
        self._map = mmap.mmap(fd, size)
        self.cells = memoryview(self._map).cast("i")

    def clear(self, process: int) -> None:
        start = process * self.row
        self.cells[start:start + self.row] = memoryview(bytes(self.row * CELL)).cast("i")

    def total(self) -> int:
        cells, row = self.cells, self.row
        return sum(cells[p * row + BUCKETS] for p in range(self.processes))

    def counter(self, process: int, limit: int, per_source: int) -> SharedCounter:
        return SharedCounter(self, process, limit, per_source)

    def close(self) -> None:
        self.cells.release()
        self._map.close()


class NodeSessions:
    """The node's open frontend sessions (every process's row of the table) and its limit, as the
    metrics read them."""

    def __init__(self, table: SessionTable, limit: int):
        self.table = table
        self.limit = limit

    @property
    def total(self) -> int:
        return self.table.total()


class SharedCounter:
    """One process's view: the interface of ``smtp.server.ConnectionCounter`` (``acquire`` gives the
    refusal reply or None, ``release``, ``total`` of this process), checked against the node."""

    def __init__(self, table: SessionTable, process: int, limit: int, per_source: int):
        self.table = table
        self.process = process
        self.limit = limit
        self.per_source = per_source
        self.total = 0
        self._own = process * table.row

    def acquire(self, ip: str) -> str | None:
        t = self.table
        cells, row, bucket = t.cells, t.row, zlib.crc32(ip.encode()) % BUCKETS
        if sum(cells[p * row + BUCKETS] for p in range(t.processes)) >= self.limit:
            return replies.S421_TOO_MANY_CONNECTIONS
        if sum(cells[p * row + bucket] for p in range(t.processes)) >= self.per_source:
            return replies.S421_TOO_MANY_FROM_SOURCE
        cells[self._own + bucket] += 1
        cells[self._own + BUCKETS] += 1
        self.total += 1
        return None

    def release(self, ip: str) -> None:
        cells, bucket = self.table.cells, zlib.crc32(ip.encode()) % BUCKETS
        cells[self._own + bucket] = max(0, cells[self._own + bucket] - 1)
        cells[self._own + BUCKETS] = max(0, cells[self._own + BUCKETS] - 1)
        self.total -= 1
