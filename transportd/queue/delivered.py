"""Duplicate detection records (DeliveredTo), kept with the mailbox store, not the queue database.

It owns one small SQLite file next to the Maildirs (``<data_dir>/mailboxes/.delivered_to.sqlite``,
WAL, synchronous=FULL): one row per (recipient, Message-ID, client submit time = Date header;
the recipient in ``address_key``'s form, one for both spellings of an internationalized domain)
delivered to a local mailbox, with the time of delivery (docs/PROTOCOL.md section 6). Living
beside the mail it describes, it survives what the queue database does not (a node whose queue
database was deleted or moved aside as corrupt still knows what its mailboxes hold), so a copy
retried by a client or re-delivered by a promotion after such a loss is still dropped. A corrupt
file is moved aside and started afresh (duplicates become possible, never a loss). It never
touches the Maildirs or the queue database (rows an older version kept there are handed to
``merge`` by the daemon at start).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from transportd.smtp.addresses import address_key

log = logging.getLogger("transportd.queue.delivered")

FILE_NAME = ".delivered_to.sqlite"  # a file, never a mailbox: mailbox folder names never start with "."

_SCHEMA = """
CREATE TABLE IF NOT EXISTS delivered_to (
    recipient TEXT NOT NULL, message_id TEXT NOT NULL, submit_time TEXT NOT NULL,
    delivered_at REAL NOT NULL, PRIMARY KEY (recipient, message_id, submit_time));
CREATE INDEX IF NOT EXISTS ix_delivered_to_at ON delivered_to (delivered_at);
"""


class DeliveredLogError(OSError):
    """The records could not be read or written (disk full, I/O error)."""


class DeliveredLog:
    """DeliveredTo beside the mailboxes; thread-safe (the mailbox connector calls it from threads)."""

    def __init__(self, mailbox_dir: Path):
        self.path = Path(mailbox_dir) / FILE_NAME
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None

    def _open(self) -> sqlite3.Connection:
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self._conn = self._connect()
            except sqlite3.DatabaseError as exc:
                if isinstance(exc, sqlite3.OperationalError) and not self._corrupt(exc):
                    raise
                aside = self.path.with_name(f"{FILE_NAME}.corrupt-{int(time.time())}")
                log.error("duplicate detection records %s unreadable (%s): moved aside to %s, starting afresh",
                          self.path, exc, aside)
                os.replace(self.path, aside)
                for suffix in ("-wal", "-shm"):
                    try:
                        os.unlink(f"{self.path}{suffix}")
                    except FileNotFoundError:
                        pass
                self._conn = self._connect()
        return self._conn

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=10, isolation_level=None, check_same_thread=False)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.executescript(_SCHEMA)
        except BaseException:
            conn.close()
            raise
        return conn

    @staticmethod
    def _corrupt(exc: sqlite3.Error) -> bool:
        text = str(exc).lower()
        return "malformed" in text or "not a database" in text

    def _run(self, fn, *, empty=None):
        """``fn(connection)`` under the lock; a read (``empty`` given) of records never written
        answers ``empty`` without making the file (a node with no local delivery has none)."""
        with self._lock:
            if empty is not None and self._conn is None and not self.path.exists():
                return empty
            try:
                return fn(self._open())
            except sqlite3.Error as exc:
                if self._conn is not None and self._corrupt(exc):
                    self._conn.close()
                    self._conn = None
                raise DeliveredLogError(f"duplicate detection records: {exc}") from exc

    def seen(self, recipient: str, message_id: str, submit_time: str, now: float, window: float) -> bool:
        """Whether this message was delivered to this recipient within ``window`` seconds."""
        if not message_id:
            return False
        row = self._run(lambda c: c.execute(
            "SELECT 1 FROM delivered_to WHERE recipient = ? AND message_id = ? AND submit_time = ? "
            "AND delivered_at > ?", (address_key(recipient), message_id, submit_time, now - window)).fetchone(), empty=())
        return bool(row)

    def remember(self, recipient: str, message_id: str, submit_time: str, now: float) -> None:
        """Record a delivery (durably: the commit is fsynced); again refreshes the time."""
        if not message_id:
            return
        self._run(lambda c: c.execute(
            "INSERT OR REPLACE INTO delivered_to VALUES (?, ?, ?, ?)",
            (address_key(recipient), message_id, submit_time, now)))

    def merge(self, rows: Iterable[tuple[str, str, str, float]]) -> int:
        """Take (recipient, message_id, submit_time, delivered_at) rows kept elsewhere (the queue
        database of an older version); the later time wins. Returns how many were given."""
        rows = [(address_key(r), m, s, float(t)) for r, m, s, t in rows if m]

        def apply(c: sqlite3.Connection) -> None:
            c.execute("BEGIN IMMEDIATE")
            try:
                c.executemany(
                    "INSERT INTO delivered_to VALUES (?, ?, ?, ?) ON CONFLICT (recipient, message_id, submit_time) "
                    "DO UPDATE SET delivered_at = max(delivered_at, excluded.delivered_at)", rows)
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise
        if rows:
            self._run(apply)
        return len(rows)

    def purge(self, now: float, window: float) -> int:
        """Drop records older than the window; returns how many."""
        return self._run(lambda c: c.execute("DELETE FROM delivered_to WHERE delivered_at < ?",
                                             (now - window,)).rowcount, empty=0)

    def count(self) -> int:
        return self._run(lambda c: c.execute("SELECT count(*) FROM delivered_to").fetchone()[0], empty=0)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
