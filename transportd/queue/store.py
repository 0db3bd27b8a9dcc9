"""The queue database: the single source of truth of a node (SQLAlchemy 2 Core over SQLite).

It owns the schema and its migrations, opening (and moving aside a corrupt
file), the queue database ID, and the group-commit writer through which the
daemon makes every change durable (WAL, synchronous=FULL: a commit returns
only after fsync). Receive, delivery and the Shadow Redundancy Manager meet
here and nowhere else. It never speaks SMTP and never writes tracking logs.

Schema (version in ``PRAGMA user_version``):
- ``meta``: queue_database_id (GUID, made once when the file is created), created_at, node_name;
  ``commit_barrier``, rewritten after a failed commit (``settle_failed_commit``).
- ``queues``: one delivery queue per next hop (identity such as ``smarthost:127.0.0.1:2500``,
  ``mailbox:local``, ``dns:example.org``, later ``peer:<node>``); suspended flag, retry state.
  Made when mail for its next hop is queued; removed by housekeeping once no recipient row or
  fork refers to it and it has been idle for ``queue_max_idle_time``, unless suspended.
- ``messages`` + ``message_bodies``: every message the node holds. ``role`` is ``primary`` or
  ``shadow``; ``state`` is ``Queued``, ``SafetyNet`` (processed, held for resubmission until
  ``safety_net_until``) or ``Removed``. Shadow copies live in the same table.
- ``recipients``: per recipient and next hop: Ready / Retry / Active / Delivered / Failed / Removed.
- ``delivered_to``: duplicate detection at final delivery as older versions kept it; the records now
  live with the mailbox store (``queue/delivered.py``) and rows found here are moved there at start.
- ``shadow_contexts``, ``message_shadows``, ``discard_events``: shadow redundancy.
- schema 3 adds to ``messages`` how it was received (``smtputf8``, ``body_type``) and poison
  message detection (``poison_count``, ``poisoned``: the Poison queue).
- schema 5 adds ``ix_messages_pending``, a partial index of the messages whose shadow outcome is
  not recorded yet: the periodic release of orphaned ``pending`` messages read the whole table
  (Safety Net included) without it; and ``ix_discard_events_token``, of the discard events handed
  out on a session, settled by its token (discard events pile up while a shadow is away).
- schema 7 drops ``ix_recipients_queue`` (the prefix of ``ix_recipients_queue_due``) and makes
  ``ix_messages_dsn_of`` partial (DSNs only): index work every message paid for, no query used.
- schema 8 adds ``shadow_contexts.down_since``: since when a primary's heartbeats fail, kept
  across promotion spans (``unreachable_since`` restarts with each span).
- schema 10 adds ``message_shadows.shadow_dbid``: the queue database of the peer that holds the
  copy, as the peer named it in its reply (NULL: a peer that does not say, or an older row).
- schema 11 adds ``shadow_contexts.transport``: the primary's transport connector (host:port) while
  it was a configured peer, so that its shadows are still polled there once it is taken out of
  ``[[peers]]`` (a primary still running must not see them promoted).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import queue as queue_mod
import signal
import sqlite3
import threading
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from sqlalchemy import (
    BLOB, Column, Float, ForeignKey, Index, Integer, MetaData, String, Table, Text,
    UniqueConstraint, create_engine, event, select,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DatabaseError, OperationalError

from transportd.errors import CorruptDatabase, StoreError

log = logging.getLogger("transportd.queue.store")

T = TypeVar("T")

SCHEMA_VERSION = 11

metadata = MetaData()

meta = Table(
    "meta", metadata,
    Column("key", String, primary_key=True),
    Column("value", String, nullable=False),
)

queues = Table(
    "queues", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("identity", String, nullable=False, unique=True),
    Column("delivery_type", String, nullable=False),
    Column("next_hop", String, nullable=False),
    Column("suspended", Integer, nullable=False, default=0),
    Column("retry_count", Integer, nullable=False, default=0),
    Column("next_retry_at", Float),
    Column("last_error", Text),
    Column("last_attempt_at", Float),
    Column("created_at", Float, nullable=False),
    sqlite_autoincrement=True,
)

messages = Table(
    "messages", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),  # internal-message-id
    Column("network_message_id", String, nullable=False),
    Column("message_id", String, nullable=False, default=""),
    Column("submit_time", String, nullable=False, default=""),  # Date header, for duplicate detection
    Column("sender", String, nullable=False, default=""),
    Column("subject", String, nullable=False, default=""),
    # The Sender (else From) address of its header (schema 9): MSGTRK's sender-address
    Column("author", String, nullable=False, default=""),
    Column("size", Integer, nullable=False),
    Column("received_at", Float, nullable=False),
    Column("expires_at", Float, nullable=False),
    Column("client_ip", String, nullable=False, default=""),
    Column("client_hostname", String, nullable=False, default=""),
    Column("origin", String, nullable=False, default="smtp"),  # smtp | dsn | peer | promoted | resubmit
    Column("role", String, nullable=False, default="primary"),  # primary | shadow
    Column("state", String, nullable=False, default="Queued"),  # Queued | SafetyNet | Removed
    Column("suspended", Integer, nullable=False, default=0),
    Column("suppress_dsn", Integer, nullable=False, default=0),
    Column("completed_at", Float),
    Column("safety_net_until", Float),
    # shadow redundancy: the shadow-message GUID and, on a shadow, its primary
    Column("shadow_guid", String),
    Column("primary_node", String),
    Column("primary_internal_id", Integer),
    Column("primary_dbid", String),  # on a shadow: the primary's queue database ID when it was made
    # On a shadow (schema 4): its rank among the message's shadows (N-way, docs/PROTOCOL.md
    # section 9): rank k takes ownership only after k - 1 rank delays more than rank 1.
    Column("shadow_rank", Integer, nullable=False, default=1),
    Column("redundancy", String, nullable=False, default="none"),  # none | shadowed | unprotected
    # How it was received (schema 3): the SMTPUTF8 MAIL parameter (RFC 6531) and BODY= (RFC 6152,
    # "8BITMIME", "7BIT" or "" when not given), so every next hop is offered the same.
    Column("smtputf8", Integer, nullable=False, default=0),
    Column("body_type", String, nullable=False, default=""),
    # Poison message detection (schema 3): internal failures while handling it (a crash during
    # its delivery counts at restart); ``poisoned`` = held in the Poison queue, touched by no loop.
    Column("poison_count", Integer, nullable=False, default=0),
    Column("poisoned", Integer, nullable=False, default=0),
    # A DSN: the message it reports on (schema 3). That message's shadows are kept until the DSN
    # is out, so a primary lost before sending it loses no NDR (the shadow's promotion makes it again).
    Column("dsn_of", Integer),
    Column("delay_dsn_at", Float),  # when a delay DSN went to the sender (schema 3; once per message)
    Column("dsn_params", String, nullable=False, default=""),  # RFC 3461 RET=/ENVID= as received (schema 6)
    sqlite_autoincrement=True,
)
Index("ix_messages_state", messages.c.state, messages.c.role)
Index("ix_messages_network_id", messages.c.network_message_id)
Index("ix_messages_shadow", messages.c.primary_node, messages.c.shadow_guid)
# Only DSNs name the message they report on: the others are not in the index (schema 7).
Index("ix_messages_dsn_of", messages.c.dsn_of, sqlite_where=messages.c.dsn_of.isnot(None))
Index("ix_messages_pending", messages.c.received_at, sqlite_where=messages.c.redundancy == "pending")

message_bodies = Table(
    "message_bodies", metadata,
    Column("message_id", Integer, ForeignKey("messages.id", ondelete="CASCADE"), primary_key=True),
    Column("data", BLOB, nullable=False),
)

recipients = Table(
    "recipients", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("message_id", Integer, ForeignKey("messages.id", ondelete="CASCADE"), nullable=False),
    Column("address", String, nullable=False),
    Column("queue_id", Integer, ForeignKey("queues.id"), nullable=False),
    Column("status", String, nullable=False, default="Ready"),
    Column("attempts", Integer, nullable=False, default=0),
    Column("next_retry_at", Float, nullable=False, default=0.0),
    Column("last_error", Text),
    Column("last_attempt_at", Float),
    Column("completed_at", Float),
    Column("dsn_params", String, nullable=False, default=""),  # RFC 3461 NOTIFY=/ORCPT= as received (schema 6)
)
Index("ix_recipients_due", recipients.c.status, recipients.c.next_retry_at)
Index("ix_recipients_message", recipients.c.message_id)
# The scheduler's per-queue probe and fetch (schema 3): due recipients of one queue; its prefix
# serves every query by queue and status (schema 7 dropped ix_recipients_queue, that prefix alone).
Index("ix_recipients_queue_due", recipients.c.queue_id, recipients.c.status, recipients.c.next_retry_at)

delivered_to = Table(
    "delivered_to", metadata,
    Column("recipient", String, nullable=False),
    Column("message_id", String, nullable=False),
    Column("submit_time", String, nullable=False),
    Column("delivered_at", Float, nullable=False),
    UniqueConstraint("recipient", "message_id", "submit_time", name="uq_delivered_to"),
)
Index("ix_delivered_to_at", delivered_to.c.delivered_at)

shadow_contexts = Table(
    "shadow_contexts", metadata,
    Column("peer", String, primary_key=True),  # the primary's FQDN (we hold shadows for it)
    Column("queue_database_id", String),  # recorded DB ID of that primary
    Column("last_heartbeat_at", Float),
    Column("consecutive_failures", Integer, nullable=False, default=0),
    Column("last_error", Text),
    # Failing heartbeats: since when the primary is taken as unreachable (schema 3); promotion
    # is decided by this elapsed time, not by a count of failures.
    Column("unreachable_since", Float),
    # When its new queue database ID was first seen (schema 4): the shadows made from the old one
    # are promoted rank by rank from then on (N-way, PROTOCOL.md section 9).
    Column("state_changed_at", Float),
    # Since when its heartbeats fail, however many promotion spans started since (schema 8): the
    # Primary Safety Net's unreachable time (shadow resubmit requests) counts from here.
    Column("down_since", Float),
    # Its transport connector (host:port) as last configured in [[peers]] (schema 11): a primary
    # taken out of the configuration is still polled there while we hold its shadows.
    Column("transport", String),
)

message_shadows = Table(
    "message_shadows", metadata,
    Column("message_id", Integer, ForeignKey("messages.id", ondelete="CASCADE"), nullable=False),
    Column("shadow_node", String, nullable=False),
    Column("shadow_guid", String, nullable=False),
    Column("shadow_rank", Integer, nullable=False, default=1),  # schema 4 (N-way, PROTOCOL.md section 9)
    Column("created_at", Float, nullable=False),
    # The holder's queue database ID when it took the copy, if it said (schema 10): a later
    # contact from it with another ID means the copy is gone.
    Column("shadow_dbid", String),
)
Index("ix_message_shadows_msg", message_shadows.c.message_id)

discard_events = Table(
    "discard_events", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("shadow_node", String, nullable=False),
    Column("shadow_guid", String, nullable=False),
    Column("created_at", Float, nullable=False),
    # Handed out on this session and not yet acknowledged by the shadow's QUIT (schema 2).
    Column("sent_token", String),
    # Why, when it is not the message being processed (schema 3): "DeletedByAdmin".
    Column("reason", String),
)
Index("ix_discard_events_node", discard_events.c.shadow_node, discard_events.c.id)
Index("ix_discard_events_token", discard_events.c.sent_token, sqlite_where=discard_events.c.sent_token.is_not(None))


# Hop-by-hop shadows (docs/PROTOCOL.md section 3): after a peer took a message (or one fork of it) as
# primary, the sender keeps its copy until that peer's discard. Added in schema version 2.
shadow_forks = Table(
    "shadow_forks", metadata,
    Column("message_id", Integer, ForeignKey("messages.id", ondelete="CASCADE"), nullable=False),
    Column("primary_node", String, nullable=False),  # the peer that became primary
    Column("shadow_guid", String, nullable=False),
    Column("queue_id", Integer, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("primary_dbid", String),  # that peer's queue database ID when it took the fork
)
Index("ix_shadow_forks_primary", shadow_forks.c.primary_node, shadow_forks.c.shadow_guid)
Index("ix_shadow_forks_message", shadow_forks.c.message_id)


# Shadow resubmit requests waiting for their primary's Primary Safety Net to be unreachable for
# primary_safety_net_unreachable_time (schema 3): then this node's Shadow Safety Net resubmits
# them on its own, as Exchange turns a resubmit request into a shadow resubmit request.
resubmit_requests = Table(
    "resubmit_requests", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("for_primary", String, nullable=False),
    Column("destination", String, nullable=False),
    Column("start_at", Float, nullable=False),
    Column("end_at", Float, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("done_at", Float),
    Column("result", Text),
)


# Each migration takes a connection inside a transaction. Index = version it produces - 1.
def _migration_1(conn: Connection) -> None:
    metadata.create_all(conn)


def _add_columns(conn: Connection, table: str, columns: dict[str, str]) -> None:
    """ALTER TABLE ADD COLUMN for each column the table does not have yet (name -> SQL type)."""
    have = {row[1] for row in conn.exec_driver_sql(f"PRAGMA table_info({table})")}
    for name, ddl in columns.items():
        if name not in have:
            conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {name} {ddl}")


def _migration_2(conn: Connection) -> None:
    _add_columns(conn, "messages", {"primary_dbid": "VARCHAR"})
    _add_columns(conn, "discard_events", {"sent_token": "VARCHAR"})
    shadow_forks.create(conn, checkfirst=True)
    for ix in shadow_forks.indexes:
        ix.create(conn, checkfirst=True)


def _migration_3(conn: Connection) -> None:
    _add_columns(conn, "messages", {
        "smtputf8": "INTEGER NOT NULL DEFAULT 0", "body_type": "VARCHAR NOT NULL DEFAULT ''",
        "poison_count": "INTEGER NOT NULL DEFAULT 0", "poisoned": "INTEGER NOT NULL DEFAULT 0",
        "dsn_of": "INTEGER", "delay_dsn_at": "FLOAT"})
    _add_columns(conn, "shadow_contexts", {"unreachable_since": "FLOAT"})
    _add_columns(conn, "discard_events", {"reason": "VARCHAR"})
    resubmit_requests.create(conn, checkfirst=True)
    conn.exec_driver_sql("CREATE INDEX IF NOT EXISTS ix_messages_dsn_of ON messages (dsn_of)")
    conn.exec_driver_sql("CREATE INDEX IF NOT EXISTS ix_recipients_queue_due "
                         "ON recipients (queue_id, status, next_retry_at)")


def _migration_4(conn: Connection) -> None:
    _add_columns(conn, "messages", {"shadow_rank": "INTEGER NOT NULL DEFAULT 1"})
    _add_columns(conn, "message_shadows", {"shadow_rank": "INTEGER NOT NULL DEFAULT 1"})
    _add_columns(conn, "shadow_contexts", {"state_changed_at": "FLOAT"})


def _migration_5(conn: Connection) -> None:
    for ix in (*messages.indexes, *discard_events.indexes):
        if ix.name in ("ix_messages_pending", "ix_discard_events_token"):
            ix.create(conn, checkfirst=True)


def _migration_6(conn: Connection) -> None:
    _add_columns(conn, "messages", {"dsn_params": "VARCHAR NOT NULL DEFAULT ''"})
    _add_columns(conn, "recipients", {"dsn_params": "VARCHAR NOT NULL DEFAULT ''"})


def _migration_7(conn: Connection) -> None:
    """Two indexes every message paid for and no query needed: ``ix_recipients_queue`` (queue,
    status), the prefix of ``ix_recipients_queue_due``, changed on every recipient's insert and
    status change; ``ix_messages_dsn_of`` over every message where only DSNs have a value
    (now partial). One message's queue work (enqueue, Active, Delivered) ~6 % less CPU."""
    conn.exec_driver_sql("DROP INDEX IF EXISTS ix_recipients_queue")
    sql = conn.exec_driver_sql("SELECT sql FROM sqlite_master WHERE type = 'index' AND name = 'ix_messages_dsn_of'").scalar()
    if sql is None or "WHERE" not in sql.upper():
        conn.exec_driver_sql("DROP INDEX IF EXISTS ix_messages_dsn_of")
        conn.exec_driver_sql("CREATE INDEX ix_messages_dsn_of ON messages (dsn_of) WHERE dsn_of IS NOT NULL")


