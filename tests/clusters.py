"""Cluster harnesses shared by the test files: real node processes, generated configs.

Two harnesses, both on ``transportd.devtools.cluster.generate`` (node1 + node2 in site-a, node3
in site-b, each on its own 127.0.0.x address, mailbox database MDB01 on node1):

- ``Cluster`` / ``ClusterNode``: the conftest ``cluster`` fixture's (test_cluster.py and
  others). Short timers (heartbeat ``HEARTBEAT``, retries 1 s); read commands run in this
  process through click's CliRunner (``invoke``).
- ``LocalCluster`` / ``FailoverNode``: the conftest ``make_cluster`` fixture's
  (test_cluster_failover.py and others), with the heartbeat and resubmit span chosen per test;
  read commands are real ``python -m transportd`` processes, tracking searched in this process.

Also the SMTP helpers for the transport connector (``smtp``, ``reply``, ``auth_plain``) and
``FakePrimary``, just enough of a primary for a shadow's heartbeat. Plain helpers: the fixtures
themselves live in conftest.py.
"""

from __future__ import annotations

import base64
import json
import os
import random
import signal
import smtplib
import socketserver
import sqlite3
import subprocess
import sys
import threading
import time
import tomllib
import uuid
from pathlib import Path
from typing import Any

from click.testing import CliRunner
from conftest import free_port, queued_id, read_db, swaks, wait_for, wait_port

from transportd import config as config_mod
from transportd.cli import cli as transportd_cli
from transportd.devtools import cluster as cluster_mod
from transportd.queue.mailbox import MailboxStore
from transportd.tracking import search as tracking_search

HEARTBEAT = 0.5
FAST: dict[str, dict[str, Any]] = {
    "shadow_redundancy": {"shadow_heartbeat_frequency": HEARTBEAT, "shadow_resubmit_time_span": 3},
    "delivery": {"queue_poll_interval": 0.2, "transient_failure_retry_interval": 1,
                 "outbound_connection_failure_retry_interval": 1, "send_connect_timeout": 2},
    "node": {"log_level": "debug"},
    "frontend": {"workers": 1},  # one process per node; tests/test_workers.py covers several
}
FOREIGN = "bob@elsewhere.test"   # routed to the smart host (the sink), outside the boundary
LOCAL = "alice@example.test"     # example.test lives in MDB01, on node1
DOMAIN = cluster_mod.DOMAIN


def fqdn(short: str) -> str:
    return f"{short}.{DOMAIN}"


def b64(text: str) -> str:
    return base64.b64encode(text.encode("ascii")).decode("ascii")


def b64_dbid(dbid: str) -> str:
    return base64.b64encode(uuid.UUID(dbid).bytes).decode("ascii")


