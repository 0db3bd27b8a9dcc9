"""Shared fixtures: real transportd node processes, Postfix's smtp-sink, swaks.

Everything listens on 127.0.0.1 with ports picked free at run time. Every
process a test starts is tracked by PID and ended (SIGTERM, then SIGKILL) when
the test ends, whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from transportd.devtools.cluster import toml_value

# The shared helper modules next to this file (imported by the test files, and lazily by the
# fixtures below): their asserts get pytest's introspection, as they did inside test files.
pytest.register_assert_rewrite("clusters", "helpers")

REPO = Path(__file__).resolve().parent.parent
SMTP_SINK = shutil.which("smtp-sink") or "/usr/sbin/smtp-sink"
SWAKS = shutil.which("swaks") or "/usr/bin/swaks"


NODE_LOG_TAIL = 120  # lines of each node log shown with a failed test


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test shows the end of each node log under its temporary folder: pytest keeps only
    the last three runs' folders, so a failure seen in CI is otherwise gone before anyone looks."""
    outcome = yield
    report = outcome.get_result()
    tmp = item.funcargs.get("tmp_path") if hasattr(item, "funcargs") else None
    if not report.failed or report.when not in ("setup", "call") or tmp is None:
        return
    for path in sorted(Path(tmp).glob("**/node*.log"))[:8]:
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        report.sections.append((f"{path.relative_to(tmp)} (last {NODE_LOG_TAIL} of {len(lines)} lines)",
                                "\n".join(lines[-NODE_LOG_TAIL:])))


_HANDED_OUT: set[int] = set()


def _ports_dir() -> Path | None:
    """Where the test run's processes (pytest-xdist's workers) note the ports they handed out: a
    port one of them holds for a next hop left down must not go to another's node or sink."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # set in each worker of one run
    return Path(tempfile.gettempdir()) / f"transportd-test-ports-{run}" if run else None


def _claim(port: int) -> bool:
    if port in _HANDED_OUT:
        return False
    shared = _ports_dir()
    if shared is not None:
        shared.mkdir(exist_ok=True)
        try:
            os.close(os.open(shared / str(port), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
    _HANDED_OUT.add(port)
    return True


def pytest_sessionfinish(session) -> None:
    """A worker done with its tests lets go of its ports (the last one removes the folder)."""
    shared = _ports_dir()
    if shared is None:
        return
    for port in _HANDED_OUT:
        with contextlib.suppress(OSError):
            (shared / str(port)).unlink()
    with contextlib.suppress(OSError):
        shared.rmdir()


def free_port(host: str = "127.0.0.1") -> int:
    """A free port never handed out before in this test run, by any of its processes (a sink not
    yet started must not have its port picked again for a node)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if _claim(port):
            return port


