"""The operational log's formats: text with the message's ids, or one JSON object per line.

It owns how a log record is written (``[internal_message_id=.. network_message_id=..]``
or JSON keys) and the set-up of the root logger; it never decides what is logged.
"""

from __future__ import annotations

import json
import logging
import sys

class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
               "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        for key in ("internal_message_id", "network_message_id", "node"):
            if hasattr(record, key):
                out[key] = getattr(record, key)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = [f"{k}={'-' if getattr(record, k) in (None, '') else getattr(record, k)}"
               for k in ("internal_message_id", "network_message_id") if hasattr(record, k)]
        return line + (" [" + " ".join(ids) + "]" if ids else "")


def setup_logging(level: str = "info", fmt: str = "text", name: str = "") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        prefix = f"{name} " if name else ""
        handler.setFormatter(TextFormatter(f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    for noisy in ("aiosmtpd", "aiosmtplib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("mail.log").setLevel(logging.ERROR)  # aiosmtpd's per-line chatter and deprecations
