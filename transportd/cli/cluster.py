"""``transportd cluster``: a local multi-node cluster on loopback (127.0.0.x) for development.

It owns writing the node configs of such a cluster, running it in the foreground and
showing each node alive or not with its queue and shadow counts (read through the
queue and shadow views). It is a development aid: it never touches a node that is
not on loopback and never writes to a queue database.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import click

from transportd import config as config_mod
from transportd.cli.common import (
    CliError,
    ConfigCliError,
    emit_json,
    json_option,
    load_config,
    root,
    table,
)
from transportd.cli.queue import queue_rows
from transportd.cli.shadow import shadow_rows
from transportd.config import ConfigError


@click.group("cluster")
def cluster_group() -> None:
    """A local multi-node cluster on loopback (127.0.0.x addresses)."""


def _cluster_options(fn: Callable) -> Callable:
    options = [
        click.option("--nodes", default=3, show_default=True, type=click.IntRange(1, 200)),
        click.option("--sites", default=2, show_default=True, type=click.IntRange(1, 200)),
        click.option("--ip-base", default=11, show_default=True, type=click.IntRange(2, 254),
                     help="node N listens on 127.0.0.(ip-base + N - 1)"),
        click.option("--frontend-port", default=2525, show_default=True, type=click.IntRange(1, 65535)),
        click.option("--transport-port", default=2526, show_default=True, type=click.IntRange(1, 65535)),
        click.option("--sink", "sink_address", default="127.0.0.10:2500", show_default=True,
                     help="address of the external sink (outside the boundary)"),
        click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
                     help="a config value for every node, e.g. --set shadow_redundancy.shadow_heartbeat_frequency=2"),
        click.option("--versions", default=None, metavar="V,V,...",
                     help="shadow redundancy version per node, in order (2010 or 2013), e.g. 2010,2013,2013 "
                          "for a mixed cluster; default: 2013 everywhere"),
    ]
    for opt in reversed(options):
        fn = opt(fn)
    return fn


def _generate(directory: Path, nodes: int, sites: int, ip_base: int, frontend_port: int, transport_port: int,
              sink_address: str, overrides: tuple[str, ...], versions: str | None, secret: str | None = None):
    from transportd.devtools.cluster import generate, parse_overrides, running_nodes
    # Before anything is written: the running nodes read these configs at start, and a second
    # set of node processes would only find their data dirs taken (and cluster.json would name
    # them, not the nodes that serve).
    running = running_nodes(directory.resolve(), nodes)
    if running:
        raise CliError(f"a cluster runs in {directory}: "
                       + ", ".join(f"{short} (pid {pid or 'unknown'})" for short, pid in running)
                       + "; stop it first (Ctrl-C or SIGTERM to its 'cluster up') or use another folder")
    if sites > nodes:
        raise click.BadParameter(f"{sites} sites need at least {sites} nodes", param_hint="--sites")
    per_node = [v.strip() for v in versions.split(",")] if versions else None
    if per_node is not None and (len(per_node) != nodes or not set(per_node) <= {"2010", "2013"}):
        raise click.BadParameter(f"give one version (2010 or 2013) per node: {nodes} node(s), got {versions!r}",
                                 param_hint="--versions")
    try:
        host, _ = config_mod.parse_hostport(sink_address)
        extra = parse_overrides(overrides)
        specs = generate(directory, nodes=nodes, sites=sites, ip_base=ip_base, frontend_port=frontend_port,
                         transport_port=transport_port, sink_address=sink_address, overrides=extra,
                         secret=secret, versions=per_node)
    except (ValueError, ConfigError) as exc:
        raise ConfigCliError(str(exc)) from None
    except OSError as exc:  # a folder that cannot be made or written
        raise ConfigCliError(f"cannot write the node configs in {directory}: "
                             f"{exc.strerror or exc}{f' ({exc.filename})' if exc.filename else ''}") from None
    if not host.startswith("127."):
        raise ConfigCliError("--sink: the local cluster stays on loopback (127.0.0.0/8)")
    for spec in specs:
        load_config(spec.config, None)  # a bad --set fails here, naming the key
    return specs


@cluster_group.command("config")
@click.option("--out", "out", type=click.Path(file_okay=False), required=True, help="folder for the node configs")
@_cluster_options
def cluster_config(out: str, nodes: int, sites: int, ip_base: int, frontend_port: int, transport_port: int,
                   sink_address: str, overrides: tuple[str, ...], versions: str | None) -> None:
    """Write the node configs of a local cluster without starting it."""
    specs = _generate(Path(out), nodes, sites, ip_base, frontend_port, transport_port, sink_address, overrides,
                      versions)
    for s in specs:
        click.echo(f"{s.config}  {s.name}  {s.site}  frontend {s.frontend}  transport {s.transport}")


def _cluster_dir(data_dir: str | None) -> Path:
    """The cluster's folder: ``--data-dir`` after the command, else before it
    (``transportd -d DIR cluster status``), else ./data/cluster."""
    return Path(data_dir or root().data_dir or DEFAULT_CLUSTER_DIR).resolve()


DEFAULT_CLUSTER_DIR = "./data/cluster"


@cluster_group.command("up")
@click.option("--data-dir", "-d", "data_dir", type=click.Path(file_okay=False), default=None,
              help=f"folder for configs, node data, the sink and cluster.json  [default: {DEFAULT_CLUSTER_DIR}]")
@_cluster_options
def cluster_up(data_dir: str | None, nodes: int, sites: int, ip_base: int, frontend_port: int, transport_port: int,
               sink_address: str, overrides: tuple[str, ...], versions: str | None) -> None:
    """Start the cluster in the foreground (Ctrl-C or SIGTERM stops every process)."""
    from transportd.devtools.cluster import Cluster
    directory = _cluster_dir(data_dir)
    secret = None
    old = directory / "node1.toml"
    if old.exists():  # keep the secret of an existing cluster so its data dirs stay usable
        import tomllib
        try:
            secret = tomllib.loads(old.read_text()).get("cluster", {}).get("secret")
        except (tomllib.TOMLDecodeError, OSError):
            secret = None
    specs = _generate(directory, nodes, sites, ip_base, frontend_port, transport_port, sink_address,
                      overrides, versions, secret=secret)
    cluster = Cluster(directory, specs, sink_address)
    cluster.start()
    first = specs[0]
    host, _, port = first.frontend.rpartition(":")
    click.echo(f"[cluster] {len(specs)} nodes in {sites} site(s), sink on {sink_address} "
               f"storing mail in {directory / 'sink' / 'new'}; cluster.json in {directory}")
    click.echo(f"[cluster] try: swaks --server {host}:{port} --to someone@elsewhere.test  "
               f"(or --to alice@example.test for a local mailbox)")
    click.echo(f"[cluster]      transportd shadow list --config {specs[-1].config}   "
               "(the shadows it holds for its peers)")
    sys.exit(cluster.wait())


@cluster_group.command("status")
@click.option("--data-dir", "-d", "data_dir", type=click.Path(file_okay=False), default=None,
              help=f"the cluster's folder (of cluster up)  [default: {DEFAULT_CLUSTER_DIR}]")
@json_option("JSON lines")
def cluster_status(data_dir: str | None, as_json: bool) -> None:
    """Each node alive or not, with its queue and shadow counts."""
    import socket as socket_mod

    from transportd.devtools.cluster import load_cluster_json
    from transportd.node import datalock
    try:
        doc = load_cluster_json(_cluster_dir(data_dir))
    except FileNotFoundError as exc:
        raise CliError(str(exc)) from None
    rows = []
    for n in doc["nodes"]:
        host, _, port = n["frontend"].rpartition(":")
        listening = False
        try:
            with socket_mod.create_connection((host, int(port)), timeout=0.5):
                listening = True
        except OSError:
            pass
        queued = shadows = None
        cfg = load_config(n["config"], None)
        # The node that holds its data dir's lock, whoever started it (cluster up, or serve by
        # hand after a crash): cluster.json's pid is only the one cluster up started.
        pid = datalock.holder(cfg.data_dir)
        if cfg.db_path.exists():
            try:
                queued = sum(q["message_count"] for q in queue_rows(cfg))
                shadows = sum(r["shadows"] for r in shadow_rows(cfg))
            except CliError:
                pass
        rows.append({"name": n["name"], "site": n["site"], "frontend": n["frontend"], "transport": n["transport"],
                     "pid": pid or None, "alive": pid is not None and listening,
                     "queued": queued, "shadows": shadows})
    if as_json:
        emit_json(rows)
        return
    click.echo(table(["node", "site", "frontend", "transport", "pid", "alive", "queued", "shadows held"],
                     [(r["name"], r["site"], r["frontend"], r["transport"], r["pid"], "yes" if r["alive"] else "NO",
                       r["queued"], r["shadows"]) for r in rows]))
