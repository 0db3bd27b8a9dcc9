"""A real Exim MTA (Debian's exim4-daemon-light) in a private spool directory, for tests: a peer
that speaks SMTP the way Exim does, which is not Postfix's way. As a client Exim sends with
CHUNKING (``BDAT n LAST``) wherever it is offered, pipelines QUIT behind the last chunk and then
shuts its socket down for writing; as a server it offers CHUNKING, DSN, SMTPUTF8 and PIPELINING.

It listens on one loopback address and port only, relays everything it takes (from loopback only)
to one next hop by address (``manualroute``, no DNS, no ident or reverse lookups), runs a queue
runner every second and retries after two seconds, and writes its logs in its own folder. Never
point it at anything but loopback.

Debian's exim4 packages conflict with postfix (both are the system MTA), so where Postfix is
installed the binary comes unpacked from the package instead (``scripts/exim-setup.sh``, which
.ci/run calls): ``TRANSPORTD_EXIM`` or ``/opt/transportd-exim/usr/sbin/exim4``. The binary was built
for the ``Debian-exim`` user, which must exist. Exim started with ``-C`` by root runs as that user.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from transportd.devtools.postfix import LoopbackMTA, free_port_on, process_alive

UNPACKED = "/opt/transportd-exim/usr/sbin/exim4"
EXIM_USER = "Debian-exim"


def exim_binary() -> str:
    return os.environ.get("TRANSPORTD_EXIM") or shutil.which("exim4") or UNPACKED


class EximMTA(LoopbackMTA):
    """Exim in ``work/exim``: ``start``, ``stop``, ``mainlog``; ``settings`` are extra main
    options (name -> value) over the defaults below; ``transport`` extra options of the smtp
    transport that relays (e.g. ``hosts_require_tls``); with ``auth`` (user, password) Exim
    authenticates to the next hop with AUTH PLAIN and requires it."""

    def __init__(self, work: Path, relay_to: str, *, host: str = "127.0.0.1", name: str = "exim.test",
                 settings: dict[str, str] | None = None, transport: dict[str, str] | None = None,
                 auth: tuple[str, str] | None = None):
        self.dir = work / "exim"
        self.host = host
        self.port = free_port_on(host)
        self.pid = 0
        spool = self.dir / "spool"
        spool.mkdir(parents=True, exist_ok=True)
        os.chmod(work, 0o755)
        os.chmod(self.dir, 0o755)
        if os.geteuid() == 0:
            shutil.chown(spool, EXIM_USER, EXIM_USER)
        relay_host, relay_port = relay_to.rsplit(":", 1)
        main = {
            "primary_hostname": name, "exim_path": exim_binary(), "spool_directory": str(spool),
            "log_file_path": f"{spool}/%slog", "pid_file_path": f"{spool}/exim.pid",
            "exim_user": EXIM_USER, "exim_group": EXIM_USER, "daemon_smtp_ports": str(self.port),
            "local_interfaces": host, "host_lookup": "", "rfc1413_hosts": "", "tls_advertise_hosts": "",
            "dsn_advertise_hosts": "*", "smtputf8_advertise_hosts": "*", "chunking_advertise_hosts": "*",
            "pipelining_advertise_hosts": "*", "acl_smtp_rcpt": "acl_rcpt", "never_users": "",
            "keep_environment": "", "queue_run_max": "2", "ignore_bounce_errors_after": "1m",
            "log_selector": "+received_recipients +smtp_protocol_error +smtp_syntax_error +deliver_time",
            **(settings or {})}
        smtp = {"driver": "smtp", "port": relay_port, "hosts_avoid_tls": "*", "hosts_try_chunking": "*",
                **({"hosts_require_auth": "*"} if auth else {}), **(transport or {})}
        authenticators = ("" if auth is None else "\nbegin authenticators\nplain:\n  driver = plaintext\n"
                          f"  public_name = PLAIN\n  client_send = ^{auth[0]}^{auth[1]}\n")
        (self.dir / "exim.conf").write_text(
            "# written by transportd.devtools.exim: loopback only, one next hop\n"
            + "".join(f"{k} = {v}\n" for k, v in main.items())
            + "\nbegin acl\nacl_rcpt:\n  accept hosts = 127.0.0.0/8\n  deny message = relay not permitted\n"
            + f"\nbegin routers\nrelay:\n  driver = manualroute\n  route_list = * {relay_host}\n"
            + "  transport = relay\n  self = send\n"
            + "\nbegin transports\nrelay:\n" + "".join(f"  {k} = {v}\n" for k, v in smtp.items())
            + "\nbegin retry\n* * F,10m,2s\n" + authenticators)

    @staticmethod
    def available() -> str | None:
        """None when Exim can run here, else why not."""
        if os.geteuid() != 0:
            return "Exim is started as root here (it then runs as Debian-exim)"
        if not Path(exim_binary()).exists():
            return "no exim4 binary (bash scripts/exim-setup.sh)"
        try:
            pwd.getpwnam(EXIM_USER)
        except KeyError:
            return f"no {EXIM_USER} user (bash scripts/exim-setup.sh)"
        res = subprocess.run([exim_binary(), "-C", "/dev/null", "-bV"], capture_output=True, text=True,
                             timeout=30, check=False)
        if "Exim version" not in res.stdout:
            return f"exim4 -bV failed: {(res.stderr or res.stdout).strip()[:200]}"
        return None

    def exim(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([exim_binary(), "-C", str(self.dir / "exim.conf"), *args], capture_output=True,
                              text=True, timeout=60, check=False)

    def mainlog(self) -> str:
        log = self.dir / "spool" / "mainlog"
        return log.read_text(errors="replace") if log.exists() else ""

    def start(self, timeout: float = 20) -> EximMTA:
        pid_file = self.dir / "spool" / "exim.pid"
        pid_file.unlink(missing_ok=True)  # a stopped daemon's (a restart must not read its pid)
        self.exim("-bd", "-q1s")  # the daemon detaches; its pid is in the pid file
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:  # (the file can go or be half written between two looks: a daemon writing or removing it)
                text = pid_file.read_text()
                pid = int(text.split()[0]) if text.strip() else 0
            except (OSError, ValueError):
                pid = 0
            if pid:
                self.pid = pid
                try:
                    socket.create_connection((self.host, self.port), timeout=1).close()
                    return self
                except OSError:
                    pass
            time.sleep(0.1)
        panic = self.dir / "spool" / "paniclog"
        raise RuntimeError(f"exim did not start on {self.address}: {self.mainlog()[-1500:]}"
                           f"{panic.read_text(errors='replace')[-1500:] if panic.exists() else ''}")

    def stop(self) -> None:
        """SIGTERM to the daemon it started, SIGKILL after 10 s (its delivery processes are its children)."""
        if not self.pid:
            return
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and process_alive(self.pid):
                time.sleep(0.1)
            if not process_alive(self.pid):
                break
        self.pid = 0

