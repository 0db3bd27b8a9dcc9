"""Which message the node is handling in a step that could kill it: ``DATA_DIR/handling``.

It owns the crash context of Exchange's poison message detection. A message kills a node inside
a synchronous step over its content (a conversion for the next hop, a DSN built from it: a parser
caught in a loop, a C extension's fault, memory blown). A DSN is built on the event loop, which is
all in that step; a conversion runs in a worker thread while the loop goes on (node/connectors.py:
at most two per connector), so the few messages in such a step at the moment of a crash each count
one (a bystander is held only if it was there at ``poison_threshold`` crashes). Around each such
step the message's queue database id and the step's name are written into this file (one
``pwrite`` into the page cache: it survives the death of the process, which is what a message can
cause, not a power loss). At the next start after an unclean stop the ids found there count one
internal failure each (``delivery.poison_threshold``); a kill -9, an OOM kill or a power loss
while the node waits on next hops, peers and clients counts against no message, however many were
being delivered.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

FILE_NAME = "handling"
_RECORD = 256  # bytes rewritten at each change (spaces after the entries): one pwrite, no truncate
log = logging.getLogger("transportd")


class HandlingMark:
    """The file's entries (``ID STEP`` lines) while steps run; empty between them."""

    def __init__(self, path: Path | None = None):
        self.path = path
        self._fd: int | None = None
        self._steps: list[tuple[int, str]] = []
        self._failed = False
        self._size = 0  # the file's length: _RECORD, or more while many steps run at once

    @classmethod
    def open(cls, data_dir: Path) -> tuple[HandlingMark, list[tuple[int, str]]]:
        """The node's mark (taken at start, after the data dir's lock) and what the last process
        left in it: the (message id, step) it was handling when it ended, [] when none. Left in
        the file until ``clear()`` (once the start has counted them: a start that fails before
        that leaves them for the next one)."""
        mark = cls(data_dir / FILE_NAME)
        try:
            fd = os.open(mark.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            log.warning("cannot open %s (%s): a message that crashes the node will not be counted "
                        "towards the Poison queue", mark.path, exc.strerror)
            return cls(), []
        try:
            left = parse(os.pread(fd, 1 << 16, 0))
            mark._size = os.fstat(fd).st_size
        except OSError:
            left = []
        mark._fd = fd
        return mark, left

    def clear(self) -> None:
        """Forget what the last process left (its crash has been counted)."""
        self._write()

    @contextlib.contextmanager
    def step(self, message_id: int, name: str) -> Iterator[None]:
        """Mark ``message_id`` as handled in step ``name`` while the block runs."""
        entry = (int(message_id), name)
        self._steps.append(entry)
        self._write()
        try:
            yield
        finally:
            self._steps.remove(entry)
            self._write()

    def _write(self) -> None:
        if self._fd is None:
            return
        data = "".join(f"{mid} {name}\n" for mid, name in self._steps).encode()
        size = max(len(data), _RECORD)
        try:
            os.pwrite(self._fd, data.ljust(size), 0)
            if size != self._size:  # nothing of a longer record left behind
                os.ftruncate(self._fd, size)
                self._size = size
        except OSError as exc:
            if not self._failed:  # said once: the node goes on, only the crash context is missing
                log.warning("cannot write %s (%s): a message that crashes the node may not be counted "
                            "towards the Poison queue", self.path, exc.strerror)
            self._failed = True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def parse(data: bytes) -> list[tuple[int, str]]:
    """The file's entries; lines that are none (a torn or foreign write) are skipped."""
    out = []
    for line in data.decode("ascii", "replace").splitlines():
        mid, _, name = line.strip().partition(" ")
        if mid.isdigit() and mid.isascii() and len(mid) < 19:  # a queue database id (SQLite's 64 bits)
            out.append((int(mid), name.strip() or "handling"))
    return out


NO_MARK = HandlingMark()  # nothing written (unit tests that build one part of a node)
