"""Changes to many messages from the command line, in short transactions that take turns with the node.

It owns how an operator's bulk change (``message remove|suspend|resume``, ``safetynet
resubmit``) is cut into transactions while a node may be running on the same queue
database: each transaction takes the writer turn the node's group-commit writer takes
(``store.writer_turn``), ends after ``--batch-size`` messages or about
``TRANSACTION_TIME`` seconds of work, whichever comes first, and the command pauses
between two of them so the node's writer, woken when the turn is released, commits first.
A node's 250 then waits at most one such transaction, as Postfix's smtpd waits for no more
than one file operation of postsuper. What each message's change is stays the caller's (a
queue-layer function over a run of ids); this module never decides which messages change.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from sqlalchemy.engine import Connection

from transportd.queue.store import QueueStore

# Work per transaction, about: the command's next step of ids starts only while less has passed.
TRANSACTION_TIME = 0.15
# Ids per step inside a transaction, at first: the time is checked between steps; a step that
# took less than an eighth of the budget is followed by one twice as long (at most MAX_STEP).
STEP = 16
MAX_STEP = 512
# The pause after each transaction: the node's writer, blocked on the turn, is woken when it is
# released and takes it in this time (a thread of a busy node needs a few ms to run).
YIELD_TIME = 0.02


def in_turns(store: QueueStore, ids: Sequence[int], change: Callable[[Connection, Sequence[int]], list],
             *, max_batch: int, budget: float = TRANSACTION_TIME, step: int = STEP) -> Iterator[list]:
    """Apply ``change`` (a connection, a run of ids -> what changed) to ``ids`` in order, in as
    many transactions as it takes; yields what each transaction changed, after its commit.
    ``step``: the ids of the first step (1 where one id may cost much: a whole body read and
    written again)."""
    done = 0
    while done < len(ids):
        if done:
            time.sleep(YIELD_TIME)
        changed, taken = store.transaction(
            functools.partial(_bounded, ids=ids[done:done + max_batch], change=change, budget=budget, step=step))
        done += taken
        yield changed


def _bounded(conn: Connection, ids: Sequence[int], change: Callable[[Connection, Sequence[int]], list],
             budget: float, step: int = STEP) -> tuple[list[Any], int]:
    """``change`` over steps of ``ids`` until they are all done or ``budget`` seconds have passed
    (at least one step): (what changed, how many ids were taken)."""
    start = last = time.monotonic()
    changed: list[Any] = []
    taken, size = 0, step
    while taken < len(ids):
        run = ids[taken:taken + size]
        changed += change(conn, run)
        taken += len(run)
        now = time.monotonic()
        if now - start >= budget:
            break
        if now - last < budget / 8:
            size = min(2 * size, MAX_STEP)
        last = now
    return changed, taken
