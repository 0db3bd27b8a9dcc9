"""``transportd serve`` and ``transportd sink``: the two commands that run a server in the foreground.

It owns turning their options into a running node (``node.daemon``) or a development
sink (``devtools.sink``) and their exit codes. It never opens the queue database
itself: the daemon does, and the sink has none.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from transportd import config as config_mod
from transportd.cli.common import CliError, ConfigCliError, load_config, node_location
from transportd.queue.admin import recorded_config_path


@click.command("serve")
@click.option("--config", "-c", "config", type=click.Path(dir_okay=False), default=None,
              help="node config file (TOML; or before the command, or TRANSPORTD_CONFIG)")
@click.option("--data-dir", "-d", "data_dir", type=click.Path(file_okay=False), default=None,
              help="node data directory: instead of the config's node.data_dir; alone, the node "
                   "that ran there is started again with the config file it ran with")
@click.option("--log-format", type=click.Choice(["text", "json"]), default=None,
              help="operational log format (overrides node.log_format)")
def serve(config: str | None, data_dir: str | None, log_format: str | None) -> None:
    """Run a node: frontend receive connector, queues and delivery."""
    from transportd.node.daemon import serve as run
    from transportd.node.logs import setup_logging
    config, data_dir = node_location(config, data_dir)
    if config is None and data_dir is None:
        raise click.UsageError("Missing option '--config' / '-c' (or TRANSPORTD_CONFIG).")
    if config is None:
        config = recorded_config_path(config_mod.default_for_data_dir(data_dir).db_path)
        if not config or not Path(config).is_file():
            raise click.UsageError(f"--data-dir {data_dir}: no node has run there with a config file that still "
                                   f"exists{f' ({config})' if config else ''}; give --config FILE")
    try:
        cfg = load_config(config, data_dir)
    except click.ClickException as exc:
        if log_format != "json":
            raise
        # Asked for JSON: the one line that says why the node cannot start is JSON too.
        import json
        import time
        from transportd.node.logs import utc_timestamp
        click.echo(json.dumps({"ts": utc_timestamp(time.time()), "level": "error", "logger": "transportd",
                               "message": exc.format_message()}), err=True)
        sys.exit(exc.exit_code)
    setup_logging(cfg.node.log_level, log_format or cfg.node.log_format)
    sys.exit(run(cfg, log_format or cfg.node.log_format))


@click.command("sink")
@click.option("--listen", default="127.0.0.1:2500", show_default=True, help="address:port to listen on")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default="./data/sink", show_default=True,
              help="Maildir where every received message is stored")
@click.option("--smtputf8/--no-smtputf8", default=True, show_default=True,
              help="advertise SMTPUTF8 (RFC 6531); --no-smtputf8 stands for an older server")
@click.option("--8bitmime/--no-8bitmime", "eightbitmime", default=True, show_default=True,
              help="advertise 8BITMIME (RFC 6152); --no-8bitmime refuses 8-bit data")
def sink(listen: str, directory: str, smtputf8: bool, eightbitmime: bool) -> None:
    """Run a development sink: an SMTP server outside the boundary that stores all it receives."""
    import asyncio
    from transportd.devtools.sink import run_sink
    try:
        host, port = config_mod.parse_hostport(listen)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--listen") from None
    maildir = Path(directory).resolve()
    try:  # before listening: an OSError of run_sink is then the address's, and says so
        for sub in ("tmp", "new", "cur"):
            (maildir / sub).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename and Path(exc.filename) != maildir else ""
        raise ConfigCliError(f"--dir {directory}: cannot make the Maildir: {exc.strerror or exc}{where}") from None
    try:
        asyncio.run(run_sink(host, port, maildir, smtputf8=smtputf8, eightbitmime=eightbitmime))
    except OSError as exc:
        raise CliError(f"sink cannot listen on {listen}: {exc.strerror or exc}") from None