def merge(*dicts: dict[str, dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for d in dicts:
        for section, values in (d or {}).items():
            out.setdefault(section, {}).update(values)
    return out


# ------------------------------------------------------------------------------ CLI in process

def invoke(*args: str, ok_codes: tuple[int, ...] = (0,)) -> Any:
    r = CliRunner().invoke(transportd_cli, list(args), catch_exceptions=False)
    if r.exit_code not in ok_codes:
        raise AssertionError(f"transportd {' '.join(args)} exited {r.exit_code}:\n{r.stdout}\n{r.stderr}")
    return r


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# ------------------------------------------------------------------------------ the cluster fixture's harness

def write_node_config(path: Path, sections: dict[str, dict[str, Any]], peers: list[dict[str, str]]) -> None:
    path.write_text(cluster_mod.render_toml(sections, peers))


class ClusterNode:
    """One generated node: its config file, its process, and read access to its state."""

    def __init__(self, spec: cluster_mod.NodeSpec, registry: Any):
        self.spec = spec
        self.registry = registry
        self.short = spec.short
        self.name = spec.name
        self.config = spec.config
        self.host, _, port = spec.frontend.rpartition(":")
        self.frontend_port = int(port)
        self.transport_host, _, tport = spec.transport.rpartition(":")
        self.transport_port = int(tport)
        self.log_path = Path(spec.config).with_suffix(".log")
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}  # extra environment of the process (test hooks)

    # -- config and process -------------------------------------------------------

    def load_toml(self) -> tuple[dict[str, dict[str, Any]], list[dict[str, str]]]:
        raw = tomllib.loads(Path(self.config).read_text())
        peers = raw.pop("peers", [])
        return raw, peers

    def set(self, section: str, key: str, value: Any) -> None:
        """Change one key in this node's config only (before it starts)."""
        sections, peers = self.load_toml()
        sections.setdefault(section, {})[key] = value
        write_node_config(Path(self.config), sections, peers)

    @property
    def cfg(self) -> Any:
        return config_mod.load(self.config)

    def spawn(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = self.registry.add(subprocess.Popen(
                [sys.executable, "-m", "transportd", "serve", "--config", self.config],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, **self.env}))

    def wait_listening(self) -> None:
        wait_port(self.host, self.frontend_port, proc=self.proc)
        wait_port(self.transport_host, self.transport_port, proc=self.proc)

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=15)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    # -- reading its state --------------------------------------------------------

    def cli_json(self, *args: str) -> list[dict]:
        return json_lines(invoke(*args, "--config", self.config, "--json").stdout)

    def tracking(self, **filters: str) -> list[dict]:
        args = ["tracking", "search", "--config", self.config, "--json"]
        for k, v in filters.items():
            args += [f"--{k.replace('_', '-')}", v]
        r = invoke(*args, ok_codes=(0, 1))
        if r.exit_code == 1:
            assert "no tracking logs" in r.stderr, r.stderr
            return []
        return json_lines(r.stdout)

    def events(self, netid: str) -> list[str]:
        return [r["event-id"] for r in self.tracking(network_message_id=netid)]

    def shadow_list(self) -> dict[str, dict]:
        return {r["primary"]: r for r in self.cli_json("shadow", "list")}

    def shadow_row(self, primary: str) -> dict:
        """This node's ``shadow list`` row for ``primary`` (zeros when it holds nothing for it)."""
        return self.shadow_list().get(primary, {"primary": primary, "shadows": 0, "shadow_safety_net": 0})

    def messages(self, include_done: bool = True) -> list[dict]:
        return self.cli_json("message", "list", *(["--all"] if include_done else []))

    def queue_database_id(self) -> str:
        con = sqlite3.connect(f"file:{self.cfg.db_path}?mode=ro", uri=True, timeout=5)
        try:
            return con.execute("SELECT value FROM meta WHERE key = 'queue_database_id'").fetchone()[0]
        finally:
            con.close()

    def maildir(self, address: str) -> list[Path]:
        return MailboxStore(self.cfg.mailbox_dir).list(address)

    def last_heartbeat_at(self, primary: str) -> float | None:
        """When this node last finished a discard exchange (heartbeat or hop-by-hop session) with
        ``primary``: its shadow_contexts row, read-only."""
        rows = read_db(self.cfg.db_path, "SELECT last_heartbeat_at FROM shadow_contexts WHERE peer = ?", (primary,))
        return rows[0][0] if rows else None

    def forks_held_for(self, primary: str) -> int:
        """Forks of our messages handed to ``primary`` and not yet discarded by it (hop by hop):
        its shadow_forks rows, read-only."""
        return read_db(self.cfg.db_path, "SELECT count(*) FROM shadow_forks WHERE primary_node = ?", (primary,))[0][0]

    def wait_heartbeats(self, primary: str, n: int, timeout: float | None = None) -> None:
        """Wait until this node has finished ``n`` discard exchanges with ``primary`` (the
        XQDISCARD of its heartbeat rounds) since the call, seen in its queue database."""
        started = time.time()
        seen: set[float] = set()

        def enough() -> bool:
            at = self.last_heartbeat_at(primary)
            if at is not None and at >= started:
                seen.add(at)
            return len(seen) >= n
        wait_for(enough, timeout=timeout if timeout is not None else n * HEARTBEAT + 10, interval=0.05,
                 what=f"{n} heartbeats from {self.short} to {primary} (shadow_contexts.last_heartbeat_at)")

    def swaks(self, to: str, *extra: str) -> subprocess.CompletedProcess:
        return swaks(self.frontend_port, "--from", "carol@example.test", "--to", to, *extra, server=self.host)


