"""The ``transportd`` command line: the root group, its command groups, and ``main`` (the entry point).

It owns the root ``cli`` group (version, ``-h``), registering each group's module
(serve and sink, config, queue and redirect, message, safetynet, shadow, cluster,
tracking, health, chaos, analyze) and how the real CLI reports a bad argument (one
line on stderr, exit code 2). It defines no command of its own and never opens the
queue database.

Read commands open the queue database directly (read-only use), so they work
whether the daemon runs or not; operator actions are small durable
transactions on the same database, which a running daemon picks up at its next
scan (``delivery.queue_poll_interval``, 0.5 s by default). Tables by default,
JSON lines with ``--json``. A bad config or argument is one line on stderr and
exit code 2; a missing or unreadable queue database is one line and exit 1.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from transportd import __version__
from transportd.cli.analyze import analyze_group
from transportd.cli.chaos import chaos
from transportd.cli.cluster import cluster_group
from transportd.cli.config import config_group
from transportd.cli.health import health
from transportd.cli.message import message_group
from transportd.cli.queue import queue_group, redirect
from transportd.cli.safetynet import safetynet_group
from transportd.cli.serve import serve, sink
from transportd.cli.shadow import shadow_group
from transportd.cli.tracking import tracking_group

__all__ = ["cli", "main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="transportd")
def cli() -> None:
    """transportd: an SMTP transport daemon that never loses an acknowledged message."""


for _command in (serve, sink, config_group, queue_group, message_group, redirect, safetynet_group, shadow_group,
                 cluster_group, tracking_group, health, chaos, analyze_group):
    cli.add_command(_command)
del _command


def _show_usage_error(self: click.UsageError, file: Any = None) -> None:
    """Bad CLI arguments: one line on stderr (exit code 2), like a bad config."""
    where = self.ctx.command_path if self.ctx is not None else "transportd"
    click.echo(f"transportd: error: {self.format_message()} (see '{where} --help')", err=True)


def main() -> None:
    click.UsageError.show = _show_usage_error  # the real CLI only; CliRunner tests keep click's text
    try:
        cli.main(standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
