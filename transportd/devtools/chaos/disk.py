"""Disk-full faults: a node's data directory on a tmpfs the harness mounts, filled, then freed.

It owns the mounts (root only: ``cannot_mount`` says why not, and the harness then does not
schedule the fault), filling a node's disk (the tmpfs remounted to what it holds plus a small
margin, then a filler file written until ENOSPC, so a fill costs little memory whatever the
mount's size), freeing it (filler deleted, size restored), and at the end putting each data
directory's files back in the run folder as plain files. It never starts, stops or signals a
node; the nemesis does that, the harness reads what the clients saw (``replies_while_full``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path

FILLER = ".chaos-disk-filler"
SIZE_MB = 1024    # the mount's normal size: a cap, tmpfs uses memory only for what it holds
MARGIN_KB = 256   # room left when filling, before the filler takes it


def _mount(args: list[str]) -> str | None:
    """Run mount/umount; None on success, else its complaint."""
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if r.returncode == 0 else (r.stderr.strip() or f"exit {r.returncode}")


def cannot_mount(scratch: Path) -> str | None:
    """Why the harness cannot mount a tmpfs here (None: it can): tried once on a scratch folder."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    if not shutil.which("mount") or not shutil.which("umount"):
        return "no mount/umount command"
    probe = Path(tempfile.mkdtemp(prefix=".mount-probe-", dir=scratch))
    try:
        error = _mount(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)])
        if error is None:
            _mount(["umount", str(probe)])
        return None if error is None else f"cannot mount a tmpfs: {error}"
    finally:
        shutil.rmtree(probe, ignore_errors=True)


class DiskNotFilled(RuntimeError):
    """The disk could not be filled cheaply (its tmpfs did not shrink): the fault is not done."""


class TmpfsDisks:
    """The data directories on their own tmpfs, by node."""

    def __init__(self, size_mb: int = SIZE_MB):
        self.size_mb = size_mb
        self.mounted: dict[str, Path] = {}
        self.full: set[str] = set()

    def mount(self, short: str, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        if any(path.iterdir()):
            raise RuntimeError(f"{path} is not empty: it would be hidden by the mount")
        error = _mount(["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m,mode=0755", "tmpfs", str(path)])
        if error is not None:
            raise RuntimeError(f"cannot mount a tmpfs on {path}: {error}")
        self.mounted[short] = path

    def fill(self, short: str) -> int:
        """Fill the node's disk; returns the bytes it held before (its data)."""
        path = self.mounted[short]
        # Shrink the mount to what it holds plus a margin: the filler then needs little memory
        # (tried again if the node wrote more in between: a tmpfs never shrinks below its use).
        for _ in range(5):
            st = os.statvfs(path)
            used_kb = (st.f_blocks - st.f_bfree) * st.f_frsize // 1024
            error = _mount(["mount", "-o", f"remount,size={used_kb + MARGIN_KB}k", str(path)])
            if error is None:
                break
        else:
            raise DiskNotFilled(f"cannot shrink the tmpfs of {short} to fill it: {error}")
        self.full.add(short)
        fd = os.open(path / FILLER, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for block in (b"\0" * 65536, b"\0" * 4096, b"\0" * 512):  # until not even 512 bytes fit
                try:
                    while os.write(fd, block):
                        pass
                except OSError:
                    pass
        finally:
            os.close(fd)
        return used_kb * 1024

    def free(self, short: str) -> None:
        path = self.mounted.get(short)
        if path is None:
            return
        try:
            os.unlink(path / FILLER)
        except FileNotFoundError:
            pass
        _mount(["mount", "-o", f"remount,size={self.size_mb}m", str(path)])
        self.full.discard(short)

    def free_all(self) -> None:
        for short in list(self.full):
            self.free(short)

    def unmount_all(self) -> None:
        """Unmount every data directory, its files put back in the run folder (nodes stopped first)."""
        for short, path in list(self.mounted.items()):
            self.free(short)
            keep = Path(tempfile.mkdtemp(prefix=f".{short}-data-", dir=path.parent))
            shutil.copytree(path, keep, dirs_exist_ok=True, symlinks=True)
            if _mount(["umount", str(path)]) is not None:
                _mount(["umount", "-l", str(path)])
            for entry in keep.iterdir():
                os.replace(entry, path / entry.name)
            keep.rmdir()
            del self.mounted[short]


def replies_while_full(attempts: Iterable[tuple[str, str, str, float]], node_ip: str, start: float,
                       end: float) -> dict[str, int]:
    """What the clients got from ``node_ip`` between ``start`` and ``end``, from (node, outcome,
    detail, at) per attempt: counted as ack, 4xx (deferred), 5xx (rejected) and unknown."""
    out = {"ack": 0, "4xx": 0, "5xx": 0, "unknown": 0}
    for node, outcome, detail, at in attempts:
        if node != node_ip or not start <= at <= end:
            continue
        if outcome == "ack":
            out["ack"] += 1
        elif outcome == "unknown":
            out["unknown"] += 1
        elif detail[:1] == "5":
            out["5xx"] += 1
        elif detail[:1] == "4":
            out["4xx"] += 1
    return out