class Cluster:
    def __init__(self, directory: Path, specs: list[cluster_mod.NodeSpec], registry: Any):
        self.directory = directory
        self.nodes = {s.short: ClusterNode(s, registry) for s in specs}
        self.secret = tomllib.loads(Path(specs[0].config).read_text())["cluster"]["secret"]

    def __getitem__(self, short: str) -> ClusterNode:
        return self.nodes[short]

    def start(self, *shorts: str) -> Cluster:
        """Start the named nodes (all by default) in parallel and wait for both their listeners."""
        chosen = [self.nodes[s] for s in (shorts or self.nodes)]
        for n in chosen:
            n.spawn()
        for n in chosen:
            n.wait_listening()
        return self

    def logs(self) -> str:
        return "\n".join(f"===== {n.short}\n{n.log()[-6000:]}" for n in self.nodes.values())


def netid_of(node: ClusterNode, qid: int) -> str:
    rows = node.tracking(event_id="RECEIVE", internal_message_id=str(qid))
    assert len(rows) == 1, rows
    return rows[0]["network-message-id"]


def one(rows: list[dict], what: str = "") -> dict:
    assert len(rows) == 1, f"expected exactly one {what}, got {rows}"
    return rows[0]


# ------------------------------------------------------------------------------ transport connector sessions

def smtp(host: str, port: int, helo: str = "client.example", source: str | None = None) -> smtplib.SMTP:
    s = smtplib.SMTP(host, port, local_hostname=helo, timeout=10,
                     source_address=(source, 0) if source else None)
    s.ehlo(helo)
    return s


def reply(s: smtplib.SMTP, line: str) -> tuple[int, str]:
    verb, _, arg = line.partition(" ")
    code, msg = s.docmd(verb, arg)
    return code, msg.decode("utf-8", "replace")


def auth_plain(s: smtplib.SMTP, user: str, password: str) -> tuple[int, str]:
    token = base64.b64encode(f"\0{user}\0{password}".encode()).decode("ascii")
    return reply(s, f"AUTH PLAIN {token}")


class FakePrimary(socketserver.ThreadingTCPServer):
    """Just enough of a primary for a shadow's heartbeat: EHLO, AUTH, XSHADOW, XQDISCARD."""

    allow_reuse_address = True
    daemon_threads = True

    def __init__(self, address: tuple[str, int], name: str, dbid: str):
        self.name = name
        self.dbid = dbid
        self.commands: list[str] = []
        self.next_discards: list[list[str]] = []  # one-shot XQDISCARD answers, in order
        self.default_discard: list[str] = ["not-a-guid"]
        self.lock = threading.Lock()
        super().__init__(address, FakePrimaryHandler)

    def count(self, verb: str) -> int:
        with self.lock:
            return sum(1 for c in self.commands if c.split(" ", 1)[0].upper() == verb)

    def discard_lines(self) -> list[str]:
        with self.lock:
            return self.next_discards.pop(0) if self.next_discards else list(self.default_discard)


class FakePrimaryHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        srv: FakePrimary = self.server  # type: ignore[assignment]
        out = self.wfile
        out.write(b"220 " + srv.name.encode() + b" ESMTP fake primary\r\n")
        for raw in self.rfile:
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            verb = line.split(" ", 1)[0].upper()
            if verb == "XQDISCARD":
                lines = srv.discard_lines()
            with srv.lock:
                srv.commands.append(line)
            if verb in ("EHLO", "HELO"):
                out.write(f"250-{srv.name}\r\n250-AUTH PLAIN\r\n250-ENHANCEDSTATUSCODES\r\n"
                          f"250 XSHADOWREQUEST\r\n".encode())
            elif verb == "AUTH":
                out.write(b"235 2.7.0 Authentication successful\r\n")
            elif verb == "XSHADOW":
                out.write(f"250 {b64_dbid(srv.dbid)}\r\n".encode())
            elif verb == "XQDISCARD":
                if not lines:
                    out.write(b"251 OK, no discard events\r\n")
                else:
                    body = [f"250-{x}" for x in lines[:-1]] + [f"250 {lines[-1]}"]
                    out.write(("\r\n".join(body) + "\r\n").encode())
            elif verb == "QUIT":
                out.write(b"221 2.0.0 Bye\r\n")
                return
            else:
                out.write(b"250 2.0.0 OK\r\n")
            out.flush()


# ------------------------------------------------------------------------------ the failover harness (make_cluster)

FAST_DELIVERY = {"queue_poll_interval": 0.2, "transient_failure_retry_interval": 1,
                 "outbound_connection_failure_retry_interval": 1, "send_connect_timeout": 2}