def _migration_8(conn: Connection) -> None:
    _add_columns(conn, "shadow_contexts", {"down_since": "FLOAT"})


def _migration_9(conn: Connection) -> None:
    _add_columns(conn, "messages", {"author": "VARCHAR NOT NULL DEFAULT ''"})


def _migration_10(conn: Connection) -> None:
    _add_columns(conn, "message_shadows", {"shadow_dbid": "VARCHAR"})


def _migration_11(conn: Connection) -> None:
    _add_columns(conn, "shadow_contexts", {"transport": "VARCHAR"})


MIGRATIONS: list[Callable[[Connection], None]] = [_migration_1, _migration_2, _migration_3, _migration_4,
                                                  _migration_5, _migration_6, _migration_7, _migration_8,
                                                  _migration_9, _migration_10, _migration_11]




# What a failed statement or commit raises (the driver's error, or SQLAlchemy's around it): for
# callers outside this package, which never import SQLAlchemy.
DATABASE_ERRORS = (sqlite3.Error, DatabaseError, OperationalError)


# SQLite primary result codes that describe the environment, not the file's content.
_ENVIRONMENT_ERRORS = frozenset({
    sqlite3.SQLITE_PERM, sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_NOMEM,
    sqlite3.SQLITE_READONLY, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_FULL, sqlite3.SQLITE_CANTOPEN,
    sqlite3.SQLITE_PROTOCOL,
})


