"""One running node per data directory: an exclusive lock on ``DATA_DIR/node.lock``.

It owns taking the lock at start (a second ``transportd serve`` on the same data directory
stops with one line naming the first one's pid, as Postfix's ``master.lock`` does: two
daemons delivering one queue would send every message twice) and telling the CLI whether a
node holds it. The kernel drops the lock when the process ends, however it ends (kill -9
included), so there is nothing stale to clean after a crash. It never reads the queue database.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from pathlib import Path

LOCK_NAME = "node.lock"
log = logging.getLogger("transportd")


class DataDirInUse(OSError):
    """Another process holds the data directory's lock."""


def take(data_dir: Path) -> int | None:  # called once at start, before the event loop serves anything
    """Lock ``data_dir`` for this process and write its pid in the lock file; the file
    descriptor (keep it open while the node runs). DataDirInUse when a node already runs there;
    None (and a warning) where the file system has no locks to give (some network mounts)."""
    path = data_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        for attempt in range(10):  # a CLI's look (``holder``) holds it for an instant: try again
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt == 9:
                    raise
                time.sleep(0.05)
    except BlockingIOError:
        pid = _read_pid(fd)
        os.close(fd)
        raise DataDirInUse(f"node.data_dir {data_dir}: another transportd node runs on it"
                           f"{f' (pid {pid})' if pid else ''}; stop it first") from None
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        log.warning("cannot lock %s (%s): a second node started on this data dir would not be refused",
                    path, exc.strerror)
        return None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def holder(data_dir: Path) -> int | None:
    """The pid of the node running on ``data_dir`` (0 when its pid cannot be read), or None
    when none does. Only looks: the lock is taken for an instant at most, never kept."""
    try:
        fd = os.open(data_dir / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no lock file: no node ever ran here (or an older version did)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_pid(fd) or 0
    except OSError:
        return None
    finally:
        os.close(fd)
    return None


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
