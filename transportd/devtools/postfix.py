"""A real Postfix MTA from Debian's package, in a private config and queue directory, for tests
and benchmarks: a peer that speaks SMTP as the rest of the world does.

It listens on one loopback address and port only (``master.cf`` has one ``inet`` line), relays
everything it accepts from loopback to one next hop (``relayhost``, no DNS), and writes its log
to a file of its own. Postfix's master must start as root (``available`` says why not). Never
point it at anything but loopback.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

POSTFIX = shutil.which("postfix") or "/usr/sbin/postfix"
MASTER = "/usr/lib/postfix/sbin/master"

_SERVICES = """\
pickup    unix  n - n 60    1 pickup
cleanup   unix  n - n -     0 cleanup
qmgr      unix  n - n 300   1 qmgr
rewrite   unix  - - n -     - trivial-rewrite
bounce    unix  - - n -     0 bounce
defer     unix  - - n -     0 bounce
trace     unix  - - n -     0 bounce
verify    unix  - - n -     1 verify
flush     unix  n - n 1000? 0 flush
proxymap  unix  - - n -     - proxymap
smtp      unix  - - n -     - smtp
relay     unix  - - n -     - smtp
showq     unix  n - n -     - showq
error     unix  - - n -     - error
retry     unix  - - n -     - error
discard   unix  - - n -     - discard
anvil     unix  - - n -     1 anvil
scache    unix  - - n -     1 scache
postlog   unix-dgram n - n - 1 postlogd
tlsmgr    unix  - - n 1000? 1 tlsmgr
"""


def free_port_on(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def in_mount_namespace(binds: dict[Path, str], command: list[str]) -> list[str]:
    """``command`` in a mount namespace of its own (``unshare -m``; the mounts are private to it)
    where each file or folder of ``binds`` is mounted over the path it names: an MTA whose paths
    are compiled in (OpenSMTPD's spool) or that reads the machine's files (Sendmail's
    ``/etc/hosts``) gets its own. Root only."""
    mounts = " && ".join(f"mount --bind {shlex.quote(str(src))} {shlex.quote(dst)}" for src, dst in binds.items())
    return ["unshare", "-m", "sh", "-c", f"{mounts} && exec {shlex.join(command)}"]


def mount_namespaces() -> str | None:
    """None when ``in_mount_namespace`` works here, else why not."""
    res = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True, timeout=30, check=False)
    return None if res.returncode == 0 else f"no mount namespace (unshare -m): {res.stderr.strip()[:200]}"


def stop_process(proc: subprocess.Popen | None, what: str) -> None:
    """SIGTERM to a daemon a test started in the foreground in a session of its own (its process
    group), up to 10 s for it to end, then SIGKILL to what is left of that group (a child it left
    behind, or the daemon itself)."""
    if proc is None:
        return
    with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(5)
    if process_alive(proc.pid):  # pragma: no cover - reported, never left silently
        raise RuntimeError(f"{what} {proc.pid} did not stop")


def process_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class LoopbackMTA:
    """An MTA of the tests, listening on one loopback address and port."""

    host: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


class PostfixMTA(LoopbackMTA):
    """Postfix in ``work/postfix``: ``start``, ``stop``, ``maillog``; ``settings`` are extra
    ``main.cf`` lines (name -> value) over the defaults below, e.g. ``smtputf8_enable``,
    ``message_size_limit``, ``smtpd_recipient_restrictions``."""

    def __init__(self, work: Path, relay_to: str, *, host: str = "127.0.0.1", name: str = "postfix.test",
                 process_limit: int = 100, settings: dict[str, str] | None = None):
        self.dir = work / "postfix"
        self.host = host
        self.port = free_port_on(host)
        self.master_pid = 0
        etc, spool, data = self.dir / "etc", self.dir / "spool", self.dir / "data"
        for d in (etc, spool, data):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(work, 0o755)
        os.chmod(self.dir, 0o755)
        if os.geteuid() == 0:
            shutil.chown(data, "postfix")
        main = {
            "compatibility_level": "3.6", "queue_directory": str(spool), "data_directory": str(data),
            "command_directory": "/usr/sbin", "daemon_directory": "/usr/lib/postfix/sbin",
            "meta_directory": "/etc/postfix", "shlib_directory": "/usr/lib/postfix",
            "mail_owner": "postfix", "setgid_group": "postdrop", "inet_interfaces": host,
            "inet_protocols": "ipv4", "myhostname": name, "mydestination": "", "mynetworks": "127.0.0.0/8",
            "relayhost": f"[{relay_to.rsplit(':', 1)[0]}]:{relay_to.rsplit(':', 1)[1]}", "relay_domains": "",
            "smtpd_relay_restrictions": "permit_mynetworks, reject", "disable_dns_lookups": "yes",
            "smtp_host_lookup": "native", "maillog_file": str(data / "maillog"),
            "maillog_file_prefixes": str(self.dir), "alias_maps": "", "alias_database": "",
            "local_recipient_maps": "", "smtputf8_enable": "no", "default_process_limit": str(process_limit),
            **(settings or {})}
        (etc / "main.cf").write_text("# written by transportd.devtools.postfix\n"
                                     + "".join(f"{k} = {v}\n" for k, v in main.items()))
        (etc / "master.cf").write_text("# written by transportd.devtools.postfix: smtp inet on loopback only\n"
                                       f"{host}:{self.port} inet n - n - - smtpd\n" + _SERVICES)

    @staticmethod
    def available() -> str | None:
        """None when Postfix can run here, else why not."""
        if os.geteuid() != 0:
            return "Postfix's master must start as root"
        if not Path(POSTFIX).exists() or not Path(MASTER).exists():
            return "Postfix is not installed (apt-get install postfix)"
        return None

    def postfix(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([POSTFIX, "-c", str(self.dir / "etc"), *args], capture_output=True, text=True, check=False,
                              timeout=60)

    def maillog(self) -> str:
        log = self.dir / "data" / "maillog"
        return log.read_text(errors="replace") if log.exists() else ""

    def start(self, timeout: float = 20) -> PostfixMTA:
        res = self.postfix("start")
        pid_file = self.dir / "spool" / "pid" / "master.pid"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not (pid_file.exists() and pid_file.read_text().strip()):
            time.sleep(0.1)
        if not pid_file.exists():
            raise RuntimeError(f"postfix did not start: {res.stderr} {self.maillog()[-2000:]}")
        self.master_pid = int(pid_file.read_text().split()[0])
        while time.monotonic() < deadline:
            try:
                socket.create_connection((self.host, self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"postfix is not listening on {self.address}: {self.maillog()[-2000:]}")

    def stop(self) -> None:
        """``postfix stop``, then SIGKILL to the master it started if it is still there after 15 s."""
        if not self.master_pid:
            return
        self.postfix("stop")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and process_alive(self.master_pid):
            time.sleep(0.1)
        if process_alive(self.master_pid):
            os.kill(self.master_pid, signal.SIGKILL)
        self.master_pid = 0