def _make_engine(path: Path, immediate: bool) -> Engine:
    engine = create_engine(
        f"sqlite:///{path}",
        connect_args={"timeout": 30, "check_same_thread": False},
        pool_pre_ping=False,
        # Readers keep a connection per thread (QueueStore.read): no cap, or a process with more
        # reading threads than pool_size + max_overflow would wait for one that is never returned.
        max_overflow=10 if immediate else -1,
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves (savepoints work)
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA busy_timeout = 30000")
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA synchronous = FULL")
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # On the driver connection: exec_driver_sql's execution context cost more than the BEGIN.
        conn.connection.driver_connection.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


def _is_foreign_database(path: Path) -> bool:
    """True only for a readable SQLite file with tables and no schema version (another
    program's database). Opened read-only, so the file is not changed; any doubt -> False."""
    try:
        conn = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, timeout=30)
    except (sqlite3.Error, ValueError):
        return False
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = conn.execute("SELECT count(*) FROM sqlite_master WHERE type='table'").fetchone()[0]
        return version == 0 and tables > 0
    except sqlite3.Error:
        return False
    finally:
        conn.close()


def fsync_dir(path: Path) -> None:
    """fsync a folder so a rename or create in it is durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def move_aside(path: Path, reason: str) -> Path:
    """Rename a bad database file (and its -wal/-shm) out of the way; never delete it."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
    os.rename(path, target)
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            os.rename(side, target.with_name(target.name + suffix))
    fsync_dir(path.parent)
    log.error("queue database %s %s; moved aside to %s; a new database will be created",
              path, reason, target)
    return target


