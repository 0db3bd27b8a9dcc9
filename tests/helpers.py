"""Plain helpers shared by several test files (not fixtures: those are in conftest.py).

- ``scrape`` / ``value`` / ``scrape_until``: a node's Prometheus /metrics, parsed;
- ``fill``: fill a (small, test-mounted) disk to the last byte;
- ``run_cli`` / ``assert_one_error_line``: the real ``python -m transportd`` and its one-line errors;
- ``backlog``: messages queued straight into a (stopped) node's queue database;
- ``PerRecipientNextHop``: a next hop answering each recipient by its local part (250/550/450),
  with or without SMTPUTF8;
- ``folded``: a long header field folded into lines a message may carry.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from conftest import wait_for
from prometheus_client.parser import text_string_to_metric_families

# ------------------------------------------------------------------------------ metrics


def scrape(host: str, port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def scrape_until(host: str, port: int, predicate, what: str, timeout: float = 20) -> dict:
    """Scrape until ``predicate(samples)`` holds; the samples that satisfied it."""
    last: dict = {}

    def ok() -> bool:
        nonlocal last
        last = scrape(host, port)
        return predicate(last)
    wait_for(ok, timeout=timeout, what=what)
    return last


# ------------------------------------------------------------------------------ storage


def fill(disk: Path) -> None:
    # Unbuffered: a buffered file would keep the bytes of the write that failed and raise
    # ENOSPC again when it is closed (how much is left over depends on the space left).
    with open(disk / "filler", "wb", buffering=0) as f:
        for block in (65536, 4096, 512, 1):  # to the last byte: a small write must fail too
            try:
                while True:
                    f.write(b"\0" * block)
            except OSError:
                pass
        try:
            os.fsync(f.fileno())
        except OSError:
            pass


# ------------------------------------------------------------------------------ the real command line


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """The real ``python -m transportd`` (used where the process itself is what is tested)."""
    return subprocess.run([sys.executable, "-m", "transportd", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def assert_one_error_line(res: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected exactly one stderr line, got:\n{res.stderr}"
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"
    assert res.stdout == ""
    return lines[0]


# ------------------------------------------------------------------------------ queue database


def backlog(db_path, hops: list, per_queue: int) -> None:
    """``per_queue`` one-recipient messages queued for each next hop in ``hops`` (NextHop), in one
    transaction, in the queue database at ``db_path`` (created if missing; the node is stopped)."""
    import time

    from transportd.queue import messages as mq
    from transportd.queue.store import QueueStore
    store = QueueStore.open(db_path)
    now = time.time()
    try:
        def job(conn):
            for hop in hops:
                for i in range(per_queue):
                    mq.enqueue(conn, mq.NewMessage(
                        network_message_id=f"backlog-{hop.identity}-{i}", sender="bulk@example.test",
                        data=b"Subject: backlog\r\n\r\nbulk\r\n", recipients={hop: [f"r{i}@elsewhere.test"]},
                        received_at=now, expires_at=now + 86400, subject="backlog"))
        store.transaction(job)
    finally:
        store.close()


# ------------------------------------------------------------------------------ next hops

class PerRecipientNextHop:
    """A next hop (aiosmtpd in a thread of this process) that answers each RCPT by its local part:
    ``perm`` 550 5.1.1, ``temp`` 450 4.2.1 while ``greylisting`` (250 after), any other 250. It
    notes every RCPT it was sent, the recipients of each transaction it took and each message
    (MAIL parameters, bytes). It offers SMTPUTF8 (RFC 6531) only with ``smtputf8``."""

    def __init__(self, smtputf8: bool = False) -> None:
        import socket

        from aiosmtpd.controller import Controller

        self.rcpts: list[str] = []
        self.transactions: list[list[str]] = []
        self.messages: list[tuple[list[str], bytes]] = []
        self.greylisting = True
        hop = self

        class Handler:
            async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
                hop.rcpts.append(address)
                if address.startswith("perm"):
                    return "550 5.1.1 No such user"
                if address.startswith("temp") and hop.greylisting:
                    return "450 4.2.1 Mailbox busy, try again later"
                envelope.rcpt_tos.append(address)
                return "250 2.1.5 Ok"

            async def handle_DATA(self, server, session, envelope):
                hop.transactions.append(list(envelope.rcpt_tos))
                hop.messages.append((list(envelope.mail_options), envelope.original_content))
                return "250 2.0.0 queued"

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.controller = Controller(Handler(), hostname="127.0.0.1", port=self.port, enable_SMTPUTF8=smtputf8)
        self.controller.start()


# ------------------------------------------------------------------------------ messages


def folded(field: bytes) -> bytes:
    """A long field folded at its blanks into lines of at most 900 octets (CRLF after each)."""
    lines, line = [], b""
    for word in field.split(b" "):
        if line and len(line) + 1 + len(word) > 900:
            lines.append(line)
            line = b" " + word
        else:
            line = line + b" " + word if line else word
    return b"\r\n".join([*lines, line]) + b"\r\n"
