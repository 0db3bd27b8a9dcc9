"""The local mailbox store: one Maildir per recipient under ``<data_dir>/mailboxes``.

It owns file layout and durable writes (tmp/, fsync, rename into new/, fsync the
folder). A delivered file is named after the message's network-message-id, so
a copy re-delivered after a crash (between the file write and the queue
database commit) is recognised and not stored twice. Duplicate detection by
(recipient, Message-ID, Date) lives beside the Maildirs in ``queue/delivered.py``
(so it survives a lost queue database); this module never touches a database.
"""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path

from transportd.queue.store import fsync_dir as _fsync_dir
from transportd.smtp.addresses import address_key

_UNSAFE = re.compile(r"[^A-Za-z0-9._+@=-]")


def mailbox_name(address: str) -> str:
    """A folder name for an address: ``address_key``'s form (lower-cased, the domain as its A-label:
    one folder for both spellings of an internationalized domain), with anything unsafe %-encoded
    ('/' and '..' too)."""
    name = _UNSAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m.group(0).encode("utf-8", "surrogateescape")),
                       address_key(address))
    if name.startswith("."):
        name = "%2E" + name[1:]
    return name.replace("..", ".%2E")


class MailboxStore:
    def __init__(self, root: Path, hostname: str | None = None):
        self.root = Path(root)
        self.hostname = (hostname or socket.gethostname()).replace("/", "_").replace(":", "_")

    def maildir(self, address: str) -> Path:
        return self.root / mailbox_name(address)

    def _ensure(self, md: Path) -> None:
        if not (md / "new").is_dir():
            for sub in ("tmp", "new", "cur"):
                (md / sub).mkdir(parents=True, exist_ok=True)
            _fsync_dir(md)
            _fsync_dir(md.parent)

    def _find(self, md: Path, network_message_id: str) -> Path | None:
        for sub in ("new", "cur"):
            d = md / sub
            if d.is_dir():
                for entry in os.scandir(d):
                    if f".{network_message_id}." in entry.name:
                        return Path(entry.path)
        return None

    def has(self, address: str, network_message_id: str) -> bool:
        return self._find(self.maildir(address), network_message_id) is not None

    def deliver(self, address: str, network_message_id: str, data: bytes,
                received_at: float | None = None) -> tuple[Path, bool]:
        """Store ``data`` durably; returns (path, stored_now). stored_now is False if already there."""
        md = self.maildir(address)
        self._ensure(md)
        existing = self._find(md, network_message_id)
        if existing is not None:
            return existing, False
        stamp = int(received_at if received_at is not None else time.time())
        name = f"{stamp}.{network_message_id}.{self.hostname}"
        tmp = md / "tmp" / name
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        final = md / "new" / f"{name},S={len(data)}"
        os.rename(tmp, final)
        _fsync_dir(md / "new")
        return final, True

    def list(self, address: str) -> list[Path]:
        md = self.maildir(address)
        out: list[Path] = []
        for sub in ("new", "cur"):
            d = md / sub
            if d.is_dir():
                out.extend(sorted(d.iterdir()))
        return out

