"""queue/direct.py: the per-message statements run on the SQLite connection under SQLAlchemy's.

They must write what SQLAlchemy's Core statements wrote (the same defaults), refuse what those
refused (an unknown column), and stay inside the caller's transaction: a job the group-commit
writer rolls back (its savepoint) leaves nothing, a committed one is on disk.
"""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import Column, Integer, MetaData, Table, create_engine, insert, select

from transportd.queue import messages as mq
from transportd.queue.direct import Insert, Update
from transportd.queue.routing import NextHop
from transportd.queue.store import QueueStore, messages, metadata, recipients


def _engine():
    engine = create_engine("sqlite://")
    metadata.create_all(engine)
    return engine


def test_an_insert_takes_the_same_defaults_as_sqlalchemy_core() -> None:
    given = {"network_message_id": "n1", "size": 10, "received_at": 1.5, "expires_at": 2.5}
    with _engine().begin() as conn:
        direct_id = Insert(messages).run(conn, given)
        core_id = conn.execute(insert(messages), given).inserted_primary_key[0]
        direct, core = (dict(conn.execute(select(messages).where(messages.c.id == i)).mappings().one())
                        for i in (direct_id, core_id))
    assert direct.pop("id") == direct_id and core.pop("id") == core_id != direct_id
    assert direct == core
    assert direct["origin"] == "smtp" and direct["state"] == "Queued" and direct["poison_count"] == 0


def test_unknown_columns_and_callable_defaults_are_refused() -> None:
    with _engine().begin() as conn:
        with pytest.raises(KeyError, match="no column spam"):
            Insert(messages).run(conn, {"network_message_id": "n", "spam": 1})
        with pytest.raises(KeyError, match="no column spam"):
            Update(messages).run(conn, {"spam": 1}, 1)
        with pytest.raises(Exception, match="NOT NULL"):  # size has no default: SQLite refuses it
            Insert(messages).run(conn, {"network_message_id": "n", "received_at": 1.0, "expires_at": 2.0})
    odd = Table("odd", MetaData(), Column("id", Integer, primary_key=True, autoincrement=True),
                Column("n", Integer, default=lambda: 1))
    with pytest.raises(ValueError, match="odd.n"):
        Insert(odd)


def test_an_update_sets_only_the_columns_given_and_counts_rows() -> None:
    with _engine().begin() as conn:
        mid = Insert(messages).run(conn, {"network_message_id": "n", "size": 1, "received_at": 1.0,
                                          "expires_at": 2.0, "subject": "kept"})
        assert mq.UPDATE_MESSAGE.run(conn, {"state": mq.SAFETY_NET, "completed_at": 3.0}, mid) == 1
        assert mq.UPDATE_MESSAGE.run(conn, {"state": mq.SAFETY_NET}, mid + 100) == 0
        row = conn.execute(select(messages).where(messages.c.id == mid)).mappings().one()
    assert (row["state"], row["completed_at"], row["subject"]) == (mq.SAFETY_NET, 3.0, "kept")


def _message(n: int) -> mq.NewMessage:
    return mq.NewMessage(network_message_id=f"n{n}", sender="a@b.test", data=b"Subject: x\r\n\r\nhi\r\n",
                         recipients={NextHop("smarthost:127.0.0.1:25", "smarthost", "127.0.0.1:25"): ["c@d.test"]},
                         received_at=1.0, expires_at=100.0)


def test_direct_statements_live_and_die_with_the_writers_job(tmp_path) -> None:
    """A job that enqueues (direct statements) and then raises is rolled back by its savepoint;
    the job beside it in the same batch commits, and is there after a reopen."""
    store = QueueStore.open(tmp_path / "queue.db")
    store.start_writer()

    def good(conn):
        return mq.enqueue(conn, _message(1))

    def bad(conn):
        mq.enqueue(conn, _message(2))
        raise RuntimeError("the job fails after its inserts")

    async def both():
        return await asyncio.gather(store.write(good), store.write(bad), return_exceptions=True)

    mid, err = asyncio.run(both())
    assert isinstance(err, RuntimeError)
    store.close()
    store = QueueStore.open(tmp_path / "queue.db")
    try:
        ids = store.read(lambda c: c.execute(select(messages.c.network_message_id)).scalars().all())
        rcpts = store.read(lambda c: c.execute(select(recipients.c.message_id)).scalars().all())
        assert ids == ["n1"] and rcpts == [mid]
        assert store.read(lambda c: mq.body(c, mid)) == _message(1).data
        assert store.read(lambda c: mq.message_row(c, mid))["network_message_id"] == "n1"
        assert store.read(lambda c: mq.message_row(c, mid + 1)) is None
        with pytest.raises(LookupError):
            store.transaction(lambda c: mq.finish_if_done(c, mid + 1, 5.0, 60.0))
    finally:
        store.close()
