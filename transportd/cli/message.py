"""``transportd message``: queued messages (like Get-Message, Suspend-Message, Resume-Message, Remove-Message).

It owns listing and showing messages (envelope, headers, per-recipient status and
tracking events), suspending, resuming (also out of the Poison queue) and removing
one (optionally with an NDR), with the ADMIN and DSN tracking rows those actions
write after their commit. It never writes SQL: each read and each action is one
queue-layer function run in ``QueueStore.read`` or ``QueueStore.transaction``.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any, Callable

import click

from transportd.cli.common import (CliError, admin_event, emit_json, iso, json_default, node_options, open_store,
                                   table, tracking_log_for)
from transportd.config import Config
from transportd.queue import admin
from transportd.queue import messages as mq


@click.group("message")
def message_group() -> None:
    """Messages in the queues (like Get-Message, Suspend-Message, Resume-Message, Remove-Message)."""


@message_group.command("list")
@node_options
@click.option("--queue", "queue", default=None,
              help="only messages in this queue (identity or id; 'Poison' for the Poison queue)")
@click.option("--all", "include_done", is_flag=True, help="include Safety Net and removed messages")
@click.option("--json", "as_json", is_flag=True, help="JSON lines")
def message_list(cfg: Config, queue: str | None, include_done: bool, as_json: bool) -> None:
    """List queued messages."""
    store = open_store(cfg)
    try:
        rows = store.read(functools.partial(admin.messages_in_queue, queue=queue, include_done=include_done))
    finally:
        store.close()
    if rows is None:
        raise CliError(f"no queue {queue!r} (see 'transportd queue list')")
    for r in rows:
        for k in ("received_at", "expires_at", "next_retry_at"):
            r[k] = iso(r[k])
    if as_json:
        emit_json(rows)
        return
    click.echo(table(["id", "from", "subject", "size", "status", "queue", "received", "last error"],
                     [(r["id"], r["from"] or "<>", r["subject"], r["size"], r["status"], ",".join(r["queues"]),
                       r["received_at"], r["last_error"]) for r in rows], max_width=50))


def get_message(cfg: Config, message_id: int) -> dict:
    store = open_store(cfg)
    try:
        m = store.read(functools.partial(admin.message_with_body, message_id=message_id))
    finally:
        store.close()
    if m is None:
        raise CliError(f"no message {message_id} in {cfg.db_path}")
    return m


@message_group.command("show")
@node_options
@click.argument("message_id", type=int)
@click.option("--json", "as_json", is_flag=True, help="one JSON object")
def message_show(cfg: Config, message_id: int, as_json: bool) -> None:
    """Envelope, headers, per-recipient status and tracking events of one message."""
    from transportd.smtp.headers import split_headers
    from transportd.tracking import search
    m = get_message(cfg, message_id)
    body = m.pop("body")
    headers = split_headers(body)[0].decode("utf-8", "replace").rstrip() if body else ""
    events = list(search(cfg.tracking_dir, network_message_id=m["network_message_id"])) \
        if cfg.tracking_dir.is_dir() else []
    for k in ("received_at", "expires_at", "completed_at", "safety_net_until"):
        m[k] = iso(m[k])
    for r in m["recipients"]:
        for k in ("next_retry_at", "last_attempt_at", "completed_at"):
            r[k] = iso(r[k])
    if as_json:
        m["headers"] = headers
        m["tracking"] = events
        click.echo(json.dumps(m, default=json_default, ensure_ascii=False))
        return
    click.echo(f"Message {m['id']}  status {m['status']}  ({m['role']}, {m['state']})")
    for label, key in (("Network message id", "network_message_id"), ("Message-ID", "message_id"),
                       ("From", "sender"), ("Subject", "subject"), ("Size", "size"),
                       ("Received", "received_at"), ("Expires", "expires_at"), ("Client", "client_ip"),
                       ("Origin", "origin"), ("Redundancy", "redundancy")):
        click.echo(f"  {label + ':':20} {m[key] if m[key] not in (None, '') else '-'}")
    click.echo("\nRecipients:")
    click.echo(table(["address", "queue", "status", "attempts", "next retry", "last error"],
                     [(r["address"], r["queue"], r["status"], r["attempts"],
                       r["next_retry_at"] if r["status"] == mq.RETRY else "", r["last_error"] or "")
                      for r in m["recipients"]], max_width=70))
    click.echo("\nHeaders:")
    click.echo("\n".join("  " + line for line in headers.splitlines()))
    click.echo("\nTracking events:")
    click.echo(table(["date-time", "event", "source", "recipients", "status / context"],
                     [(e["date-time"], e["event-id"], e["source"], e["recipient-address"],
                       e["recipient-status"] or e["source-context"]) for e in events], max_width=70))


def message_action(cfg: Config, action: Callable[[Any], Any]) -> Any:
    """Run ``action`` (a queue-layer function of the connection) in one durable transaction."""
    store = open_store(cfg)
    try:
        return store.transaction(action)
    finally:
        store.close()


@message_group.command("suspend")
@node_options
@click.argument("message_id", type=int)
def message_suspend(cfg: Config, message_id: int) -> None:
    """Hold a message: no delivery attempts until resumed."""
    if not message_action(cfg, functools.partial(admin.suspend_message, message_id=message_id)):
        raise CliError(f"no queued message {message_id}")
    click.echo(f"message {message_id} suspended")


@message_group.command("resume")
@node_options
@click.argument("message_id", type=int)
def message_resume(cfg: Config, message_id: int) -> None:
    """Release a suspended message, or one held in the Poison queue (its failure count is reset)."""
    row, released, ok = message_action(cfg, functools.partial(admin.resume_message, message_id=message_id))
    if not ok:
        raise CliError(f"no queued message {message_id}")
    if released:
        log_poison_release(cfg, row, "Resumed")
    click.echo(f"message {message_id} resumed" + (" from the Poison queue" if released else ""))


def log_poison_release(cfg: Config, row: dict, how: str) -> None:
    """POISONMESSAGE (source ADMIN): an operator took a message out of the Poison queue."""
    store = open_store(cfg)
    try:
        trk = tracking_log_for(cfg, store)
    finally:
        store.close()
    if trk is None:
        return
    try:
        admin_event(trk, "POISONMESSAGE", row, f"{how} from the Poison queue by transportd message")
    finally:
        trk.close()


@message_group.command("remove")
@node_options
@click.argument("message_id", type=int)
@click.option("--ndr", is_flag=True, help="send a non-delivery report to the sender")
def message_remove(cfg: Config, message_id: int, ndr: bool) -> None:
    """Remove a message from the queues (logged as DROP), optionally with an NDR."""
    from transportd.node.outcomes import dsn_message
    from transportd.smtp.dsn import RecipientReport
    store = open_store(cfg)
    reply = "550 5.2.0 Message deleted by an administrator"
    now = time.time()

    def make_ndr(row: dict, body: bytes, removed: list[dict]) -> mq.NewMessage | None:
        return dsn_message(cfg, row, body, [RecipientReport(r["address"], "failed", "5.2.0", reply)
                                            for r in removed], now)
    try:
        result = store.transaction(functools.partial(admin.remove_queued_message, message_id=message_id, now=now,
                                                     make_ndr=make_ndr if ndr else None))
        if result is None:
            raise CliError(f"no queued message {message_id}")
        row, removed, created = result
        trk = tracking_log_for(cfg, store)
    finally:
        store.close()
    if trk is not None:
        try:
            admin_event(trk, "DROP", row, "transportd message remove", recipients=[r["address"] for r in removed],
                        recipient_status=[reply] * len(removed))
            if created:
                dsn_id, dsn = created
                trk.write("DSN", "DSN", internal_message_id=dsn_id, message_id=dsn.message_id,
                          network_message_id=dsn.network_message_id, recipients=[row["sender"]],
                          reference=row["message_id"], related_recipient_address=row["sender"],
                          source_context=f"original internal id {row['id']}; network id {row['network_message_id']}")
        finally:
            trk.close()
    if row.get("poisoned"):
        log_poison_release(cfg, row, "Removed")
    click.echo(f"message {message_id} removed" + (" (NDR queued to the sender)" if created else ""))
