"""A local cluster on loopback: N node processes in S sites plus an external sink.

It owns generating the node configs (one TOML per node: name, site, frontend and
transport addresses on distinct 127.0.0.x addresses, peers, cluster secret),
starting the processes in the foreground with each log line prefixed by its
node's name, writing ``cluster.json`` so scripts and tests can find everything,
and stopping them all on Ctrl-C or SIGTERM. It never binds outside 127.0.0.0/8.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from transportd import config as config_mod

DOMAIN = "transportd.test"


@dataclass
class NodeSpec:
    name: str
    short: str
    site: str
    frontend: str
    transport: str
    data_dir: str
    config: str
    pid: int | None = None


def site_of(i: int, nodes: int, sites: int) -> str:
    """Nodes split over sites in order: 3 nodes, 2 sites -> a, a, b."""
    index = min(i * sites // nodes, sites - 1)
    return f"site-{chr(ord('a') + index)}"


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")


def render_toml(sections: dict[str, dict[str, Any]], peers: list[dict[str, str]], header: str = "") -> str:
    lines = [header] if header else []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
        lines.append("")
    for p in peers:
        lines.append("[[peers]]")
        lines += [f"{k} = {toml_value(v)}" for k, v in p.items()]
        lines.append("")
    return "\n".join(lines)


def parse_overrides(items: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """``section.key=value`` (value as TOML: 5, "5s", true) -> nested dict; ValueError naming the
    item when malformed or when it cannot go in a generated config (it would make the TOML
    invalid, and the parser's error names a line of a file the user never wrote)."""
    import re
    import tomllib
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        section, _, name = key.strip().partition(".")
        if not sep or not all(re.fullmatch(r"[A-Za-z0-9_-]+", part) for part in (section, name)):
            raise ValueError(f"--set {item!r}: expected section.key=value")
        if section == "peers":
            raise ValueError(f"--set {item!r}: the [[peers]] are generated (one per other node); "
                             "--set takes a key of a section, e.g. shadow_redundancy.shadow_heartbeat_frequency=2")
        try:
            parsed = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value.strip()
        try:
            toml_value(parsed)
        except TypeError:  # a TOML date or time: no config key takes one
            parsed = value.strip()
        out.setdefault(section, {})[name] = parsed
    return out


def generate(directory: Path, *, nodes: int = 3, sites: int = 2, ip_base: int = 11,
             frontend_port: int = 2525, transport_port: int = 2526, sink_address: str = "127.0.0.10:2500",
             secret: str | None = None, overrides: dict[str, dict[str, Any]] | None = None,
             data_root: Path | None = None,
             peer_transport: Callable[[NodeSpec, NodeSpec], str] | None = None,
             versions: list[str] | None = None) -> list[NodeSpec]:
    """Write one config per node under ``directory``; returns the node specs.

    ``versions``: node N gets ``shadow_redundancy.version`` = the N-th (a mixed 2010/2013 cluster).

    ``peer_transport(node, peer)`` gives the address ``node`` uses for ``peer``'s transport
    connector (default: the peer's own; ``transportd chaos`` puts a fault proxy there)."""
    if not 1 <= nodes <= 200 or not 1 <= sites <= nodes:
        raise ValueError("need 1 <= sites <= nodes <= 200")
    if ip_base + nodes > 255:
        raise ValueError("too many nodes for the 127.0.0.x range from this --ip-base")
    data_root = data_root or directory
    secret = secret or secrets.token_urlsafe(24)
    specs = []
    for i in range(nodes):
        short = f"node{i + 1}"
        ip = f"127.0.0.{ip_base + i}"
        specs.append(NodeSpec(
            name=f"{short}.{DOMAIN}", short=short, site=site_of(i, nodes, sites),
            frontend=f"{ip}:{frontend_port}", transport=f"{ip}:{transport_port}",
            data_dir=str((data_root / short).resolve()), config=str((directory / f"{short}.toml").resolve())))
    # Configs name their data dir relative to their own folder, so a generated set can be moved.
    rel = {spec.short: os.path.relpath(spec.data_dir, directory.resolve()) for spec in specs}
    texts = []
    for spec in specs:
        sections: dict[str, dict[str, Any]] = {
            "node": {"name": spec.name, "site": spec.site, "data_dir": rel[spec.short]},
            "frontend": {"listen": spec.frontend},
            "transport": {"listen": spec.transport},
            "cluster": {"secret": secret},
            "routing": {"accepted_domains": ["example.test"], "trusted_networks": ["127.0.0.1/32"],
                        "smart_host": sink_address, "mailbox_database": "MDB01"},
            # One mailbox database per node; example.test lives in MDB01 (on node1) unless a
            # routing.mailbox_database_rules entry says otherwise: mail for it received elsewhere
            # travels to node1 hop by hop (XSHADOW).
            "mailbox_databases": {f"MDB{j + 1:02d}": o.name for j, o in enumerate(specs)},
            "shadow_redundancy": {"shadow_redundancy_enabled": True,
                                  "shadow_heartbeat_frequency": "10s", "shadow_resubmit_time_span": "60s"},
        }
        for section, values in (overrides or {}).items():
            sections.setdefault(section, {}).update(values)
        if versions:
            sections["shadow_redundancy"]["version"] = versions[specs.index(spec)]
        peers = [{"name": o.name, "site": o.site,
                  "transport": peer_transport(spec, o) if peer_transport else o.transport}
                 for o in specs if o is not spec]
        header = (f"# {spec.name}: one node of a {nodes}-node, {sites}-site transportd cluster on loopback.\n"
                  f"# Generated by `transportd cluster`; every key: transportd config show --config {Path(spec.config).name}\n")
        texts.append(render_toml(sections, peers, header))
        # Checked before any file is written: a bad --set leaves the folder (and a cluster's
        # configs already there) as it was. ConfigError names the file and the key.
        config_mod.load_dict(tomllib.loads(texts[-1]), source=spec.config, base_dir=directory.resolve())
    directory.mkdir(parents=True, exist_ok=True)
    for spec, text in zip(specs, texts):
        Path(spec.config).write_text(text)
        os.chmod(spec.config, 0o600)  # it holds the cluster secret
    return specs


class Cluster:
    """Runs the generated nodes and a sink as child processes, prefixing their output."""

    def __init__(self, directory: Path, specs: list[NodeSpec], sink_address: str):
        self.directory = directory
        self.specs = specs
        self.sink_address = sink_address
        self.sink_dir = directory / "sink"
        self.procs: dict[str, subprocess.Popen] = {}
        self._lock = threading.Lock()

    def _spawn(self, label: str, args: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "transportd", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs[label] = proc
        threading.Thread(target=self._pump, args=(label, proc), daemon=True).start()
        return proc

    def _pump(self, label: str, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with self._lock:
                print(f"[{label}] {line}", flush=True)

    def start(self) -> None:
        self._spawn("sink", ["sink", "--listen", self.sink_address, "--dir", str(self.sink_dir)])
        for spec in self.specs:
            proc = self._spawn(spec.short, ["serve", "--config", spec.config])
            spec.pid = proc.pid
        self.write_json()

    def write_json(self) -> Path:
        doc = {
            "nodes": [asdict(s) for s in self.specs],
            "sink": {"address": self.sink_address, "mail_dir": str((self.sink_dir / "new").resolve()),
                     "pid": self.procs["sink"].pid if "sink" in self.procs else None},
            "started_at": time.time(),
        }
        path = self.directory / "cluster.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=2))
        os.replace(tmp, path)
        return path

    def wait(self) -> int:
        stop = threading.Event()

        def handler(signum: int, frame: Any) -> None:
            stop.set()
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        reported: set[str] = set()
        nodes = {spec.short for spec in self.specs}
        code = 0
        while not stop.is_set():
            for label, proc in self.procs.items():
                if proc.poll() is not None and label not in reported:
                    reported.add(label)
                    with self._lock:
                        print(f"[cluster] {label} exited with code {proc.returncode}", flush=True)
            if nodes <= reported:  # nothing left to serve mail (addresses taken, bad configs...)
                with self._lock:
                    print("[cluster] every node has exited (their lines above say why)", flush=True)
                code = 1
                break
            stop.wait(0.5)
        self.stop()
        return code

    def stop(self) -> None:
        with self._lock:
            print("[cluster] stopping", flush=True)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def load_cluster_json(directory: Path) -> dict:
    path = directory / "cluster.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no cluster.json in {directory} (start one with 'transportd cluster up')") from None


def running_nodes(directory: Path, nodes: int) -> list[tuple[str, int]]:
    """The nodes of the cluster in ``directory`` that run now, as (short name, pid; 0 when its pid
    cannot be read): a node runs there when it holds its data dir's lock (``datalock.holder``), so a
    node restarted by hand counts, and a pid in cluster.json that the system gave to another
    process does not. Looks at node1..node``nodes`` and at every node cluster.json names."""
    from transportd.node import datalock
    data_dirs = {f"node{i + 1}": directory / f"node{i + 1}" for i in range(nodes)}
    try:
        for n in json.loads((directory / "cluster.json").read_text()).get("nodes", []):
            data_dirs.setdefault(n["short"], Path(n["data_dir"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # no cluster.json (or not one of ours): the generated data dirs are all there is
    running = []
    for short, data_dir in data_dirs.items():
        pid = datalock.holder(data_dir)
        if pid is not None:
            running.append((short, pid))
    return running

