"""The operational log: its formats, and the fields a line carries from the context it is logged in.

It owns how a log record is written (readable text with ``[internal_message_id=..
network_message_id=..]``, or one JSON object per line with ``ts`` in UTC and the fields as
keys), the log context (``log_context``: contextvars that carry a message's ids, the tracking
event, the queue, the peer and the client address to every line logged inside it, through a
handler filter instead of ``extra=`` at each call), and the set-up of the root logger (Python
warnings included, so a JSON log holds nothing but JSON). It never decides what is logged.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

# The fields a line may carry beyond its text, in the order JSON shows them.
FIELDS = ("node", "event", "internal_message_id", "network_message_id", "queue", "peer", "client")
# The fields the text format shows (at the end of the line, as before).
TEXT_FIELDS = ("internal_message_id", "network_message_id")

_context: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("transportd_log_context",
                                                                                default=None)


@contextlib.contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Every line logged inside (in this task, and in tasks it starts) carries these fields; a
    field given as ``extra=`` to one call still wins. None values are left out."""
    token = _context.set({**(_context.get() or {}), **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _context.reset(token)


def message_context(row: dict, **fields: Any) -> contextlib.AbstractContextManager[None]:
    """``log_context`` with a message row's internal and network ids."""
    return log_context(internal_message_id=row.get("id"), network_message_id=row.get("network_message_id") or "",
                       **fields)


class ContextFilter(logging.Filter):
    """Copies the log context's fields onto each record (a handler filter: every logger's lines)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in (_context.get() or {}).items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def utc_timestamp(created: float) -> str:
    """``2026-11-25T07:15:37.459Z``: ISO 8601, UTC, milliseconds."""
    return datetime.fromtimestamp(created, tz=UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": utc_timestamp(record.created), "level": record.levelname.lower(),
                               "logger": record.name, "message": record.getMessage()}
        for key in FIELDS:
            if hasattr(record, key):
                out[key] = getattr(record, key)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    converter = time.gmtime  # UTC, shown with a Z

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = [f"{k}={'-' if getattr(record, k) in (None, '') else getattr(record, k)}"
               for k in TEXT_FIELDS if hasattr(record, k)]
        return line + (" [" + " ".join(ids) + "]" if ids else "")


def setup_logging(level: str = "info", fmt: str = "text", name: str = "") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ContextFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        prefix = f"{name} " if name else ""
        handler.setFormatter(TextFormatter(f"%(asctime)s.%(msecs)03dZ {prefix}%(levelname)s %(name)s: %(message)s",
                                           datefmt="%Y-%m-%dT%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    logging.captureWarnings(True)  # warnings.warn() lines go through the handler too
    for noisy in ("aiosmtpd",):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("mail.log").setLevel(logging.ERROR)  # aiosmtpd's per-line chatter and deprecations
