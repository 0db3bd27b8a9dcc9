"""Fault preconditions: a fault that exists for a situation waits for it, up to a limit.

It owns the rule and nothing else: poll a probe until it says the situation holds or
the limit passes (``wait_until``; clock and sleep injected, so it is unit-tested
without a cluster), which node the sink-refusing wipe takes (``wipe_target``: the
scheduled node as soon as it holds mail queued behind the refusing sink, after a
grace time whichever node holds the most), and which messages sit between the
shadow's 250 and the client's (``between_acks``). A fault whose precondition never
held is not done: the nemesis does not apply it and the run does not count it. It
never reads a queue database or touches a node: the probes are the harness's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

# How long a fault waits for its precondition before it is given up as not done.
WIPE_LIMIT = 30.0       # mail queued behind the refusing sink (clients may not have reached the node yet)
MID_SHADOW_LIMIT = 10.0  # a message between the shadow's 250 and the client's (never with shadows off)


@dataclass
class Waited(Generic[T]):
    held: bool
    value: T | None     # what the probe returned when the precondition held
    waited: float       # seconds from the first look to the last
    looks: int


def wait_until(probe: Callable[[float], T | None], *, limit: float, poll: float,
               clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
               stopped: Callable[[], bool] = lambda: False) -> Waited[T]:
    """Call ``probe(elapsed)`` every ``poll`` seconds until it returns something other than None
    (the precondition holds: that value is returned) or ``limit`` seconds have passed; it is
    always looked at once, and once more at the limit. ``stopped()`` ends the wait early."""
    t0 = clock()
    looks = 0
    while True:
        elapsed = clock() - t0
        looks += 1
        value = probe(max(0.0, elapsed))
        if value is not None:
            return Waited(True, value, round(elapsed, 2), looks)
        if elapsed >= limit or stopped():
            return Waited(False, None, round(elapsed, 2), looks)
        sleep(min(poll, max(0.0, limit - elapsed)) or poll)


def wipe_target(queued: dict[str, int], preferred: str, elapsed: float, grace: float,
                minimum: int = 1) -> str | None:
    """The node the sink-refusing wipe takes, or None to keep waiting.

    ``queued``: mail each node holds behind the refusing sink. The scheduled node as soon as
    it holds ``minimum``; after ``grace`` seconds (the clients may not be sending to it at all)
    whichever node holds the most, the scheduled one on a tie."""
    if queued.get(preferred, 0) >= minimum:
        return preferred
    if elapsed < grace:
        return None
    best = max(sorted(queued), key=lambda n: (queued[n], n == preferred), default=None)
    return best if best is not None and queued[best] >= minimum else None


def between_acks(committed_on_node: Iterable[str], shadows_on_peers: Iterable[str]) -> set[str]:
    """Network ids of copies peers hold as shadows of the node's messages that the node has not
    committed yet (so not acknowledged: its 250 follows its commit): the window kill-mid-shadow
    is for."""
    return set(shadows_on_peers) - set(committed_on_node)
