"""The generator's output side: simulated rows queued, then written per node as MSGTRK files in time order.

``Journal`` holds the rows the simulation emits in one time-ordered queue and writes those older
than a sliding window to each node's ``Writer``, so memory stays bounded however many messages
are generated; ``Writer`` rolls a node's files by UTC day and by size, in the daemon's format
(``transportd.tracking``). Neither decides what happens to a message: a row is queued only if
its node is alive and inside the logs, and it never reads the logs back.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

import transportd
from transportd.tracking import FIELDS_2010, FIELDS_2016


class Writer:
    """Per-node MSGTRK files in the daemon's format, rolled by UTC day and by size; ``fields``
    FIELDS_2010 writes Exchange 2010's 26 fields (no network-message-id) as a 2010-mode node does."""

    def __init__(self, directory: Path, hostname: str, max_file_size: int,
                 fields: tuple[str, ...] = FIELDS_2016) -> None:
        self.fields = fields
        self.keep = None if fields == FIELDS_2016 else [FIELDS_2016.index(f) for f in fields]
        self.directory = directory
        self.hostname = hostname
        self.max_file_size = max_file_size
        self.directory.mkdir(parents=True, exist_ok=True)
        self.file: TextIO | None = None
        self.day = ""
        self.number = 0
        self.size = 0
        self.rows = 0

    def header(self, when: str) -> str:
        lines = ("#Software: transportd", f"#Version: {transportd.__version__}",
                 "#Log-type: Message Tracking Log", f"#Date: {when}", "#Fields: " + ",".join(self.fields))
        return "\ufeff" + "".join(line + "\r\n" for line in lines)

    def write(self, stamp: str, line: str) -> None:
        day = stamp[:10].replace("-", "")
        if self.file is None or day != self.day or self.size + len(line) > self.max_file_size:
            self.close()
            self.number = 1 if day != self.day else self.number + 1
            self.day = day
            path = self.directory / f"MSGTRK{day}-{self.number}.LOG"
            self.file = open(path, "w", encoding="utf-8", newline="")  # noqa: SIM115
            head = self.header(stamp)
            self.file.write(head)
            self.size = len(head)
        assert self.file is not None
        self.file.write(line)
        self.size += len(line)
        self.rows += 1

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _quote(value: str) -> str:
    if "," in value or '"' in value or "\r" in value or "\n" in value:
        return '"' + value.replace('"', '""') + '"'
    return value


class Journal:
    """Every node's rows: queued in time order as the simulation emits them, written when flushed.

    ``alive(node, t)`` and ``end`` come from the cluster: a dead node writes nothing, and nothing
    is written after the end of the logs. ``rng`` is the simulation's own generator (each row's
    GUID draws from it), so the output depends only on the seed.
    """

    def __init__(self, out: Path, names: list[str], ips: dict[str, str], alive: Callable[[str, float], bool],
                 end: float, start: float, rng: random.Random, max_file_size: int,
                 exchange2010: tuple[str, ...] = ()) -> None:
        self.names = names
        self.ips = ips
        self.alive = alive
        self.end = end
        self.rng = rng
        self.last_written = start
        """The time of the last row written: the analyzer's end of the logs."""
        self.heap: list[tuple[float, int, str, tuple]] = []
        self.writers = {n: Writer(out / n.split(".")[0] / "msgtrk", n, max_file_size,
                                  FIELDS_2010 if n in exchange2010 else FIELDS_2016) for n in names}
        self.seq = 0
        self.stamp_cache: tuple[int, str] = (-1, "")

    def stamp(self, t: float) -> str:
        sec = int(t)
        if self.stamp_cache[0] != sec:
            self.stamp_cache = (sec, datetime.fromtimestamp(sec, UTC).strftime("%Y-%m-%dT%H:%M:%S"))
        ms = min(999, int((t - sec) * 1000))
        return f"{self.stamp_cache[1]}.{ms:03d}Z"

    def guid(self) -> str:
        h = f"{self.rng.getrandbits(128):032x}"
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

    def emit(self, t: float, node: str, event: str, source: str, msg: dict, *, recipients: tuple[str, ...] = (),
             status: str = "", context: str = "", client_hostname: str = "", client_ip: str = "",
             reference: str = "", internal_id: int | None = None, connector: str = "",
             directionality: str = "", server_ip: str | None = None) -> bool:
        """Queue one row if ``node`` is alive at ``t`` and ``t`` is inside the logs; True if queued."""
        if not self.alive(node, t) or t > self.end:
            return False
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, node, (
            event, source, msg, recipients, status, context, client_hostname, client_ip, reference,
            internal_id, connector, directionality, server_ip)))
        return True

    def flush(self, before: float) -> None:
        while self.heap and self.heap[0][0] < before:
            t, _, node, row = heapq.heappop(self.heap)
            self.write_row(t, node, row)
            self.last_written = t

    def write_row(self, t: float, node: str, row: tuple) -> None:
        (event, source, msg, recipients, status, context, client_hostname, client_ip, reference,
         internal_id, connector, directionality, server_ip) = row
        stamp = self.stamp(t)
        rcpts = ";".join(recipients)
        values = (
            stamp, client_ip, client_hostname, self.ips[node] if server_ip is None else server_ip, node,
            _quote(context), connector, source, event, str(internal_id if internal_id is not None else ""),
            msg["message_id"], msg["netid"], rcpts, _quote(status), str(msg["size"]),
            str(len(recipients)) if recipients else "", "", reference, _quote(msg["subject"]),
            msg["sender"], msg["sender"], "", directionality, "", "", "", "", "Email",
            self.guid(), transportd.__version__)
        writer = self.writers[node]
        if writer.keep is not None:
            values = tuple(values[i] for i in writer.keep)
        writer.write(stamp, ",".join(values) + "\r\n")

    def inject_malformed(self, count: int) -> int:
        """Bad rows at the end of random nodes' last files: a stray quote, too few fields, a bad date."""
        kinds = ('2026-11-22T00:00:00.000Z,"unterminated,field\r\n', "only,three,fields\r\n",
                 "not-a-date" + "," * 29 + "\r\n")
        for i in range(count):
            w = self.writers[self.rng.choice(self.names)]
            if w.file is None:
                w.write(self.stamp(self.end), kinds[i % 3])
            else:
                w.file.write(kinds[i % 3])
        return count

    def close(self) -> int:
        """Close every file; returns the rows written."""
        for w in self.writers.values():
            w.close()
        return sum(w.rows for w in self.writers.values())
