"""The queue database: creation, its ID, pragmas, corrupt files, schema versions, group commit.

Unit tests on temporary files, plus one real daemon started on a garbage queue.db.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy import select

from conftest import queued_id, swaks, wait_for
from transportd.queue import store as store_mod
from transportd.queue.store import SCHEMA_VERSION, CorruptDatabase, QueueStore, StoreError, meta

GARBAGE = os.urandom(64) + b"this is not a database" + os.urandom(4000)


def _db_id_raw(path: Path) -> str:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT value FROM meta WHERE key = 'queue_database_id'").fetchone()[0]
    finally:
        conn.close()


def _corrupt_files(folder: Path, name: str = "queue.db") -> list[Path]:
    return sorted(p for p in folder.iterdir()
                  if p.name.startswith(f"{name}.corrupt-") and not p.name.endswith(("-wal", "-shm")))


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "queue.db"


def _populated(path: Path, rows: int = 40) -> str:
    """A transportd DB with some data, closed cleanly; returns its ID."""
    s = QueueStore.open(path)
    try:
        s.transaction(lambda c: c.execute(meta.insert(), [
            {"key": f"filler{i}", "value": "x" * 3000} for i in range(rows)]))
        return s.queue_database_id
    finally:
        s.close()


# --------------------------------------------------------------------------- creation and ID

def test_new_database_gets_a_guid_stored_inside(db_path: Path) -> None:
    s = QueueStore.open(db_path, node_name="n1.test")
    try:
        dbid = s.queue_database_id
        assert str(uuid.UUID(dbid)) == dbid
        stored = s.read(lambda c: dict(c.execute(select(meta.c.key, meta.c.value)).all()))
        assert stored["queue_database_id"] == dbid
        assert stored["node_name"] == "n1.test"
        assert float(stored["created_at"]) > 0
    finally:
        s.close()
    assert _db_id_raw(db_path) == dbid
    again = QueueStore.open(db_path, create=False)
    try:
        assert again.queue_database_id == dbid
    finally:
        again.close()


def test_two_new_databases_have_different_ids(tmp_path: Path) -> None:
    a = QueueStore.open(tmp_path / "a" / "queue.db")  # parent folder is created
    b = QueueStore.open(tmp_path / "b" / "queue.db")
    try:
        assert a.queue_database_id != b.queue_database_id
    finally:
        a.close()
        b.close()


def test_connections_use_wal_full_sync_and_foreign_keys(db_path: Path) -> None:
    s = QueueStore.open(db_path)
    try:
        for engine in (s.write_engine, s.read_engine):
            with engine.connect() as conn:
                assert conn.exec_driver_sql("PRAGMA journal_mode").scalar().lower() == "wal"
                assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
                assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert s.read(lambda c: c.exec_driver_sql("PRAGMA user_version").scalar()) == SCHEMA_VERSION
    finally:
        s.close()
    assert SCHEMA_VERSION == len(store_mod.MIGRATIONS)
    raw = sqlite3.connect(db_path)
    try:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"  # persistent in the file
    finally:
        raw.close()


def test_missing_file_without_create_raises_store_error(db_path: Path) -> None:
    with pytest.raises(StoreError, match="no queue database"):
        QueueStore.open(db_path, create=False)
    assert not db_path.exists()


def test_directory_instead_of_file_is_refused_and_kept(db_path: Path) -> None:
    db_path.mkdir()
    with pytest.raises(StoreError, match="directory"):
        QueueStore.open(db_path, repair=True)
    assert db_path.is_dir()


def test_empty_file_becomes_a_new_database(db_path: Path) -> None:
    db_path.write_bytes(b"")
    s = QueueStore.open(db_path)
    try:
        uuid.UUID(s.queue_database_id)
    finally:
        s.close()


# --------------------------------------------------------------------------- corrupt files

def _foreign_sqlite(path: Path) -> bytes:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
    conn.execute("INSERT INTO notes (body) VALUES ('somebody else''s data')")
    conn.commit()
    conn.close()
    return path.read_bytes()


def _truncated(path: Path) -> bytes:
    _populated(path)
    data = path.read_bytes()
    assert len(data) > 40_000
    path.write_bytes(data[: len(data) // 2])
    return path.read_bytes()


def _garbage(path: Path) -> bytes:
    path.write_bytes(GARBAGE)
    return GARBAGE


BAD_FILES = {"random-bytes": _garbage, "foreign-sqlite": _foreign_sqlite, "truncated": _truncated}


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_bad_file_without_repair_raises_and_is_left_alone(db_path: Path, kind: str) -> None:
    original = BAD_FILES[kind](db_path)
    with pytest.raises(CorruptDatabase):
        QueueStore.open(db_path, repair=False)
    assert db_path.read_bytes() == original
    assert _corrupt_files(db_path.parent) == []


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_bad_file_with_repair_is_moved_aside_and_replaced(db_path: Path, kind: str, caplog) -> None:
    prior_id = _populated(db_path.with_name("other.db"))  # an unrelated ID, to compare against
    original = BAD_FILES[kind](db_path)
    with caplog.at_level("ERROR", logger="transportd.queue.store"):
        s = QueueStore.open(db_path, repair=True)
    try:
        new_id = s.queue_database_id
        uuid.UUID(new_id)
        assert new_id != prior_id
        assert s.read(lambda c: c.exec_driver_sql("PRAGMA user_version").scalar()) == SCHEMA_VERSION
    finally:
        s.close()
    moved = _corrupt_files(db_path.parent)
    assert len(moved) == 1, list(db_path.parent.iterdir())
    assert moved[0].read_bytes() == original  # never deleted, never changed
    assert "moved aside" in caplog.text and moved[0].name in caplog.text
    assert _db_id_raw(db_path) == new_id


def test_truncated_database_gets_a_new_id(db_path: Path) -> None:
    old_id = _populated(db_path)
    data = db_path.read_bytes()
    db_path.write_bytes(data[: len(data) // 3])
    s = QueueStore.open(db_path, repair=True)
    try:
        assert s.queue_database_id != old_id
    finally:
        s.close()


def test_repeated_repairs_keep_every_bad_file(db_path: Path) -> None:
    contents = []
    for i in range(3):
        data = f"garbage number {i} ".encode() * 300
        db_path.write_bytes(data)
        contents.append(data)
        QueueStore.open(db_path, repair=True).close()
    moved = _corrupt_files(db_path.parent)
    assert sorted(p.read_bytes() for p in moved) == sorted(contents)


def test_database_without_id_is_corrupt(db_path: Path) -> None:
    _populated(db_path)
    raw = sqlite3.connect(db_path)
    raw.execute("DELETE FROM meta WHERE key = 'queue_database_id'")
    raw.commit()
    raw.close()
    with pytest.raises(CorruptDatabase, match="no queue database ID"):
        QueueStore.open(db_path)
    assert db_path.exists()


def test_crash_before_checkpoint_keeps_database_and_id(db_path: Path) -> None:
    # The main file of a fresh database still says user_version 0 after a crash: all its
    # content is in the -wal. Reopening (even with repair) must find it, not move it aside.
    code = ("import os, sys\n"
            "from transportd.queue.store import QueueStore, meta\n"
            "s = QueueStore.open(sys.argv[1])\n"
            "s.transaction(lambda c: c.execute(meta.insert().values(key='k', value='v')))\n"
            "print(s.queue_database_id, flush=True)\n"
            "os._exit(0)\n")
    r = subprocess.run([sys.executable, "-c", code, str(db_path)], capture_output=True, text=True, timeout=60)
    dbid = r.stdout.strip()
    assert r.returncode == 0 and dbid, r.stderr
    assert db_path.with_name("queue.db-wal").stat().st_size > 0
    s = QueueStore.open(db_path, repair=True)
    try:
        assert s.queue_database_id == dbid
        assert s.read(lambda c: c.execute(select(meta.c.value).where(meta.c.key == "k")).scalar()) == "v"
    finally:
        s.close()
    assert _corrupt_files(db_path.parent) == []


def test_environment_error_is_not_corruption(db_path: Path) -> None:
    # A healthy database that cannot be written (here: its -shm is a directory, so SQLite
    # reports "readonly") must not be moved aside and replaced by an empty one.
    dbid = _populated(db_path)
    original = db_path.read_bytes()
    shm = db_path.with_name("queue.db-shm")
    shm.mkdir()
    with pytest.raises(StoreError) as info:
        QueueStore.open(db_path, repair=True)
    assert not isinstance(info.value, CorruptDatabase)
    assert "readonly" in str(info.value)
    assert _corrupt_files(db_path.parent) == [] and db_path.read_bytes() == original
    shm.rmdir()
    s = QueueStore.open(db_path, repair=True)
    try:
        assert s.queue_database_id == dbid
    finally:
        s.close()


def test_newer_schema_version_raises_store_error_and_is_not_moved(db_path: Path) -> None:
    dbid = _populated(db_path)
    raw = sqlite3.connect(db_path)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 5}")
    raw.commit()
    raw.close()
    for repair in (False, True):
        with pytest.raises(StoreError) as info:
            QueueStore.open(db_path, repair=repair)
        assert not isinstance(info.value, CorruptDatabase)
        msg = str(info.value)
        assert f"schema version {SCHEMA_VERSION + 5}" in msg and "newer" in msg and "upgrade" in msg
    assert _corrupt_files(db_path.parent) == []
    assert _db_id_raw(db_path) == dbid


# --------------------------------------------------------------------------- group commit

def _kv(conn, key: str, value: str = "v") -> None:
    conn.execute(meta.insert().values(key=key, value=value))


def test_group_commit_batches_and_returns_each_result(db_path: Path) -> None:
    s = QueueStore.open(db_path)
    writer = s.start_writer()
    started, release = threading.Event(), threading.Event()

    def blocker(conn):
        started.set()
        assert release.wait(10)
        _kv(conn, "blocker")
        return "blocker-result"

    try:
        first = writer.submit(blocker)
        assert started.wait(10)
        futures = [writer.submit(lambda conn, i=i: (_kv(conn, f"job{i}"), i * 10)[1]) for i in range(50)]
        release.set()
        assert first.result(10) == "blocker-result"
        assert [f.result(10) for f in futures] == [i * 10 for i in range(50)]
        assert writer.jobs_done == 51
        assert writer.batches <= 3  # 51 jobs, at most a handful of commits
    finally:
        s.close()
    again = QueueStore.open(db_path, create=False)
    try:
        keys = set(again.read(lambda c: c.execute(select(meta.c.key)).scalars().all()))
        assert {f"job{i}" for i in range(50)} | {"blocker"} <= keys
    finally:
        again.close()


def _turn_holder(db_path: Path) -> subprocess.Popen:
    """Another process that takes ``<db>.writer-turn``, prints ``held``, and lets go at a line on its stdin."""
    return subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(db_path) + '.writer-turn'!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\n"
        "sys.stdin.readline()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_writers_of_several_processes_take_turns_on_the_turn_file(db_path: Path) -> None:
    """A node's receive workers share its queue database: each writer takes the flock of
    ``<db>.writer-turn`` for its transaction, so a waiting writer is woken when the other's commit
    ends (SQLite's busy handler would sleep up to 100 ms between tries). Another process holding
    the turn holds back this writer's commit until it lets go."""
    s = QueueStore.open(db_path)
    writer = s.start_writer()
    holder = _turn_holder(db_path)
    try:
        assert holder.stdout.readline().strip() == "held"
        fut = writer.submit(lambda conn: _kv(conn, "after-the-turn"))
        time.sleep(0.5)
        assert not fut.done()  # waiting for its turn, not committed
        holder.stdin.write("go\n")
        holder.stdin.flush()
        fut.result(10)
    finally:
        holder.kill()
        holder.wait()
        s.close()
    again = QueueStore.open(db_path, create=False)
    try:
        assert "after-the-turn" in set(again.read(lambda c: c.execute(select(meta.c.key)).scalars().all()))
    finally:
        again.close()


def test_a_transaction_of_the_command_line_takes_the_writer_turn_too(db_path: Path) -> None:
    """``QueueStore.transaction`` (the CLI's bulk changes) takes the same turn as the node's
    writers before BEGIN IMMEDIATE: while another process holds it, the transaction does not
    start (before, it took SQLite's lock regardless, and the node's writer, its turn taken, slept
    in the busy handler: 250s waited seconds). Let go, it runs."""
    s = QueueStore.open(db_path)
    holder = _turn_holder(db_path)
    started = threading.Event()
    result: list = []

    def change(conn):
        started.set()
        return _kv(conn, "in-its-turn") or "done"
    try:
        assert holder.stdout.readline().strip() == "held"
        t = threading.Thread(target=lambda: result.append(s.transaction(change)))
        t.start()
        assert not started.wait(0.5)  # waiting for its turn, SQLite's lock not taken
        other = sqlite3.connect(db_path, timeout=0, isolation_level=None)  # nor SQLite's write lock held
        try:
            other.execute("BEGIN IMMEDIATE")
            other.execute("INSERT INTO meta (key, value) VALUES ('while-it-waits', 'v')")
            other.execute("COMMIT")
        finally:
            other.close()
        holder.stdin.write("go\n")
        holder.stdin.flush()
        t.join(10)
        assert result == ["done"]
    finally:
        holder.kill()
        holder.wait()
        s.close()


def test_a_transaction_without_a_turn_file_still_commits(db_path: Path) -> None:
    """A data dir where the turn file cannot be opened (here a folder in its place): the
    transaction goes on as before, SQLite's busy handler deciding."""
    s = QueueStore.open(db_path)
    try:
        (db_path.parent / (db_path.name + ".writer-turn")).mkdir()
        assert s.transaction(lambda c: (_kv(c, "no-turn"), 3)[1]) == 3
        assert "no-turn" in set(s.read(lambda c: c.execute(select(meta.c.key)).scalars().all()))
    finally:
        s.close()


def test_failing_job_is_rolled_back_alone(db_path: Path) -> None:
    s = QueueStore.open(db_path)
    writer = s.start_writer()
    started, release = threading.Event(), threading.Event()

    def blocker(conn):
        started.set()
        assert release.wait(10)
        return None

    def bad(conn):
        _kv(conn, "bad-row")
        raise RuntimeError("job failed on purpose")

    try:
        writer.submit(blocker)
        assert started.wait(10)
        before = writer.submit(lambda c: (_kv(c, "before"), "b")[1])
        failing = writer.submit(bad)
        dup = writer.submit(lambda c: _kv(c, "before"))  # unique key violation: also fails alone
        after = writer.submit(lambda c: (_kv(c, "after"), "a")[1])
        release.set()
        assert before.result(10) == "b"
        assert after.result(10) == "a"
        with pytest.raises(RuntimeError, match="on purpose"):
            failing.result(10)
        with pytest.raises(Exception):
            dup.result(10)
        assert writer.batches == 2  # the four jobs shared one commit
    finally:
        s.close()
    again = QueueStore.open(db_path, create=False)
    try:
        keys = set(again.read(lambda c: c.execute(select(meta.c.key)).scalars().all()))
        assert {"before", "after"} <= keys
        assert "bad-row" not in keys
    finally:
        again.close()


def test_failed_commit_fails_every_job_of_the_batch(db_path: Path) -> None:
    s = QueueStore.open(db_path)
    writer = s.start_writer()
    started, release = threading.Event(), threading.Event()

    def blocker(conn):
        started.set()
        assert release.wait(10)

    def breaks_commit(conn):
        # A deferred foreign-key violation passes the savepoint and fails the COMMIT.
        conn.exec_driver_sql("PRAGMA defer_foreign_keys = ON")
        conn.exec_driver_sql("INSERT INTO message_bodies (message_id, data) VALUES (999999, x'00')")
        return "looks fine"

    try:
        writer.submit(blocker)
        assert started.wait(10)
        innocent = writer.submit(lambda c: (_kv(c, "innocent"), 1)[1])
        culprit = writer.submit(breaks_commit)
        release.set()
        for fut in (innocent, culprit):
            with pytest.raises(StoreError, match="commit failed"):
                fut.result(10)
        # the writer keeps working afterwards
        assert writer.submit(lambda c: (_kv(c, "later"), "ok")[1]).result(10) == "ok"
    finally:
        s.close()
    again = QueueStore.open(db_path, create=False)
    try:
        keys = set(again.read(lambda c: c.execute(select(meta.c.key)).scalars().all()))
        assert "later" in keys and "innocent" not in keys
        assert again.read(lambda c: c.exec_driver_sql("SELECT count(*) FROM message_bodies").scalar()) == 0
    finally:
        again.close()


def test_async_write_through_writer_and_without(db_path: Path) -> None:
    s = QueueStore.open(db_path)

    async def run() -> list:
        out = [await s.write(lambda c: (_kv(c, "no-writer"), 1)[1])]
        s.start_writer()
        out += await asyncio.gather(*(s.write(lambda c, i=i: (_kv(c, f"w{i}"), i)[1]) for i in range(20)))
        out.append(await s.aread(lambda c: c.execute(select(meta.c.value).where(meta.c.key == "w7")).scalar()))
        return out

    try:
        result = asyncio.run(run())
        assert result == [1, *range(20), "v"]
    finally:
        s.close()


def test_transaction_is_all_or_nothing(db_path: Path) -> None:
    s = QueueStore.open(db_path)
    try:
        def half(conn):
            _kv(conn, "half")
            raise ValueError("boom")
        with pytest.raises(ValueError):
            s.transaction(half)
        assert s.transaction(lambda c: (_kv(c, "whole"), 7)[1]) == 7
        keys = set(s.read(lambda c: c.execute(select(meta.c.key)).scalars().all()))
        assert "whole" in keys and "half" not in keys
    finally:
        s.close()


def _driver(conn):
    return conn.connection.driver_connection


def test_reads_keep_their_threads_connection_and_see_every_commit(db_path: Path) -> None:
    """A thread's reads share one connection (no pool checkout per read); no read snapshot stays
    open between reads (each sees what was committed before it); a read that raises drops its
    connection; another thread reads on its own."""
    from concurrent.futures import ThreadPoolExecutor

    s = QueueStore.open(db_path)
    try:
        keys = lambda c: set(c.execute(select(meta.c.key)).scalars().all())  # noqa: E731
        first = s.read(_driver)
        assert s.read(_driver) is first
        assert "seen" not in s.read(keys)
        s.transaction(lambda c: _kv(c, "seen"))
        assert "seen" in s.read(keys) and s.read(_driver) is first

        def broken(conn):
            conn.exec_driver_sql("SELECT * FROM no_such_table")
        with pytest.raises(Exception, match="no_such_table"):
            s.read(broken)
        again = s.read(_driver)
        assert again is not first and s.read(_driver) is again and "seen" in s.read(keys)
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(s.read, _driver).result(10) is not again
        # a read inside a read on the same thread gets a connection of its own; both work on
        nested = s.read(lambda c: (_driver(c), s.read(_driver), s.read(keys)))
        assert nested[0] is again and nested[1] is not again and "seen" in nested[2]
        with pytest.raises(Exception, match="no_such_table"):
            s.read(lambda c: s.read(broken))  # raised through both: both connections dropped
        assert s.read(_driver) is not again and "seen" in s.read(keys)
    finally:
        s.close()
    assert not s._readers


def test_read_here_runs_on_the_calling_thread_and_sees_commits(db_path: Path) -> None:
    """The delivery's point read runs on the event loop's thread itself (no hop to a worker
    thread), on that thread's own connection, and sees what the writer committed just before."""
    s = QueueStore.open(db_path)
    writer = s.start_writer()
    try:
        async def main():
            here = threading.get_ident()
            await s.write(lambda c: _kv(c, "fresh"))
            ident, conn, value = s.read_here(lambda c: (
                threading.get_ident(), _driver(c),
                c.execute(select(meta.c.value).where(meta.c.key == "fresh")).scalar()))
            elsewhere = await s.aread(_driver)
            return ident == here, conn is s.read(_driver) and conn is not elsewhere, value
        assert asyncio.run(main()) == (True, True, "v")
        assert writer.jobs_done == 1
    finally:
        s.close()


def test_more_reading_threads_than_the_pool_holds_do_not_wait(db_path: Path) -> None:
    """Each reading thread keeps a connection; 24 threads reading at once (a 16-core node's default
    executor has 20) must not wait for a connection that no thread returns."""
    n = 24
    s = QueueStore.open(db_path)
    barrier = threading.Barrier(n, timeout=20)
    try:
        def hold(conn):
            barrier.wait()  # every thread holds its connection here at the same time
            return conn.exec_driver_sql("SELECT count(*) FROM meta").scalar()
        results: list = []
        threads = []
        for _ in range(n):
            t = threading.Thread(target=lambda: results.append(s.read(hold)))
            threads.append(t)
            t.start()
        for t in threads:
            t.join(30)
        assert len(results) == n and all(r >= 1 for r in results)
    finally:
        s.close()


def test_close_waits_for_a_read_under_way_on_another_thread(db_path: Path) -> None:
    """A node's stop closes the reader connections while a worker thread may still be reading
    (a heartbeat's or the scheduler's read): closing its connection under it made the stop fail
    ("cannot rollback - no transaction is active", exit status 1) or the read. ``close`` waits
    for the read, then closes."""
    s = QueueStore.open(db_path)
    started, release = threading.Event(), threading.Event()

    def slow(conn):
        conn.exec_driver_sql("SELECT 1").scalar()
        started.set()
        release.wait(5)
        return conn.exec_driver_sql("SELECT count(*) FROM meta").scalar()

    results: list = []
    reader = threading.Thread(target=lambda: results.append(s.read(slow)))
    reader.start()
    assert started.wait(5)
    threading.Timer(0.3, release.set).start()
    t0 = time.monotonic()
    s.close()
    waited = time.monotonic() - t0
    reader.join(5)
    assert len(results) == 1 and results[0] >= 1 and waited >= 0.25


def test_stopped_writer_refuses_jobs(db_path: Path) -> None:
    s = QueueStore.open(db_path)
    writer = s.start_writer()
    s.close()
    with pytest.raises(StoreError, match="stopped"):
        writer.submit(lambda c: None).result(5)


# --------------------------------------------------------------------------- real daemon

def test_daemon_moves_garbage_database_aside_and_serves(make_node) -> None:
    node = make_node()
    node.data_dir.mkdir(parents=True)
    db = node.data_dir / "queue.db"
    old_id = _populated(db)
    db.write_bytes(GARBAGE)
    node.start()
    r = swaks(node.port, "--to", "alice@example.test", "--from", "bob@remote.test",
              "--header", "Subject: after-repair")
    queued_id(r)
    files = wait_for(lambda: node.maildir_files("alice@example.test"), what="maildir file")
    assert b"Subject: after-repair" in files[0].read_bytes()
    assert "moved aside" in node.log()
    moved = _corrupt_files(node.data_dir)
    assert len(moved) == 1 and moved[0].read_bytes() == GARBAGE
    assert moved[0].name in node.log()
    assert node.stop() == 0
    s = QueueStore.open(db, create=False)
    try:
        assert s.queue_database_id != old_id
        uuid.UUID(s.queue_database_id)
        assert s.queue_database_id in node.log()
    finally:
        s.close()



def test_version_1_database_migrates_and_keeps_its_messages(tmp_path) -> None:
    """A data directory from schema version 1 opens with this code: migrated in place, same ID, same mail."""
    import sqlite3 as sq
    import time as _time
    import uuid as _uuid

    from transportd.queue import messages as mq
    from transportd.queue.routing import NextHop
    from transportd.queue.store import SCHEMA_VERSION

    path = tmp_path / "queue.db"
    store = QueueStore.open(path)
    dbid = store.queue_database_id
    hop = NextHop("smarthost:127.0.0.1:2500", "SmartHostConnectorDelivery", "127.0.0.1:2500")
    msg = mq.NewMessage(str(_uuid.uuid4()), "a@b.test", b"Subject: v1\r\n\r\nbody\r\n", {hop: ["c@d.test"]},
                        _time.time(), _time.time() + 100)
    mid = store.transaction(lambda c: mq.enqueue(c, msg))
    store.close()
    # Turn it back into what schema version 1 wrote: no shadow_forks, no v2 columns.
    con = sq.connect(path)
    con.execute("DROP TABLE shadow_forks")
    con.execute("DROP INDEX ix_messages_pending")  # schema 5's
    con.execute("DROP INDEX ix_discard_events_token")
    con.execute("ALTER TABLE messages DROP COLUMN primary_dbid")
    con.execute("ALTER TABLE discard_events DROP COLUMN sent_token")
    con.execute("PRAGMA user_version = 1")
    con.commit()
    con.close()

    store = QueueStore.open(path, repair=True)
    try:
        assert store.queue_database_id == dbid
        assert store.read(lambda c: c.exec_driver_sql("PRAGMA user_version").scalar()) == SCHEMA_VERSION
        columns = {r[1] for r in store.read(lambda c: c.exec_driver_sql("PRAGMA table_info(messages)").all())}
        assert "primary_dbid" in columns
        assert store.read(lambda c: mq.body(c, mid)) == b"Subject: v1\r\n\r\nbody\r\n"
        assert store.read(lambda c: c.exec_driver_sql("SELECT count(*) FROM shadow_forks").scalar()) == 0
        indexes = {r[0] for r in store.read(lambda c: c.exec_driver_sql(
            "SELECT name FROM sqlite_master WHERE type = 'index'").all())}
        assert {"ix_messages_dsn_of", "ix_messages_pending", "ix_discard_events_token"} <= indexes  # schemas 3, 5
    finally:
        store.close()
    assert not list(tmp_path.glob("queue.db.corrupt-*"))


def test_version_6_database_drops_the_indexes_no_query_needs(tmp_path) -> None:
    """Schema 7: ``ix_recipients_queue`` (the prefix of ``ix_recipients_queue_due``) is dropped and
    ``ix_messages_dsn_of`` holds DSNs only; a DSN is still found by the message it reports on."""
    import sqlite3 as sq

    path = tmp_path / "queue.db"
    QueueStore.open(path).close()
    con = sq.connect(path)  # what schema 6 had
    con.execute("DROP INDEX ix_messages_dsn_of")
    con.execute("CREATE INDEX ix_messages_dsn_of ON messages (dsn_of)")
    con.execute("CREATE INDEX ix_recipients_queue ON recipients (queue_id, status)")
    con.execute("PRAGMA user_version = 6")
    con.commit()
    con.close()

    store = QueueStore.open(path)
    try:
        rows = dict(store.read(lambda c: c.exec_driver_sql(
            "SELECT name, sql FROM sqlite_master WHERE type = 'index'").all()))
        assert "ix_recipients_queue" not in rows and "ix_recipients_queue_due" in rows
        assert rows["ix_messages_dsn_of"].endswith("WHERE dsn_of IS NOT NULL")
        plan = store.read(lambda c: c.exec_driver_sql(
            "EXPLAIN QUERY PLAN SELECT count(*) FROM messages WHERE dsn_of = ?", (5,)).all())
        assert any("ix_messages_dsn_of" in str(r[-1]) for r in plan), plan
        plan = store.read(lambda c: c.exec_driver_sql(
            "EXPLAIN QUERY PLAN SELECT id FROM recipients WHERE queue_id = ? AND status = ?", (1, "Ready")).all())
        assert any("ix_recipients_queue_due" in str(r[-1]) for r in plan), plan
    finally:
        store.close()


def test_daemon_with_a_read_only_database_says_so_and_exits_cleanly(make_node) -> None:
    """A queue database the node cannot write (made immutable: root ignores file modes) stops the
    start with one line naming the database, exit 1, no traceback; it was a raw OperationalError
    out of the first write, after the store had opened."""
    import shutil
    import subprocess as sp

    if shutil.which("chattr") is None:
        pytest.skip("chattr not installed")
    node = make_node()
    node.start()
    assert node.stop() == 0
    db = node.data_dir / "queue.db"
    if sp.run(["chattr", "+i", str(db)], capture_output=True, check=False).returncode != 0:
        pytest.skip("this file system has no immutable flag")
    try:
        node.start(wait=False)
        assert node.proc is not None
        assert node.proc.wait(timeout=30) == 1
        log = node.log()
        assert "cannot start: queue database" in log and str(db) in log and "readonly" in log, log
        assert "Traceback" not in log
    finally:
        sp.run(["chattr", "-i", str(db)], capture_output=True, check=False)


def test_sighup_is_said_and_the_node_goes_on(make_node) -> None:
    """A hangup killed the node (no handler): a crash as far as the next start could tell. It is
    logged, and the node keeps serving; SIGTERM still stops it cleanly."""
    import signal as sig

    node = make_node()
    node.start()
    assert node.proc is not None
    node.proc.send_signal(sig.SIGHUP)
    wait_for(lambda: "SIGHUP" in node.log(), what="the SIGHUP line")
    assert node.alive
    queued_id(swaks(node.port, "--to", "alice@example.test", "--from", "bob@remote.test"))
    assert node.stop() == 0


def test_a_certificate_and_a_key_that_do_not_match_stop_the_start_naming_the_keys(make_node, tmp_path) -> None:
    """They said only "[X509: KEY_VALUES_MISMATCH] key values mismatch": not which setting."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    ca.issue_cert("node1.transportd.test").cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    ca.issue_cert("other.transportd.test").private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    node = make_node(overrides={"frontend": {"tls_certificate": str(tmp_path / "cert.pem"),
                                             "tls_key": str(tmp_path / "key.pem")}})
    node.start(wait=False)
    assert node.proc is not None and node.proc.wait(timeout=30) == 1
    log = node.log()
    assert "cannot start: frontend.tls_certificate and frontend.tls_key" in log and "key.pem" in log, log
    assert "Traceback" not in log


def test_a_data_dir_that_is_a_file_stops_the_start_naming_the_key(make_node) -> None:
    """It said only "[Errno 17] File exists"."""
    node = make_node()
    node.data_dir.parent.mkdir(parents=True, exist_ok=True)
    node.data_dir.write_text("not a folder")
    node.start(wait=False)
    assert node.proc is not None and node.proc.wait(timeout=30) == 1
    assert f"cannot start: node.data_dir: {node.data_dir} is not a folder" in node.log(), node.log()


def test_a_listen_address_that_is_no_address_stops_the_start_naming_the_key(make_node) -> None:
    """It said "[Errno -2] ..." or "Unknown error -2" (a resolver error taken for an OS error); then
    it was refused only once the start had made the data dir and a new queue database. Now the
    configuration is refused (exit 2) before anything is made."""
    node = make_node(overrides={"transport": {"listen": "999.1.1.1:2526"}})
    node.start(wait=False)
    assert node.proc is not None and node.proc.wait(timeout=30) == 2
    assert "transport.listen: 999.1.1.1 is not an IPv4 address" in node.log(), node.log()
    assert not (node.data_dir / "queue.db").exists()


def test_a_tracking_log_path_that_is_a_file_stops_the_start_naming_the_key(make_node) -> None:
    """It said only "[Errno 17] File exists", after the queue database had been made."""
    node = make_node()
    target = node.data_dir.parent / "afile"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("not a folder")
    node = make_node(overrides={"tracking": {"message_tracking_log_path": str(target)}})
    node.start(wait=False)
    assert node.proc is not None and node.proc.wait(timeout=30) == 1
    assert f"cannot start: tracking.message_tracking_log_path: {target} is not a folder" in node.log(), node.log()
    assert not (node.data_dir / "queue.db").exists()


def test_a_command_stopped_with_ctrl_z_in_its_transaction_stops_after_the_turn_is_free(db_path: Path) -> None:
    """Ctrl-Z (SIGTSTP) in the middle of a command line's transaction: the command stops once the
    transaction is over and the writer turn released, not holding it (the node's writers block on
    the turn: every 250 would wait until the operator typed ``fg``)."""
    QueueStore.open(db_path).close()
    cmd = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from transportd.queue.store import QueueStore\n"
        f"s = QueueStore.open(Path({str(db_path)!r}), create=False)\n"
        "def change(conn):\n"
        "    print('in', flush=True)\n"
        "    time.sleep(1.0)\n"
        "s.transaction(change)\n"
        "print('done', flush=True)\n"
        "time.sleep(30)\n")], stdout=subprocess.PIPE, text=True,
        # A group of its own in this session, as a shell's job is: the kernel drops the stop
        # signals of a group with no parent outside it in the session (an orphaned group: a
        # session started with setsid, as CI's is).
        process_group=0)
    try:
        assert cmd.stdout.readline().strip() == "in"
        cmd.send_signal(signal.SIGTSTP)
        fd = os.open(str(db_path) + ".writer-turn", os.O_RDWR)
        try:
            deadline = time.monotonic() + 6
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    assert time.monotonic() < deadline, "the stopped command still holds the writer turn"
                    time.sleep(0.05)
        finally:
            os.close(fd)
        # It stops once the turn is released (the signal was held back meanwhile).
        stopped = wait_for(lambda: Path(f"/proc/{cmd.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T",
                           timeout=5, what="the command stopped")
        assert stopped
    finally:
        cmd.send_signal(signal.SIGCONT)
        cmd.kill()
        cmd.wait()