class FailoverNode:
    """One node of a ``LocalCluster``: its process, real CLI reads, in-process tracking search."""

    def __init__(self, spec: cluster_mod.NodeSpec, procs: Any, log_dir: Path):
        self.spec = spec
        self.procs = procs
        self.name = spec.name
        self.log_path = log_dir / f"{spec.short}.log"
        self.proc: subprocess.Popen | None = None
        host, _, port = spec.frontend.rpartition(":")
        self.host, self.port = host, int(port)
        self.cfg = config_mod.load(spec.config)

    # -- process control ------------------------------------------------------------------

    def start(self) -> FailoverNode:
        with open(self.log_path, "ab") as log:
            self.proc = self.procs.add(subprocess.Popen(
                [sys.executable, "-m", "transportd", "serve", "--config", self.spec.config],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        wait_port(self.host, self.port, timeout=20, proc=self.proc)
        return self

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=15)

    # -- inspection -----------------------------------------------------------------------

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "transportd", *args, "--config", self.spec.config]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        if res.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {res.returncode}:\n{res.stdout}\n{res.stderr}")
        return res

    def cli_json(self, *args: str) -> list[dict]:
        return [json.loads(line) for line in self.cli(*args, "--json").stdout.splitlines() if line.strip()]

    def tracking(self, **filters: str) -> list[dict]:
        """``transportd tracking search --json`` (a real CLI process)."""
        args = ["tracking", "search"]
        for k, v in filters.items():
            args += [f"--{k.replace('_', '-')}", v]
        return self.cli_json(*args)

    def events(self, event_id: str, network_message_id: str | None = None) -> list[dict]:
        """The same search in this process (cheap enough to poll)."""
        if not self.cfg.tracking_dir.is_dir():
            return []
        return list(tracking_search(self.cfg.tracking_dir, event_id=event_id,
                                    network_message_id=network_message_id))

    def wait_event(self, event_id: str, network_message_id: str | None = None, timeout: float = 20,
                   n: int = 1) -> list[dict]:
        def found() -> list[dict] | None:
            rows = self.events(event_id, network_message_id)
            return rows if len(rows) >= n else None
        return wait_for(found, timeout=timeout, interval=0.1,
                        what=f"{n} {event_id} on {self.spec.short} for {network_message_id}")

    def shadow_list(self) -> dict[str, dict]:
        return {r["primary"]: r for r in self.cli_json("shadow", "list")}

    def maildir(self, address: str) -> list[Path]:
        return MailboxStore(Path(self.spec.data_dir) / "mailboxes").list(address)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class LocalCluster:
    def __init__(self, procs: Any, sink: Any, base: Path, overrides: dict[str, dict[str, Any]], nodes: int = 3):
        self.sink = sink
        merged = {"delivery": dict(FAST_DELIVERY), "node": {"log_level": "debug"}, "frontend": {"workers": 1}}
        for section, values in overrides.items():
            merged.setdefault(section, {}).update(values)
        self.specs = cluster_mod.generate(
            base / "cfg", nodes=nodes, sites=2, ip_base=random.randint(20, 200),
            frontend_port=free_port(), transport_port=free_port(),
            sink_address=sink.address, overrides=merged)
        self.nodes = {s.short: FailoverNode(s, procs, base) for s in self.specs}

    def __getitem__(self, short: str) -> FailoverNode:
        return self.nodes[short]

    def start(self, *shorts: str) -> None:
        for short in shorts or tuple(self.nodes):
            self.nodes[short].start()


def send(node: FailoverNode, to: str, sender: str = "zed@example.test", *extra: str) -> int:
    return queued_id(swaks(node.port, "--to", to, "--from", sender, *extra, server=node.host))


def accepted_with_shadow(primary: FailoverNode, shadow: FailoverNode, internal_id: int) -> str:
    """The network-message-id of ``internal_id``, after checking HAREDIRECT to ``shadow`` and its HARECEIVE."""
    redirect = [r for r in primary.wait_event("HAREDIRECT") if r["internal-message-id"] == str(internal_id)]
    assert len(redirect) == 1, redirect
    assert redirect[0]["source-context"].startswith(f"{shadow.name}=250 2.6.0 "), redirect[0]
    netid = redirect[0]["network-message-id"]
    assert netid
    shadow.wait_event("HARECEIVE", netid)
    return netid


def sink_copies(sink: Any, netid: str) -> list[bytes]:
    return [m for m in sink.messages() if netid.encode() in m]


