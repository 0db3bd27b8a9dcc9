"""Discards applied on the shadow side (unit, on a real queue database with its group-commit writer)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest

from transportd.config import load_dict
from transportd.queue import messages as mq
from transportd.queue import shadows as sq
from transportd.queue.routing import bifurcate
from transportd.queue.store import QueueStore
from transportd.redundancy.shadow_queue import ShadowQueues


class Sink:
    """The node's EventSink, recording the tracking rows asked for."""

    metrics: Any = None

    def __init__(self) -> None:
        self.tracked: list[tuple[str, str]] = []

    def track(self, event_id: str, source: str, row: dict, *, recipients=None, **fields: Any) -> None:
        self.tracked.append((event_id, fields.get("source_context", "")))

    async def message_failed(self, row: dict, step: str, exc: BaseException) -> bool:
        return False


def test_a_discard_cut_short_by_its_caller_still_writes_every_hadiscard(tmp_path, monkeypatch):
    """A heartbeat's time limit (or a stop) cancelling the discard while its commit is under way
    left the copies removed with no HADISCARD row (a CI run: 1,003 shadows gone from the queue,
    none in the tracking log). The discard finishes on its own and tracks each copy."""
    cfg = load_dict({"node": {"name": "n2.t", "data_dir": str(tmp_path)}})
    store = QueueStore.open(tmp_path / "queue.db")
    store.start_writer()
    now = time.time()
    guids = [str(uuid.uuid4()) for _ in range(5)]

    def seed(conn):
        for i, guid in enumerate(guids):
            mq.enqueue(conn, mq.NewMessage(
                network_message_id=str(uuid.uuid4()), sender="a@x.test", data=b"Subject: s\r\n\r\nb\r\n",
                recipients=bifurcate([f"r{i}@far.test"], cfg), received_at=now, expires_at=now + 3600,
                origin="shadow", role="shadow", redundancy="shadow", shadow_guid=guid, primary_node="p1.t",
                primary_internal_id=i + 1, primary_dbid="db1"))
    store.transaction(seed)
    real = sq.apply_discards

    def slow_apply(*args, **kwargs):  # the commit of a large batch, in the writer thread
        time.sleep(0.4)
        return real(*args, **kwargs)
    monkeypatch.setattr(sq, "apply_discards", slow_apply)
    sink = Sink()
    queues = ShadowQueues(cfg, store, sink, reshadow=lambda rows, why: None)

    async def scenario() -> None:
        task = asyncio.create_task(queues.discard("p1.t", [(g, "DeletedByAdmin") for g in guids], now))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 5
        while len(sink.tracked) < len(guids) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    try:
        asyncio.run(scenario())
        assert sorted(sink.tracked) == sorted(("HADISCARD", f"DeletedByAdmin;{g}") for g in guids)
        left = store.read(lambda c: c.exec_driver_sql(
            "SELECT count(*) FROM messages WHERE role = 'shadow' AND state = 'Queued'").scalar())
        assert left == 0
    finally:
        store.close()
