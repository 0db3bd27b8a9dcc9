"""A real OpenSMTPD (Debian's opensmtpd) in a private spool, for tests: a third MTA with ways of
its own. As a server it offers neither PIPELINING nor CHUNKING nor SMTPUTF8 (8BITMIME, SIZE and
DSN only); as a client it sends one command at a time with DATA, and relays to a smart host with
STARTTLS and AUTH when told to.

It listens on one loopback address and port only and relays everything it takes to one next hop
(``relay host smtp://...``). Never point it at anything but loopback.

OpenSMTPD's spool (``/var/spool/smtpd``) and control socket (``/run/smtpd.sock``) are compiled
in; each daemon runs in a mount namespace of its own (``unshare -m``) where its folder's
``spool`` and ``run`` are mounted there, so several can run and none touches the machine's, and
whose ``/etc/resolv.conf`` names loopback only. Debian's
package conflicts with postfix (both are the system MTA), so the binary comes unpacked from the
package (``scripts/opensmtpd-setup.sh``, which .ci/run calls): ``TRANSPORTD_OPENSMTPD`` or
``/opt/transportd-opensmtpd/usr/sbin/smtpd``. It runs as the ``opensmtpd`` and ``opensmtpq``
users, which must exist.
"""

from __future__ import annotations

import os
import pwd
import socket
import subprocess
import time
from pathlib import Path

from transportd.devtools.postfix import (
    LoopbackMTA,
    free_port_on,
    in_mount_namespace,
    mount_namespaces,
    stop_process,
)

UNPACKED = "/opt/transportd-opensmtpd/usr/sbin/smtpd"
USERS = ("opensmtpd", "opensmtpq")
CHROOT = "/var/lib/opensmtpd/empty"
SPOOL = "/var/spool/smtpd"
"""Compiled in; the machine's stays empty (each daemon has its folder's mounted there)."""


def opensmtpd_binary() -> str:
    return os.environ.get("TRANSPORTD_OPENSMTPD") or UNPACKED


def smtpctl_binary() -> str:
    return str(Path(opensmtpd_binary()).with_name("smtpctl"))


class OpenSMTPD(LoopbackMTA):
    """OpenSMTPD in ``work/opensmtpd``: ``start``, ``stop``, ``log``, ``schedule_all``. ``relay`` is
    the action's options after ``relay`` (default: ``host smtp://RELAY_TO``); ``listen`` extra
    options of the listener (e.g. ``tls pki NAME``); ``extra`` more configuration lines."""

    def __init__(self, work: Path, relay_to: str, *, host: str = "127.0.0.1", name: str = "opensmtpd.test",
                 relay: str | None = None, listen: str = "", extra: str = ""):
        self.dir = work / "opensmtpd"
        self.host = host
        self.port = free_port_on(host)
        self.proc: subprocess.Popen | None = None
        spool, run = self.dir / "spool", self.dir / "run"
        for d in (spool, run):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(work, 0o755)
        os.chmod(self.dir, 0o755)
        os.chmod(spool, 0o711)  # smtpd refuses a spool with other modes
        # its resolver asks loopback only (names it looks up are in /etc/hosts or addresses)
        (self.dir / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        action = relay or f"host smtp://{relay_to}"
        (self.dir / "smtpd.conf").write_text(
            "# written by transportd.devtools.opensmtpd: loopback only, one next hop\n"
            f"{extra}\n"
            f"listen on {host} port {self.port} hostname {name} {listen}\n"
            f'action "relay" relay {action} helo {name}\n'
            'match from any for any action "relay"\n')

    @staticmethod
    def available() -> str | None:
        """None when OpenSMTPD can run here, else why not."""
        if os.geteuid() != 0:
            return "OpenSMTPD is started as root here (it runs as opensmtpd and opensmtpq)"
        if not Path(opensmtpd_binary()).exists():
            return "no smtpd binary (bash scripts/opensmtpd-setup.sh)"
        for user in USERS:
            try:
                pwd.getpwnam(user)
            except KeyError:
                return f"no {user} user (bash scripts/opensmtpd-setup.sh)"
        for folder in (CHROOT, SPOOL):
            if not Path(folder).is_dir():
                return f"no {folder} (bash scripts/opensmtpd-setup.sh)"
        return mount_namespaces()

    def _in_namespace(self, *command: str) -> list[str]:
        """``command`` where this instance's spool and control socket folder are the compiled-in paths."""
        return in_mount_namespace({self.dir / "spool": SPOOL, self.dir / "run": "/run",
                                   self.dir / "resolv.conf": "/etc/resolv.conf"}, list(command))

    def log(self) -> str:
        path = self.dir / "smtpd.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self, timeout: float = 20) -> OpenSMTPD:
        """The daemon in the foreground (``-d``, so its pid is the one started), logging verbosely
        to ``smtpd.log``."""
        with open(self.dir / "smtpd.log", "ab") as out:
            self.proc = subprocess.Popen(
                self._in_namespace(opensmtpd_binary(), "-d", "-v", "-f", str(self.dir / "smtpd.conf")),
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                socket.create_connection((self.host, self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"OpenSMTPD did not start on {self.address}: {self.log()[-1500:]}")

    def smtpctl(self, *args: str) -> subprocess.CompletedProcess:
        """``smtpctl`` on this daemon's control socket."""
        return subprocess.run(self._in_namespace(smtpctl_binary(), *args), capture_output=True, text=True,
                              timeout=30, check=False)

    def schedule_all(self) -> None:
        """Every queued message tried again now (OpenSMTPD's own retry waits minutes)."""
        res = self.smtpctl("schedule", "all")
        if res.returncode:
            raise RuntimeError(f"smtpctl schedule all: {(res.stderr or res.stdout).strip()}")

    def stop(self) -> None:
        """SIGTERM to the daemon it started, SIGKILL to its process group after 10 s."""
        proc, self.proc = self.proc, None
        stop_process(proc, "OpenSMTPD")
