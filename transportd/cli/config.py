"""``transportd config``: the configuration reference and a node's effective configuration.

It owns printing every key (its value, Exchange name and meaning) as a table or JSON
lines, the entries of ``[[peers]]``, ``[mailbox_databases]`` and ``[[send_connectors]]`` after them. It never changes a config file and never opens the queue database.
"""

from __future__ import annotations

import click

from transportd import config as config_mod
from transportd.cli.common import emit_json, json_option, node_options, table
from transportd.config import Config


@click.group("config")
def config_group() -> None:
    """Inspect configuration."""


@config_group.command("reference")
def config_reference() -> None:
    """Print the configuration reference as a Markdown table (as in the README)."""
    click.echo(config_mod.markdown_reference())


@config_group.command("show")
@node_options
@json_option("JSON lines")
def config_show(cfg: Config, as_json: bool) -> None:
    """Print every key's effective value, with its Exchange name and meaning ([[peers]],
    [mailbox_databases] and [[send_connectors]] included)."""
    if cfg.path is None and not cfg.data_dir.is_dir():  # -d alone, naming no node's folder: say so
        click.echo(f"transportd: note: no folder {cfg.data_dir}: the defaults are shown (no node has run there)",
                   err=True)
    rows = []
    for key, value in cfg.effective():
        rows.append({"key": key.dotted, "value": config_mod.format_value(key, value),
                     "exchange_name": key.exchange, "meaning": key.meaning})
    for name, value, exchange, meaning in config_mod.table_entries(cfg):  # [[peers]], [mailbox_databases], ...
        rows.append({"key": name, "value": value, "exchange_name": exchange, "meaning": meaning})
    if as_json:
        emit_json(rows)
        return
    click.echo(f"# {cfg.path or 'defaults'}; data dir {cfg.data_dir}")
    click.echo(table(["key", "value", "exchange name", "meaning"],
                     [(r["key"], r["value"], r["exchange_name"], r["meaning"]) for r in rows], max_width=90))
