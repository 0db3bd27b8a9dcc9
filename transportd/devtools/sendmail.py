"""A real Sendmail (Debian's sendmail-bin 8.17) in a private queue, for tests: the classic MTA. As
a server it offers PIPELINING, 8BITMIME, SIZE, DSN, ETRN and DELIVERBY (no CHUNKING, no SMTPUTF8);
as a client it pipelines RCPT and DATA and passes the DSN parameters on.

Its configuration is built from Debian's m4 files (``sendmail-cf``) with ``m4``: one daemon on one
loopback address and port, a smart host by address (``[127.0.0.1]``, no MX lookup) on the port
given, a queue runner every second, SMTP traffic written to ``traffic.log`` (``-X``). Sendmail
logs to syslog only; the traffic log is what a test reads. Never point it at anything but loopback.

Sendmail qualifies its own host name at start and sleeps a minute where it cannot, and it asks
the resolver; each daemon runs in a mount namespace of its own (``unshare -m``) whose
``/etc/hosts`` names it and whose ``/etc/resolv.conf`` points at loopback only. Debian's package
conflicts with postfix (both are the system MTA), so the binary comes unpacked from the package
(``scripts/sendmail-setup.sh``, which .ci/run calls): ``TRANSPORTD_SENDMAIL`` or
``/opt/transportd-sendmail``.
"""

from __future__ import annotations

import os
import shutil
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

UNPACKED = "/opt/transportd-sendmail"


def sendmail_root() -> Path:
    return Path(os.environ.get("TRANSPORTD_SENDMAIL") or UNPACKED)


def sendmail_binary() -> Path:
    return sendmail_root() / "usr/libexec/sendmail/sendmail"


class SendmailMTA(LoopbackMTA):
    """Sendmail in ``work/sendmail``: ``start``, ``stop``, ``traffic`` (the SMTP it spoke, each
    line prefixed with the process id and ``>>>`` sent or ``<<<`` read); ``defines`` are extra m4
    ``define``s (e.g. ``confMAX_RCPTS_PER_MESSAGE``)."""

    def __init__(self, work: Path, relay_to: str, *, host: str = "127.0.0.1", name: str = "sendmail.test",
                 defines: dict[str, str] | None = None):
        self.dir = work / "sendmail"
        self.host = host
        self.name = name
        self.port = free_port_on(host)
        self.proc: subprocess.Popen | None = None
        queue = self.dir / "mqueue"
        queue.mkdir(parents=True, exist_ok=True)
        os.chmod(queue, 0o700)
        relay_host, relay_port = relay_to.rsplit(":", 1)
        cf = sendmail_root() / "usr/share/sendmail/cf"
        settings = {
            "confDOMAIN_NAME": name, "confDONT_PROBE_INTERFACES": "True", "QUEUE_DIR": str(queue),
            "ALIAS_FILE": "", "STATUS_FILE": str(self.dir / "statistics"), "confPID_FILE": str(self.dir / "sendmail.pid"),
            "confHOST_STATUS_DIRECTORY": "", "confSERVICE_SWITCH_FILE": str(self.dir / "service.switch"),
            "confMIN_QUEUE_AGE": "0", "confDELIVERY_MODE": "background", "confTO_QUEUEWARN": "1h",
            "SMART_HOST": f"relay:[{relay_host}]", "RELAY_MAILER_ARGS": f"TCP $h {relay_port}",
            **(defines or {})}
        (self.dir / "sendmail.mc").write_text(
            "divert(-1)\n# written by transportd.devtools.sendmail: loopback only, one next hop\ndivert(0)dnl\n"
            f"include(`{cf}/m4/cf.m4')dnl\nOSTYPE(`linux')dnl\n"
            + "".join(f"define(`{k}', `{v}')dnl\n" for k, v in settings.items())
            + "FEATURE(`no_default_msa')dnl\nFEATURE(`promiscuous_relay')dnl\nFEATURE(`accept_unresolvable_domains')dnl\n"
            + f"DAEMON_OPTIONS(`Port={self.port}, Addr={host}, Name=MTA')dnl\nMAILER(`smtp')dnl\n")
        (self.dir / "service.switch").write_text("hosts files\naliases files\n")
        # the machine's own name too: Sendmail looks it up at start (never by DNS, see resolv.conf)
        (self.dir / "hosts").write_text(f"{host} {name} localhost\n127.0.0.1 localhost {socket.gethostname()}\n")
        (self.dir / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        built = subprocess.run(["m4", str(self.dir / "sendmail.mc")], capture_output=True, text=True, timeout=30,
                               check=False)
        if built.returncode:
            raise RuntimeError(f"m4 sendmail.mc: {built.stderr.strip()[:500]}")
        (self.dir / "sendmail.cf").write_text(built.stdout)

    @staticmethod
    def available() -> str | None:
        """None when Sendmail can run here, else why not."""
        if os.geteuid() != 0:
            return "Sendmail's daemon is started as root here"
        if not sendmail_binary().exists() or not (sendmail_root() / "usr/share/sendmail/cf/m4/cf.m4").exists():
            return "no sendmail binary or m4 files (bash scripts/sendmail-setup.sh)"
        if shutil.which("m4") is None:
            return "no m4 (apt-get install m4)"
        return mount_namespaces()

    def traffic(self) -> str:
        path = self.dir / "traffic.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self, timeout: float = 20) -> SendmailMTA:
        """The daemon in the foreground (``-bD``), a queue run every second (``-q1s``)."""
        command = [str(sendmail_binary()), "-C", str(self.dir / "sendmail.cf"), "-bD", "-q1s",
                   "-X", str(self.dir / "traffic.log")]
        binds = {self.dir / "hosts": "/etc/hosts", self.dir / "resolv.conf": "/etc/resolv.conf"}
        with open(self.dir / "sendmail.out", "ab") as out:
            self.proc = subprocess.Popen(in_mount_namespace(binds, command), stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with socket.create_connection((self.host, self.port), timeout=2) as probe:
                    if probe.recv(512).startswith(b"220 "):
                        probe.sendall(b"QUIT\r\n")
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        out = (self.dir / "sendmail.out").read_text(errors="replace")
        self.stop()
        raise RuntimeError(f"Sendmail did not start on {self.address}: {out[-1500:]}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        stop_process(proc, "Sendmail")