class QueueStore:
    """An open queue database. Read with ``reader``; change with ``transaction()`` or ``writer``."""

    def __init__(self, path: Path, write_engine: Engine, read_engine: Engine, dbid: str):
        self.path = path
        self.write_engine = write_engine
        self.read_engine = read_engine
        self.queue_database_id = dbid
        self.writer: GroupCommitWriter | None = None
        self._queue_changed: asyncio.Event | None = None
        # Each reading thread keeps its connection between reads: a pool checkout, its reset on
        # return and their events were ~3/4 of the CPU of a delivery's read of its message. A
        # read that raises drops its thread's connection (the next read opens a fresh one).
        self._reader = threading.local()
        self._readers: list[Connection] = []
        self._readers_lock = threading.Lock()
        # Reads under way on any thread: ``close`` waits for them, since a reader connection closed
        # by one thread while another commits its read failed the stop ("cannot rollback - no
        # transaction is active": a node's graceful stop exited 1).
        self._reads = 0
        self._reads_done = threading.Condition(self._readers_lock)

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | Path, *, create: bool = True, repair: bool = False,
             node_name: str = "") -> "QueueStore":
        """Open (or create) the queue database at ``path``.

        ``repair`` (the daemon): a file that cannot be opened or fails the integrity check is
        moved aside and a fresh one, with a new queue database ID, is created.
        Without ``repair`` (the CLI) such a file raises CorruptDatabase.
        """
        p = Path(path)
        if not p.exists():
            if not create:
                raise StoreError(f"no queue database at {p}")
            p.parent.mkdir(parents=True, exist_ok=True)
        elif p.is_dir():
            raise StoreError(f"{p} is a directory, not a queue database")
        try:
            return cls._open(p, create=create, node_name=node_name)
        except CorruptDatabase as exc:
            if not repair:
                raise
            move_aside(p, str(exc))
            return cls._open(p, create=True, node_name=node_name)

    @classmethod
    def _open(cls, p: Path, *, create: bool, node_name: str) -> "QueueStore":
        existed = p.exists() and p.stat().st_size > 0
        if existed:
            with open(p, "rb") as f:
                header = f.read(16)
            if header != b"SQLite format 3\x00":
                raise CorruptDatabase("is not an SQLite database (bad file header)")
        if existed and _is_foreign_database(p):
            # Checked read-only first: our connections switch the file to WAL, which would
            # change another program's database before we refuse (or move aside) it.
            raise CorruptDatabase("is not a transportd queue database (no schema version)")
        write_engine = _make_engine(p, immediate=True)
        read_engine = _make_engine(p, immediate=False)
        try:
            if existed:
                with read_engine.connect() as conn:
                    result = conn.exec_driver_sql("PRAGMA quick_check").scalar()
                    if result != "ok":
                        raise CorruptDatabase(f"failed its integrity check ({result})")
            with write_engine.begin() as conn:
                version = conn.exec_driver_sql("PRAGMA user_version").scalar() or 0
                if existed and version == 0:
                    tables = conn.exec_driver_sql(
                        "SELECT count(*) FROM sqlite_master WHERE type='table'").scalar()
                    if tables:
                        raise CorruptDatabase("is not a transportd queue database (no schema version)")
                if version > SCHEMA_VERSION:
                    raise StoreError(f"{p} has schema version {version}, newer than this "
                                     f"transportd ({SCHEMA_VERSION}); upgrade transportd")
                for v in range(version, SCHEMA_VERSION):
                    MIGRATIONS[v](conn)
                    conn.exec_driver_sql(f"PRAGMA user_version = {v + 1}")
                    if v > 0:
                        log.info("queue database %s migrated to schema version %d", p, v + 1)
                dbid = conn.execute(select(meta.c.value).where(meta.c.key == "queue_database_id")).scalar()
                if dbid is None:
                    if existed and version > 0:
                        raise CorruptDatabase("has no queue database ID")
                    dbid = str(uuid.uuid4())
                    conn.execute(meta.insert(), [
                        {"key": "queue_database_id", "value": dbid},
                        {"key": "created_at", "value": repr(time.time())},
                        {"key": "node_name", "value": node_name},
                    ])
                    log.info("created queue database %s with queue database ID %s", p, dbid)
        except (DatabaseError, sqlite3.DatabaseError) as exc:
            write_engine.dispose()
            read_engine.dispose()
            orig = getattr(exc, "orig", exc)
            if isinstance(exc, OperationalError) and "locked" in str(orig):
                raise StoreError(f"{p} is locked by another process") from None
            if ((getattr(orig, "sqlite_errorcode", 0) or 0) & 0xFF) in _ENVIRONMENT_ERRORS:
                # Read-only, I/O error, disk full, cannot open...: the file may be fine; never
                # move a healthy queue aside (and start empty) because of the environment.
                raise StoreError(f"{p} cannot be used ({orig})") from None
            raise CorruptDatabase(f"cannot be opened ({orig})") from None
        except CorruptDatabase:
            write_engine.dispose()
            read_engine.dispose()
            raise
        return cls(p, write_engine, read_engine, dbid)

    @classmethod
    def open_snapshot(cls, path: str | Path) -> QueueStore:
        """Open a stopped node's queue database for reading only, without creating or writing
        anything beside it (SQLite's ``immutable``: no -wal/-shm, no locks), for the CLI's
        listings when the normal open cannot write (disk full, read-only file system or
        folder). Only sound when no process uses the file and its write-ahead log is empty:
        the caller checks both (``snapshot_refusal``). Any write through it fails."""
        p = Path(path)
        uri = p.resolve().as_uri() + "?immutable=1"
        engine = create_engine("sqlite://", creator=lambda: sqlite3.connect(uri, uri=True, check_same_thread=False))
        try:
            with engine.connect() as conn:
                version = conn.exec_driver_sql("PRAGMA user_version").scalar() or 0
                if version != SCHEMA_VERSION:
                    raise StoreError(f"{p} has schema version {version}, this transportd reads "
                                     f"{SCHEMA_VERSION}; start the node once to migrate it")
                dbid = conn.execute(select(meta.c.value).where(meta.c.key == "queue_database_id")).scalar()
        except (DatabaseError, sqlite3.DatabaseError) as exc:
            engine.dispose()
            raise StoreError(f"{p} cannot be read ({db_error_text(exc)})") from None
        except StoreError:
            engine.dispose()
            raise
        if dbid is None:
            engine.dispose()
            raise StoreError(f"{p} has no queue database ID")
        return cls(p, engine, engine, dbid)

    def close(self, read_wait: float = 5.0) -> None:
        """Stop the writer, then close the reader connections once no read is under way on any
        thread (``read_wait`` seconds at most: a read left running after that gets an error)."""
        if self.writer is not None:
            self.writer.stop()
            self.writer = None
        with self._reads_done:
            self._reads_done.wait_for(lambda: self._reads == 0, timeout=read_wait)
            readers, self._readers = self._readers, []
        for conn in readers:
            try:
                conn.close()
            except Exception as exc:  # noqa: BLE001 - a read connection being thrown away
                log.debug("closing a reader connection of %s: %s", self.path, exc)
        self.write_engine.dispose()
        self.read_engine.dispose()

    # -- reading and writing -----------------------------------------------------------------

    def read(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn`` in one read transaction (a consistent snapshot) on this thread's connection."""
        conn = getattr(self._reader, "conn", None)
        if conn is not None and conn.in_transaction():
            # A read inside a read on this thread: its own connection, as every read had before.
            with self.read_engine.connect() as nested:
                with nested.begin():
                    return fn(nested)
        with self._readers_lock:
            self._reads += 1
        try:
            if conn is None or conn.closed:
                conn = self._reader.conn = self.read_engine.connect()
                with self._readers_lock:
                    self._readers.append(conn)
            try:
                with conn.begin():
                    return fn(conn)
            except BaseException:
                self._drop_reader(conn)
                raise
        finally:
            with self._reads_done:
                self._reads -= 1
                if not self._reads:
                    self._reads_done.notify_all()

    def _drop_reader(self, conn: Connection) -> None:
        self._reader.conn = None
        with self._readers_lock:
            if conn in self._readers:
                self._readers.remove(conn)
        try:
            conn.invalidate()  # not back to the pool: it may be the broken one
            conn.close()
        except Exception:  # noqa: BLE001 - it is being thrown away
            pass

    def transaction(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn`` in one durable write transaction (BEGIN IMMEDIATE ... COMMIT + fsync), in
        its turn with the node's writers (``writer_turn``). An error of the database is raised
        only once it is true (``settle_failed_commit``)."""
        with writer_turn(self.path):
            try:
                with self.write_engine.begin() as conn:
                    return fn(conn)
            except OperationalError as exc:
                if _io_error(exc):
                    settle_failed_commit(self.write_engine)
                raise

    def start_writer(self, max_batch: int = 256) -> "GroupCommitWriter":
        self.writer = GroupCommitWriter(self.write_engine, max_batch=max_batch,
                                        turn_path=turn_path(self.path))
        return self.writer

    async def write(self, fn: Callable[[Connection], T], *, queue_changed: bool = False) -> T:
        """Run ``fn`` in the group-commit writer; returns after its commit is on disk.

        ``queue_changed``: the transaction may have made work due (a message enqueued, promoted,
        resubmitted, released): the queue-changed event is set after the commit."""
        if self.writer is None:
            result = await asyncio.to_thread(self.transaction, fn)
        else:
            result = await asyncio.wrap_future(self.writer.submit(fn))
        if queue_changed:
            self.queue_changed.set()
        return result

    @property
    def queue_changed(self) -> asyncio.Event:
        """Set after a commit that may have made work due; the scheduler waits on it and clears it."""
        if self._queue_changed is None:
            self._queue_changed = asyncio.Event()
        return self._queue_changed

    async def aread(self, fn: Callable[[Connection], T]) -> T:
        return await asyncio.to_thread(self.read, fn)

    def read_here(self, fn: Callable[[Connection], T]) -> T:
        """``read`` on the calling thread, the event loop's included: only for lookups of a few
        rows by key on the per-message path (a delivery reading its message), where handing the
        read to a thread cost ~5 times the read itself (docs/performance.md). In WAL mode a
        reader does not wait for writers; anything that scans or may read much goes through
        ``aread``."""
        return self.read(fn)


TURN_SUFFIX = ".writer-turn"


def turn_path(db_path: Path) -> Path:
    """The file whose flock the writers of a queue database take turns on (``writer_turn``)."""
    return db_path.with_name(db_path.name + TURN_SUFFIX)


# How long ``writer_turn`` waits for the turn before it goes on without it (then SQLite's busy
# handler waits as long again): the busy timeout, so a writer that holds the turn and is stuck
# fails a transaction no sooner than it did without turns.
TURN_WAIT = 30.0
_STOP_SIGNALS = {signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU}


@contextlib.contextmanager
def writer_turn(db_path: Path, wait: float = TURN_WAIT) -> Iterator[None]:
    """Hold the writer turn of ``db_path``, the flock the node's group-commit writers take before
    BEGIN IMMEDIATE (``GroupCommitWriter``): one more writer in the same order (turn, then
    SQLite's lock), so no two wait on each other. Without it a transaction of the command line
    (``transaction``) held SQLite's lock while the node's writer, its turn taken, slept in the
    busy handler and lost the race to the command's next one: receive waited seconds for its 250,
    and a transaction longer than the busy timeout made it answer 451.

    Asked without blocking, again every few ms: a writer of the node, blocked in flock, is woken
    by the kernel when the turn is released and goes first; this one takes it in a gap. A data
    dir whose turn file cannot be opened (read-only) or a turn not had within ``wait`` seconds
    leaves SQLite's busy handler to decide, as before."""
    fd = _open_turn_file(turn_path(db_path), db_path)
    if fd is None:
        yield
        return
    # Ctrl-Z (and a background job's terminal stops) wait for the turn's end: the node's writers
    # block on the turn, so a command stopped while it holds the turn would hold up every 250.
    stops = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        deadline, pause = time.monotonic() + wait, 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    log.warning("no writer turn on %s within %.0f s: waiting in SQLite's busy handler",
                                db_path, wait)
                    break
                time.sleep(pause)
                pause = min(pause * 2, 0.01)
        yield
    finally:
        os.close(fd)  # releases the flock, before a stop held back meanwhile takes effect
        signal.pthread_sigmask(signal.SIG_SETMASK, stops)


def _turn_mode(path: Path) -> int:
    """The permissions a new turn file gets: its database's (whoever may write the database may
    take turns on it: the node's user, an operator of its group), else owner only."""
    try:
        return Path(str(path).removesuffix(TURN_SUFFIX)).stat().st_mode & 0o666
    except OSError:
        return 0o600


def _open_turn_file(path: Path, db_path: Path) -> int | None:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, _turn_mode(path))
    except OSError:
        return None
    if os.geteuid() == 0:  # made by root (an operator's sudo): the node's user must open it too
        try:
            st = db_path.stat()
            os.fchown(fd, st.st_uid, st.st_gid)
        except OSError:
            pass
    return fd


def snapshot_refusal(path: Path) -> str | None:
    """Why ``open_snapshot`` would not give a true picture of ``path``, or None: a write-ahead
    log with frames in it (changes that are not yet in the database file)."""
    wal = path.with_name(path.name + "-wal")
    try:
        size = wal.stat().st_size
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"its write-ahead log {wal} cannot be read ({exc.strerror})"
    if size > 32:  # a WAL header alone is 32 bytes: no frames
        return (f"its write-ahead log {wal} may hold changes not yet in the database file; "
                "free space (or make it writable) so SQLite can read them")
    return None


def db_error_text(exc: BaseException) -> str:
    """An error of the database as one line: the driver's own error where SQLAlchemy wraps it (its
    text adds the statement and a "Background on this error" link on lines of their own)."""
    return " ".join(str(getattr(exc, "orig", None) or exc).split())


def _io_error(exc: BaseException) -> bool:
    """SQLITE_IOERR (a failed fsync among them), as against a full disk (SQLITE_FULL: the frames
    were never all written, nothing to settle), a lock or a job's own error."""
    orig = getattr(exc, "orig", None) or exc
    return (getattr(orig, "sqlite_errorcode", 0) or 0) & 0xFF == sqlite3.SQLITE_IOERR


def settle_failed_commit(engine: Engine) -> bool:
    """Make a failed commit definitely not durable, before anyone is told it failed; False when
    that could not be done.

    In WAL mode a commit writes its frames to the log, then fsyncs it. When the fsync fails
    (SQLITE_IOERR_FSYNC) the frames are in the log with valid checksums, only not yet counted in
    its index: no connection sees the change now, but recovery after a crash reads the log again
    and brings it back. A message refused with 451 (or a shadow copy refused to its primary) would
    then be delivered after all, twice once the sender retries. The next commit writes its frames
    at the same place, which ends the failed ones' chain of checksums: so one small commit
    (``commit_barrier`` in ``meta``) on a fresh connection settles it. If that fails too the
    outcome stays open until some later commit succeeds: the error is still reported (a
    duplicate after a crash, never a loss), with an ERROR saying so."""
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO meta (key, value) VALUES ('commit_barrier', ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value", (str(time.time_ns()),))
        return True
    except Exception as exc:  # noqa: BLE001 - the disk is failing: said, and the caller's error stands
        log.error("queue database: a failed commit could not be settled (%s); until a commit succeeds, "
                  "a crash may bring back changes that were reported as failed", db_error_text(exc))
        return False


class GroupCommitWriter:
    """One writer thread: many jobs per transaction, one fsync, each job in its own savepoint.

    A job that raises is rolled back alone (its savepoint) and its future gets the error; the
    others commit. If the commit itself fails, every job of the batch gets the error, so no
    caller ever believes an uncommitted change is durable, and only once the failed commit is
    settled (``settle_failed_commit``), so no caller that was told "failed" sees it come back.
    """

    def __init__(self, engine: Engine, max_batch: int = 256, turn_path: Path | None = None):
        self.engine = engine
        self.max_batch = max_batch
        # Writers of several processes (a node's receive workers) take turns on an flock of this
        # file before BEGIN IMMEDIATE: the kernel wakes the next one when a commit ends, where
        # SQLite's busy handler would sleep up to 100 ms between tries (the p99 under workers).
        self._turn_fd: int | None = None
        if turn_path is not None:
            try:
                self._turn_fd = os.open(turn_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, _turn_mode(turn_path))
            except OSError as exc:
                log.warning("no writer turn file %s (%s): concurrent writers wait in SQLite's busy handler",
                            turn_path, exc)
        self._jobs: queue_mod.Queue[tuple[Callable[[Connection], Any], Future] | None] = queue_mod.Queue()
        self._thread = threading.Thread(target=self._run, name="queue-db-writer", daemon=True)
        self._stopped = False
        self.batches = 0
        self.jobs_done = 0
        self.failing = 0  # commits failed in a row (a full disk): said once, then every 100th
        # The writer thread keeps its connection between batches (a pool checkout, its reset and
        # the event plumbing per batch were ~6 % of a node's CPU under load); dropped on any error.
        self._conn: Connection | None = None
        self._thread.start()

    def submit(self, fn: Callable[[Connection], T]) -> "Future[T]":
        fut: Future = Future()
        if self._stopped:
            fut.set_exception(StoreError("queue database writer stopped"))
            return fut
        self._jobs.put((fn, fut))
        return fut

    def stop(self, timeout: float = 10.0) -> None:
        if not self._stopped:
            self._stopped = True
            self._jobs.put(None)
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            if self._turn_fd is not None:
                os.close(self._turn_fd)
                self._turn_fd = None

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            # The turn is taken before the batch is gathered: jobs that arrive while another
            # process commits join this batch (one commit for all of them).
            if self._turn_fd is not None:
                fcntl.flock(self._turn_fd, fcntl.LOCK_EX)
            try:
                batch = [item]
                stop_after = False
                while len(batch) < self.max_batch:
                    try:
                        nxt = self._jobs.get_nowait()
                    except queue_mod.Empty:
                        break
                    if nxt is None:
                        stop_after = True
                        break
                    batch.append(nxt)
                self._commit_batch(batch)
            finally:
                if self._turn_fd is not None:
                    fcntl.flock(self._turn_fd, fcntl.LOCK_UN)
            if stop_after:
                return

    def _commit_batch(self, batch: list[tuple[Callable[[Connection], Any], Future]]) -> None:
        results: list[tuple[Future, bool, Any]] = []
        try:
            if self._conn is None:
                self._conn = self.engine.connect()
            conn = self._conn
            with conn.begin():
                # Each job's savepoint is issued on the driver connection: SQLAlchemy's
                # begin_nested() cost ~8 % of a node's CPU under load (docs/performance.md).
                # The jobs only see ``conn``; the outer transaction stays SQLAlchemy's.
                raw = conn.connection.driver_connection
                for fn, fut in batch:
                    if not fut.set_running_or_notify_cancel():
                        continue
                    raw.execute("SAVEPOINT job")
                    try:
                        value = fn(conn)
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller
                        raw.execute("ROLLBACK TO SAVEPOINT job")
                        raw.execute("RELEASE SAVEPOINT job")
                        results.append((fut, False, exc))
                    else:
                        raw.execute("RELEASE SAVEPOINT job")
                        results.append((fut, True, value))
        except BaseException as exc:  # commit failed: nothing of this batch is durable
            self.failing += 1
            if self.failing % 100 == 1:  # not a line per commit while the disk stays full
                log.error("queue database commit failed%s: %s",
                          f" ({self.failing} in a row)" if self.failing > 1 else "", db_error_text(exc))
            if self._conn is not None:
                try:
                    self._conn.invalidate()  # a fresh connection for the next batch
                    self._conn.close()
                except Exception:  # noqa: BLE001 - it is being thrown away
                    pass
                self._conn = None
            if _io_error(exc):
                settle_failed_commit(self.engine)  # before the callers are told (451 to a client)
            err = StoreError(f"commit failed: {db_error_text(exc)}")
            for fn, fut in batch:
                if not fut.done():
                    fut.set_exception(err)
            return
        if self.failing:
            log.warning("queue database commits succeed again, after %d failed", self.failing)
            self.failing = 0
        self.batches += 1
        for fut, ok, value in results:
            self.jobs_done += 1
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)
