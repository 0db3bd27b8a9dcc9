"""``transportd health``: the container healthcheck, an SMTP 220 greeting from each listener.

It owns connecting to the node's frontend and transport connectors (or each
``--server``), reading the greeting and the exit code (0 healthy, 1 not, 2 bad options). It never
sends mail and never reads tracking logs; it opens the queue database only when given a
data directory alone (``transportd -d DIR health``: which config the node runs is recorded there).
"""

from __future__ import annotations

import sys

import click

from transportd import config as config_mod
from transportd.cli.common import data_dir_option, load_config, node_location


def smtp_greets(address: str, timeout: float, implicit_tls: bool = False) -> str | None:
    """None when ``host:port`` answers with an SMTP 220 greeting (after a TLS handshake where it
    speaks TLS from the start, its certificate not checked: a liveness check), else what went wrong."""
    import socket as socket_mod
    import ssl
    try:
        host, port = config_mod.parse_hostport(address)
        with socket_mod.create_connection((host.strip("[]"), port), timeout=timeout) as raw:
            s = raw
            if implicit_tls:
                context = ssl.create_default_context()
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
                s = context.wrap_socket(raw)
            s.settimeout(timeout)
            greeting = s.recv(512)
            s.sendall(b"QUIT\r\n")
    except ValueError as exc:
        return str(exc)
    except OSError as exc:
        return exc.strerror or str(exc) or exc.__class__.__name__
    if greeting.startswith(b"220"):
        return None
    if not greeting:
        return "closed the connection without a greeting"
    # The first line as text (a 421 says why: too many connections, shutting down); bytes that
    # would disturb a terminal or a log line become '?'.
    line = greeting.decode("utf-8", "replace").splitlines()[0][:200]
    return "answered " + "".join(c if c.isprintable() else "?" for c in line)


@click.command("health")
@click.option("--config", "-c", "config", type=click.Path(dir_okay=False), default=None,
              help="node config file (TOML; or TRANSPORTD_CONFIG)")
@data_dir_option()
@click.option("--server", "servers", multiple=True, metavar="HOST:PORT",
              help="check this SMTP listener instead of the node's (repeatable)")
@click.option("--timeout", type=float, default=5.0, show_default=True, help="seconds per listener")
def health(config: str | None, data_dir: str | None, servers: tuple[str, ...], timeout: float) -> None:
    """Exit 0 when the node's frontend and transport connectors (or each --server) greet with 220.

    The container healthcheck: ``transportd health`` in a node, ``transportd health --server
    sink:2500`` for the sink.
    """
    for address in servers:  # a --server that is no address is bad input (exit 2), not an unhealthy node
        try:
            config_mod.parse_hostport(address)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--server") from None
    if not servers:
        cfg = load_config(*node_location(config, data_dir))
        servers = tuple(a for a in (*cfg.frontend.listen, cfg.transport.listen) if a)
        implicit = tuple(cfg.frontend.implicit_tls_listen)
    else:
        implicit = ()
    bad = [(a, why) for a in (*servers, *implicit)
           if (why := smtp_greets(a, timeout, implicit_tls=a in implicit)) is not None]
    for address, why in bad:
        click.echo(f"transportd: unhealthy: {address}: {why}", err=True)
    if bad:
        sys.exit(1)
    click.echo("healthy: " + ", ".join([*servers, *(f"{a} (implicit TLS)" for a in implicit)]))
