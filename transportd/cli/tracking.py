"""``transportd tracking``: searching this node's message tracking logs (like Get-MessageTrackingLog).

It owns the search options (message ids, sender, recipient, event id, time window)
and printing the matching MSGTRK rows as a table or JSON lines. It only reads the
tracking files: it never writes them and never opens the queue database.
"""

from __future__ import annotations

import click

from transportd.cli.common import (
    CliError,
    ConfigCliError,
    emit_json,
    json_option,
    node_options,
    parse_when,
    table,
)
from transportd.config import Config


@click.group("tracking")
def tracking_group() -> None:
    """Message tracking logs (like Get-MessageTrackingLog)."""


@tracking_group.command("search")
@node_options
@click.option("--message-id", default=None, help="Message-ID header (with or without <>)")
@click.option("--network-message-id", default=None)
@click.option("--internal-message-id", default=None)
@click.option("--sender", default=None)
@click.option("--recipient", "recipients", multiple=True,
              help="a recipient address; repeat for any of several (as -Recipients)")
@click.option("--subject", default=None, help="text found anywhere in the subject, in any case (as -MessageSubject)")
@click.option("--event-id", default=None, help="RECEIVE, DELIVER, SENDEXTERNAL, DEFER, FAIL, DSN, ... (any of Exchange's, in any case)")
@click.option("--start", default=None, help="from this time (ISO 8601, UTC by default)")
@click.option("--end", default=None, help="up to this time (ISO 8601)")
@json_option("JSON lines")
def tracking_search(cfg: Config, message_id: str | None, network_message_id: str | None,
                    internal_message_id: str | None, sender: str | None, recipients: tuple[str, ...],
                    subject: str | None, event_id: str | None, start: str | None, end: str | None, as_json: bool) -> None:
    """Search this node's MSGTRK files (rows that cannot be read are counted on stderr)."""
    from transportd.tracking import search, unknown_event_id
    # A typo would match no row and print an empty table, read as "nothing happened": refused as
    # --filter refuses an unknown field. Exchange's event ids all pass (its logs are searched too).
    if event_id is not None and (problem := unknown_event_id(event_id)) is not None:
        raise ConfigCliError(problem)
    s, e = parse_when(start, "--start"), parse_when(end, "--end")
    if s is not None and e is not None and e < s:
        raise click.BadParameter(f"{end} is before --start {start}: no row could match", param_hint="--end")
    if not cfg.tracking_dir.is_dir():
        raise CliError(f"no tracking logs at {cfg.tracking_dir}")
    errors: list = []
    rows = search(cfg.tracking_dir, message_id=message_id, network_message_id=network_message_id,
                  internal_message_id=internal_message_id, sender=sender, recipient=recipients,
                  event_id=event_id, start=s, end=e, errors=errors, subject=subject)
    try:
        if as_json:
            emit_json(rows)
            return
        rows = list(rows)
    finally:
        if errors:
            path, line, reason = errors[0]
            click.echo(f"transportd: warning: {len(errors)} malformed tracking row(s) skipped "
                       f"(first: {path}:{line}: {reason})", err=True)
    click.echo(table(["date-time", "event", "source", "internal id", "sender", "recipients", "message-id",
                      "status / context"],
                     [(r["date-time"], r["event-id"], r["source"], r["internal-message-id"], r["sender-address"],
                       r["recipient-address"], r["message-id"], r["recipient-status"] or r["source-context"])
                      for r in rows], max_width=48, wrap=["status / context"]))
