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

import click

from transportd import __version__
from transportd.cli.analyze import analyze_group
from transportd.cli.chaos import chaos
from transportd.cli.cluster import cluster_group
from transportd.cli.common import root_options
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
@root_options
def cli() -> None:
    """transportd: an SMTP transport daemon that never loses an acknowledged message.

    --config/-c, --data-dir/-d and --json may come before the command (they apply to it) or
    after it (those win); TRANSPORTD_CONFIG stands for --config. Shell completion: see
    docs/operations.md (eval "$(_TRANSPORTD_COMPLETE=bash_source transportd)").
    """


for _command in (serve, sink, config_group, queue_group, message_group, redirect, safetynet_group, shadow_group,
                 cluster_group, tracking_group, health, chaos, analyze_group):
    cli.add_command(_command)
del _command


def main(args: list[str] | None = None) -> None:
    """The entry point: click's own parsing and completion, with every CLI error as one line on
    stderr (exit 2 for a bad argument, like a bad config)."""
    try:
        code = cli.main(args, prog_name="transportd", standalone_mode=False)
    except click.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "transportd"
        click.echo(f"transportd: error: {exc.format_message()} (see '{where} --help')", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort as exc:
        sys.exit(130 if isinstance(exc.__cause__, KeyboardInterrupt) else 1)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
