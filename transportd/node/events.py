"""Event fan-out: every tracking event goes to the MSGTRK log, the metrics and the operational log.

It owns writing one tracking row per event (after the commit it describes),
moving the metrics that go with it, the operational log line (with the event, the
message's ids, queue, peer and client as log-context fields), and counting a
message's internal failures towards the Poison queue. It never raises into the
loop that reports: a failing tracking log or metric is itself logged, and mail
goes on. Every loop (accept, delivery, redundancy) reports through one instance.
"""

from __future__ import annotations

import logging
from typing import Any

from transportd.node.handling import NO_MARK
from transportd.node.logs import message_context
from transportd.queue import messages as mq
from transportd.queue.messages import NewMessage
from transportd.queue.notices import dsn_tracking
from transportd.queue.store import QueueStore
from transportd.tracking import return_path, sender_address

log = logging.getLogger("transportd")

# Operational log level of the line each tracking event also writes (RECEIVE has its own "queued" line).
EVENT_LOG_LEVELS = {e: logging.INFO for e in ("DELIVER", "DUPLICATEDELIVER", "SEND", "SENDEXTERNAL", "DEFER",
                                              "FAIL", "DSN", "DROP", "RESUBMIT", "HAREDIRECTFAIL")}
EVENT_LOG_LEVELS["POISONMESSAGE"] = logging.WARNING


def event_fields(event_id: str, row: dict, fields: dict[str, Any]) -> dict[str, Any]:
    """The log fields of a tracking event: the event, its queue (connector), the peer it concerns
    (a ``peer:`` queue's node, or the primary of a shadow event) and the client address."""
    queue = fields.get("connector_id") or None
    peer = None
    if queue and queue.startswith("peer:"):
        peer = queue.partition(":")[2]
    elif event_id.startswith("HA") and fields.get("client_hostname"):
        peer = fields["client_hostname"]
    return {"event": event_id, "queue": queue, "peer": peer,
            "client": fields.get("client_ip") or row.get("client_ip") or None}


def message_ids(row: dict) -> dict[str, Any]:
    """``extra=`` for a log line about a message: its internal and network message ids."""
    return {"internal_message_id": row.get("id"), "network_message_id": row.get("network_message_id") or ""}


class NullTrackingLog:
    pending_rows = dropped_rows = 0

    def write(self, *args: Any, **kwargs: Any) -> None:
        pass

    def write_pending(self) -> int:
        return 0

    def close(self) -> None:
        pass