@contextlib.contextmanager
def silent_peer():
    """A loopback listener that accepts connections and never says a word (a hung peer); yields
    its port and closes everything on exit."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept_and_say_nothing() -> None:
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                pass
    t = threading.Thread(target=accept_and_say_nothing, daemon=True)
    t.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        t.join(2)
        for c in held:
            c.close()
        listener.close()


def wait_port(host: str, port: int, timeout: float = 15.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection((host, port), timeout=0.5) as s:
                s.recv(100)
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


def wait_for(predicate, timeout: float = 15.0, interval: float = 0.1, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def read_db(path: Path | str, sql: str, args: tuple = ()) -> list[tuple]:
    """Rows of a query on a node's queue database, opened read-only (the node may be running)."""
    import sqlite3
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def write_toml(path: Path, sections: dict[str, Any]) -> None:
    """Tables, and arrays of tables (``[[peers]]``) given as lists of dicts."""
    lines = []
    for section, values in sections.items():
        for table in values if isinstance(values, list) else [values]:
            lines.append(f"[[{section}]]" if isinstance(values, list) else f"[{section}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in table.items()]
            lines.append("")
    path.write_text("\n".join(lines))


class ProcessRegistry:
    """Every process started by a test, ended by PID at teardown; then the folders given to
    ``remove_after`` (outside pytest's tree) are removed."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.folders: list[Path] = []

    def add(self, proc: subprocess.Popen) -> subprocess.Popen:
        self.procs.append(proc)
        return proc

    def remove_after(self, folder: Path) -> Path:
        self.folders.append(folder)
        return folder

    def cleanup(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)


class Node:
    """A transportd node process with its own config and data dir."""

    def __init__(self, registry: ProcessRegistry, base: Path, name: str = "node1", *,
                 smart_host: str = "", overrides: dict[str, dict[str, Any]] | None = None):
        self.registry = registry
        self.dir = base / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = f"{name}.transportd.test"
        self.port = free_port()
        self.data_dir = self.dir / "data"
        self.config_path = self.dir / "node.toml"
        self.log_path = self.dir / "node.log"
        sections: dict[str, dict[str, Any]] = {
            "node": {"name": self.name, "site": "site-a", "data_dir": str(self.data_dir), "log_level": "debug"},
            "frontend": {"listen": f"127.0.0.1:{self.port}", "workers": 1},  # several: tests/test_workers.py
            "routing": {"accepted_domains": ["example.test"], "trusted_networks": ["127.0.0.1/32"],
                        "smart_host": smart_host},
            "delivery": {"transient_failure_retry_interval": 1, "outbound_connection_failure_retry_interval": 1,
                         "queue_poll_interval": 0.2, "send_connect_timeout": 3},
            "shadow_redundancy": {"shadow_redundancy_enabled": False},
            "metrics": {"listen": f"127.0.0.1:{free_port()}"},  # scheduler passes, for wait_passes()
        }
        for section, values in (overrides or {}).items():
            sections.setdefault(section, {}).update(values)
        self.sections = sections
        self.metrics_listen = sections["metrics"].get("listen", "")
        write_toml(self.config_path, sections)
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}  # extra environment of the process (test hooks)

    def start(self, wait: bool = True) -> Node:
        log = open(self.log_path, "ab")
        self.proc = self.registry.add(subprocess.Popen(
            [sys.executable, "-m", "transportd", "serve", "--config", str(self.config_path)],
            stdout=log, stderr=subprocess.STDOUT, cwd=str(self.dir), env={**os.environ, **self.env}))
        log.close()
        if wait:
            wait_port("127.0.0.1", self.port, proc=self.proc)
        return self

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=15)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def scheduler_passes(self) -> int:
        """The daemon's delivery scheduler passes so far (transportd_scheduler_passes_total)."""
        import urllib.request
        with urllib.request.urlopen(f"http://{self.metrics_listen}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        m = re.search(r"^transportd_scheduler_passes_total (\S+)$", text, re.MULTILINE)
        assert m, "no transportd_scheduler_passes_total in /metrics"
        return int(float(m.group(1)))

    def wait_passes(self, n: int = 2, timeout: float = 10) -> None:
        """Until the scheduler has completed ``n`` more passes: a change made before the call (an
        operator action in the queue database) has been seen by at least one whole pass."""
        start = self.scheduler_passes()
        wait_for(lambda: self.scheduler_passes() >= start + n, timeout=timeout, interval=0.05,
                 what=f"{n} scheduler passes of {self.name}")

    def cli(self, *args: str, check: bool = True, use_data_dir: bool = False, timeout: float = 60) -> subprocess.CompletedProcess:
        where = ["--data-dir", str(self.data_dir)] if use_data_dir else ["--config", str(self.config_path)]
        # Insert the node option after the sub-command words (before any option/argument).
        words = list(args)
        cmd = [sys.executable, "-m", "transportd"] + words + where
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {res.returncode}:\n{res.stdout}\n{res.stderr}")
        return res

    def cli_json(self, *args: str, **kw: Any) -> list[dict]:
        import json
        res = self.cli(*args, "--json", **kw)
        return [json.loads(line) for line in res.stdout.splitlines() if line.strip()]

    def tracking(self, **filters: str) -> list[dict]:
        args = ["tracking", "search"]
        for k, v in filters.items():
            args += [f"--{k.replace('_', '-')}", v]
        return self.cli_json(*args)

    def maildir_files(self, address: str) -> list[Path]:
        from transportd.queue.mailbox import MailboxStore
        return MailboxStore(self.data_dir / "mailboxes").list(address)


class Sink:
    """Postfix's smtp-sink on loopback, storing each message as a file (-d)."""

    def __init__(self, registry: ProcessRegistry, extra_args: tuple[str, ...] = ()):
        self.registry = registry
        self.port = free_port()
        # smtp-sink drops privileges to nobody when run as root: the folder must be reachable.
        self.dir = Path(tempfile.mkdtemp(prefix="transportd-sink-"))
        os.chmod(self.dir, 0o777)
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, extra_args: tuple[str, ...] | None = None) -> Sink:
        if extra_args is not None:
            self.extra_args = extra_args
        cmd = [SMTP_SINK]
        if os.geteuid() == 0:
            cmd += ["-u", "nobody"]
        cmd += ["-d", str(self.dir) + "/%Y%m%d%H%M%S.", *self.extra_args, self.address, "64"]
        self.proc = self.registry.add(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        wait_port("127.0.0.1", self.port, proc=self.proc)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=5)

    def messages(self) -> list[bytes]:
        """The messages smtp-sink has written whole: a file it still holds open (it writes one as
        the transaction goes) is left out, so a count waited for is a count of complete messages."""
        writing = self._writing()
        return [p.read_bytes() for p in sorted(self.dir.iterdir()) if p.is_file() and str(p) not in writing]

    def _writing(self) -> set[str]:
        if self.proc is None or self.proc.poll() is not None:
            return set()
        fds = Path(f"/proc/{self.proc.pid}/fd")
        held = set()
        with contextlib.suppress(OSError):
            for fd in fds.iterdir():
                with contextlib.suppress(OSError):
                    held.add(os.readlink(fd))
        return held

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class TransportdSink:
    """``transportd sink`` as a process (the next hop that speaks SMTPUTF8 and 8BITMIME)."""

    def __init__(self, procs, *args: str):
        self.port = free_port()
        self.dir = procs.remove_after(Path(tempfile.mkdtemp(prefix="transportd-usink-")))
        self.proc = procs.add(subprocess.Popen(
            [sys.executable, "-m", "transportd", "sink", "--listen", f"127.0.0.1:{self.port}", "--dir",
             str(self.dir), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_port("127.0.0.1", self.port, proc=self.proc)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def messages(self) -> list[bytes]:
        return [p.read_bytes() for p in sorted((self.dir / "new").iterdir())]


def private_mtas(prefix: str, build: Any):
    """The body of a fixture that yields a factory of started MTAs (``transportd.devtools``'
    Postfix and Exim): ``build(folder, *args, **kw)`` makes one, the factory starts it; all are
    stopped and their folders removed at the end. The folders are outside pytest's (0700) tree:
    the MTAs' daemons run as their own users and must reach them."""
    started: list[Any] = []
    work = Path(tempfile.mkdtemp(prefix=prefix))
    work.chmod(0o755)

    def factory(*args: Any, **kw: Any) -> Any:
        mta = build(work / f"mta{len(started)}", *args, **kw)
        started.append(mta)
        return mta.start()
    try:
        yield factory
    finally:
        for mta in started:
            mta.stop()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def relay_tls():
    """For a real MTA relaying into a node over STARTTLS with AUTH: a folder other users can read
    (the MTAs run as users of their own) with a CA (``ca.pem``) and the node's certificate
    (``cert.pem``, ``key.pem``) for node1.transportd.test and 127.0.0.1; removed at the end.
    ``tls_relay_overrides(tls, user, password)`` gives the node's settings."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("node1.transportd.test", "127.0.0.1")
    tls = Path(tempfile.mkdtemp(prefix="transportd-relay-tls-"))
    tls.chmod(0o755)
    cert.private_key_and_cert_chain_pem.write_to_path(str(tls / "cert.pem"))
    cert.private_key_pem.write_to_path(str(tls / "key.pem"))
    ca.cert_pem.write_to_path(str(tls / "ca.pem"))
    for pem in tls.iterdir():
        pem.chmod(0o644)
    try:
        yield tls
    finally:
        shutil.rmtree(tls, ignore_errors=True)


def tls_relay_overrides(tls: Path, user: str, password: str) -> dict:
    """A node that relays only for authenticated clients over TLS (no trusted network,
    ``require_tls``), with ``relay_tls``'s certificate and one user."""
    return {"frontend": {"tls_certificate": str(tls / "cert.pem"), "tls_key": str(tls / "key.pem"),
                         "require_tls": True, "auth_users": {user: password}},
            "routing": {"trusted_networks": []}}


def private_mtas_of(mta_class: Any, prefix: str, default_name: str):
    """``private_mtas`` for an MTA class built as ``mta_class(folder, relay_to, name=..., **kw)``:
    the fixture's factory is ``factory(relay_to, name=default_name, **kw)``."""
    def build(folder: Path, relay_to: str | None, name: str = default_name, **kw: Any) -> Any:
        return mta_class(folder, relay_to, name=name, **kw)
    yield from private_mtas(prefix, build)


@pytest.fixture
def usink(procs):
    return TransportdSink(procs)


def swaks(port: int, *args: str, timeout: float = 30, server: str = "127.0.0.1") -> subprocess.CompletedProcess:
    cmd = [SWAKS, "--server", f"{server}:{port}", "--timeout", "20", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def queued_id(result: subprocess.CompletedProcess) -> int:
    m = re.search(r"250 2\.0\.0 Ok: queued as (\d+)", result.stdout)
    assert m, f"no 250 queued reply in swaks output:\n{result.stdout}\n{result.stderr}"
    return int(m.group(1))


@pytest.fixture
def procs():
    registry = ProcessRegistry()
    try:
        yield registry
    finally:
        registry.cleanup()


@pytest.fixture
def sink(procs):
    s = Sink(procs)
    try:
        yield s
    finally:
        s.stop()
        s.cleanup()


@pytest.fixture
def make_node(procs, tmp_path):
    def factory(name: str = "node1", **kw: Any) -> Node:
        return Node(procs, tmp_path, name, **kw)
    return factory


@pytest.fixture
def cluster(procs, sink, tmp_path):
    """A factory: ``cluster(overrides=...)`` writes a 3-node, 2-site config set (not started);
    see clusters.Cluster."""
    import random

    from clusters import FAST, Cluster, merge

    from transportd.devtools import cluster as cluster_mod

    made: list[Cluster] = []

    def factory(*, overrides: dict[str, dict[str, Any]] | None = None, nodes: int = 3, sites: int = 2) -> Cluster:
        directory = tmp_path / f"cluster{len(made) + 1}"
        specs = cluster_mod.generate(
            directory, nodes=nodes, sites=sites, ip_base=random.randint(20, 200),
            frontend_port=free_port(), transport_port=free_port(), sink_address=sink.address,
            overrides=merge(FAST, overrides))
        c = Cluster(directory, specs, procs)
        made.append(c)
        return c

    yield factory
    # On failure, the node logs are the first thing anyone needs.
    for c in made:
        sys.stderr.write(c.logs()[-20000:] + "\n")


@pytest.fixture
def make_cluster(procs, sink, tmp_path):
    """A factory: ``make_cluster(heartbeat, resubmit)`` writes a 3-node, 2-site config set (not
    started) with those shadow timers; see clusters.LocalCluster."""
    from clusters import LocalCluster

    made: list[LocalCluster] = []

    def factory(heartbeat: float, resubmit: float) -> LocalCluster:
        c = LocalCluster(procs, sink, tmp_path, {"shadow_redundancy": {
            "shadow_heartbeat_frequency": heartbeat, "shadow_resubmit_time_span": resubmit}})
        made.append(c)
        return c
    yield factory
    # Shown by pytest only when the test failed.
    for c in made:
        for n in c.nodes.values():
            print(f"===== {n.spec.short} log (last 60 lines) =====")
            print("\n".join(n.log().splitlines()[-60:]))


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB tmpfs mounted for the test (needs root; skipped otherwise, saying so)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a small tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], check=False, capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)
