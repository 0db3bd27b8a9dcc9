"""What the redundancy layer tells the node: the interface it reports tracking events and failures through.

It owns only the shape of that interface (a typing Protocol); the node
implements it (node/events.py fans an event out to the tracking log, the
metrics and the operational log). Nothing here does I/O.
"""

from __future__ import annotations

from typing import Any, Protocol


class EventSink(Protocol):
    """Where a loop reports what happened to a message, after the commit that made it so."""

    metrics: Any  # prometheus counters: heartbeat_failures, promotions, ...

    def track(self, event_id: str, source: str, row: dict, *, recipients: list[str] | None = None,
              **fields: Any) -> None:
        """One MSGTRK row (and the metrics and log line that go with it); never raises."""

    async def message_failed(self, row: dict, step: str, exc: BaseException) -> bool:
        """One message's handling failed with an internal error: log, count towards the Poison
        queue; never raises; True when the message was moved to the Poison queue now."""