class NodeEvents:
    """The one place a node reports what happened to a message."""

    def __init__(self, cfg: Any, metrics: Any, store: QueueStore | None = None, tracking: Any = None):
        self.cfg = cfg
        self.metrics = metrics
        self.store = store
        self.tracking = tracking or NullTrackingLog()
        self.handling = NO_MARK  # the node's crash context once it runs (node/handling.py)

    @property
    def poison_threshold(self) -> int | None:
        d = self.cfg.delivery
        return d.poison_threshold if d.poison_message_detection_enabled else None

    async def message_failed(self, row: dict, step: str, exc: BaseException) -> bool:
        """One message's handling failed with an internal error in ``step`` (any loop): log it with
        its ids and the error, count it towards the Poison queue. Never raises; returns True when
        the message was moved to the Poison queue now."""
        with message_context(row):
            log.error("%s of message %s failed with an internal error: %s: %s", step, row.get("id"),
                      exc.__class__.__name__, exc, exc_info=exc)
            self.metrics.internal_failures.labels(step).inc()
            if row.get("id") is None or self.store is None:
                return False
            threshold = self.poison_threshold
            try:
                moved = await self.store.write(lambda c: mq.count_internal_failure(c, row["id"], threshold))
            except Exception as err:  # noqa: BLE001 - counting is best effort; the message stays where it is
                log.error("could not count the failure of message %s: %s", row.get("id"), err)
                return False
            if moved:
                self.poisoned(row, f"{step}: {exc.__class__.__name__}: {exc}")
            return moved

    def poisoned(self, row: dict, reason: str) -> None:
        """Tell that a message was moved to the Poison queue (after the commit that moved it)."""
        self.metrics.poisoned.inc()
        with message_context(row, queue=mq.POISON):
            log.warning("message %s moved to the Poison queue after %d internal failure(s) (last: %s); "
                        "'transportd message resume %s' releases it, 'message remove' drops it",
                        row.get("id"), self.poison_threshold or 0, reason, row.get("id"))
        self.track("POISONMESSAGE", "QUEUE", row, source_context=f"PoisonThreshold={self.poison_threshold};{reason}"[:500])

    # ------------------------------------------------------------------ tracking helpers

    def track(self, event_id: str, source: str, row: dict, *, recipients: list[str] | None = None,
              **fields: Any) -> None:
        """Write one tracking row for a message row, move the metrics, log a line; never raises.
        The line (and any logged on the way) carries the event, the ids, the queue, the peer and
        the client address as fields (JSON log)."""
        with message_context(row, **event_fields(event_id, row, fields)):
            self._track(event_id, source, row, recipients, fields)

    def _track(self, event_id: str, source: str, row: dict, recipients: list[str] | None,
               fields: dict[str, Any]) -> None:
        kept = getattr(self.tracking, "pending_rows", 0)  # rows a full disk left go before this one
        try:
            self.tracking.write(
                event_id, source,
                internal_message_id=row.get("id"), message_id=row.get("message_id") or "",
                network_message_id=row.get("network_message_id") or "",
                recipients=recipients or [], total_bytes=row.get("size"),
                message_subject=row.get("subject") or "", sender_address=sender_address(row),
                return_path=return_path(row.get("sender")), **fields)
        except Exception as exc:  # noqa: BLE001 - logging must not fail mail
            log.error("cannot write tracking log (%s %s): %s; %d row(s) kept to write when it can "
                      "(%d given up)", event_id, row.get("id"), exc, getattr(self.tracking, "pending_rows", 0),
                      getattr(self.tracking, "dropped_rows", 0))
        else:
            if kept:
                log.info("tracking log writable again: wrote %d kept row(s)", kept)
        try:
            self.metrics.on_event(event_id, row, str(fields.get("source_context") or ""),
                                  str(fields.get("connector_id") or ""))
            level = EVENT_LOG_LEVELS.get(event_id, logging.DEBUG)
            if event_id != "RECEIVE" and log.isEnabledFor(level):
                status = fields.get("recipient_status")
                detail = (status[0] if status else "") or fields.get("source_context") or ""
                shown = ", ".join((recipients or [])[:5]) + (" ..." if len(recipients or []) > 5 else "")
                log.log(level, "%s message %s (network id %s)%s%s", event_id, row.get("id"),
                        row.get("network_message_id") or "", f" for {shown}" if shown else "",
                        f": {detail}" if detail else "")
        except Exception as exc:  # noqa: BLE001 - metrics and logs must not fail mail
            log.error("cannot record %s for message %s: %s", event_id, row.get("id"), exc)

    def write_kept_tracking_rows(self) -> None:
        """Write the tracking rows a failed write kept (a disk that was full); never raises."""
        waiting = self.tracking.pending_rows
        if not waiting:
            return
        try:
            left = self.tracking.write_pending()
        except Exception as exc:  # noqa: BLE001 - tried again at the next round
            log.debug("tracking log still refuses its %d kept row(s): %s", waiting, exc)
            return
        log.info("tracking log writable again: wrote %d kept row(s)", waiting - left)

    def apply_tracking_retention(self, now: float) -> None:
        """Remove the tracking-log files past tracking.message_tracking_log_max_age or beyond
        message_tracking_log_max_directory_size (never the file being written); never raises."""
        remove = getattr(self.tracking, "remove_old_files", None)  # none where tracking is off
        t = self.cfg.tracking
        if remove is None or not (t.message_tracking_log_max_age or t.message_tracking_log_max_directory_size):
            return
        try:
            removed = remove(now, t.message_tracking_log_max_age, t.message_tracking_log_max_directory_size)
        except OSError as exc:  # tried again at the next round
            log.error("tracking log retention: cannot remove old files: %s", exc)
            return
        for path, size, why in removed:
            log.info("tracking log retention: removed %s (%d bytes), %s", path.name, size, why)

    def log_dsn(self, original: dict, dsn_id: int, dsn: NewMessage) -> None:
        row, fields = dsn_tracking(original, dsn_id, dsn)
        self.track("DSN", "DSN", row, **fields)

