"""``transportd queue`` and ``transportd redirect``: delivery queues and draining them to a peer.

It owns the queue commands (list, suspend, resume, retry, like Exchange's Get-Queue,
Suspend-Queue, Resume-Queue, Retry-Queue) and ``redirect`` (Redirect-Message) and their
output; none writes a tracking row (the daemon tracks the hand-overs a redirect causes). It
never writes SQL: each read and each action is one queue-layer function run in
``QueueStore.read`` or ``QueueStore.transaction``.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import click

from transportd.cli.common import (
    CliError,
    ConfigCliError,
    emit_json,
    fmt_time,
    iso,
    json_option,
    node_options,
    open_store,
    table,
)
from transportd.config import Config
from transportd.queue import admin
from transportd.queue import messages as mq


@click.group("queue")
def queue_group() -> None:
    """Delivery queues (like Exchange's Get-Queue, Retry-Queue, Suspend-Queue, Resume-Queue)."""


def queue_rows(cfg: Config) -> list[dict]:
    store = open_store(cfg, read_only=True)
    try:
        rows = store.read(functools.partial(mq.list_queues, now=time.time()))
        for r in rows:
            r["next_retry_at"] = iso(r["next_retry_at"])
        return rows
    finally:
        store.close()


def render_queues(rows: list[dict]) -> str:
    return table(["identity", "delivery type", "state", "messages", "next retry", "last error"],
                 [(r["identity"], r["delivery_type"], r["state"], r["message_count"],
                   r["next_retry_at"] or "", r["last_error"]) for r in rows], max_width=70, wrap=["last error"])


@queue_group.command("list")
@node_options
@json_option("JSON lines")
@click.option("--watch", "watch", is_flag=True, help="refresh in place until Ctrl-C")
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="--watch refresh seconds (at least 0.1)")
def queue_list(cfg: Config, as_json: bool, watch: bool, interval: float) -> None:
    """List delivery queues: identity, delivery type, state, message count, next retry, last error."""
    if not watch:
        rows = queue_rows(cfg)
        if as_json:
            emit_json(rows)
        else:
            click.echo(render_queues(rows))
        return
    try:
        while True:
            rows = queue_rows(cfg)
            if as_json:  # a stream of JSON lines only: each refresh's rows, stamped with its time
                now = iso(time.time())
                emit_json({**r, "time": now} for r in rows)
            else:
                click.echo("\x1b[H\x1b[2J" + f"transportd queue list  {fmt_time(time.time())} UTC  "
                           "(Ctrl-C stops)\n\n" + render_queues(rows), nl=True)
            time.sleep(interval)
    except KeyboardInterrupt:
        pass


def queue_action(cfg: Config, name: str, action: Callable[[Any], dict | None]) -> dict:
    """Run ``action`` (a queue-layer function of the connection returning the queue row or None)."""
    if name.lower() == mq.POISON.lower():  # not a delivery queue: its messages are released one by one
        raise CliError("the Poison queue is not retried, suspended or resumed as a whole (nor is Exchange's): "
                       "resume or remove its messages (transportd message resume --filter queue=Poison)")
    store = open_store(cfg)
    try:
        q = store.transaction(action)
    finally:
        store.close()
    if q is None:
        # Nothing is made here for a name: a typo would make a queue nothing ever routes to
        # (held forever if suspended). A queue exists while mail for its next hop is queued, or
        # was lately: an empty one is removed after delivery.queue_max_idle_time (Exchange's
        # QueueMaxIdleTime), a suspended one never.
        raise CliError(f"no queue {name!r} (see 'transportd queue list'): a delivery queue exists while its "
                       f"next hop has mail here, and an empty one is removed after "
                       f"delivery.queue_max_idle_time ({cfg.delivery.queue_max_idle_time:g}s) unless suspended; "
                       f"it is made again when mail for its next hop comes")
    return q


@queue_group.command("suspend")
@node_options
@click.argument("queue")
def queue_suspend(cfg: Config, queue: str) -> None:
    """Stop delivery from a queue (messages stay queued)."""
    q = queue_action(cfg, queue, functools.partial(admin.set_queue_suspended_by_name, name=queue, suspended=True))
    click.echo(f"queue {q['identity']} suspended" if q["changed"]
               else f"queue {q['identity']} was already suspended (nothing changed)")


@queue_group.command("resume")
@node_options
@click.argument("queue")
def queue_resume(cfg: Config, queue: str) -> None:
    """Resume delivery from a suspended queue."""
    q = queue_action(cfg, queue, functools.partial(admin.set_queue_suspended_by_name, name=queue, suspended=False))
    click.echo(f"queue {q['identity']} resumed" if q["changed"]
               else f"queue {q['identity']} was not suspended (nothing changed)")


@queue_group.command("retry")
@node_options
@click.argument("queue")
def queue_retry(cfg: Config, queue: str) -> None:
    """Retry a queue now, ignoring its back-off."""
    q = queue_action(cfg, queue, functools.partial(admin.retry_queue_by_name, name=queue))
    if not q["changed"]:
        raise CliError(f"queue {q['identity']} is suspended: nothing leaves it until "
                       f"'transportd queue resume {q['identity']}' (nothing changed)")
    from transportd.node import datalock
    when = "now" if datalock.holder(cfg.data_dir) is not None else "when the node starts (it is not running)"
    click.echo(f"queue {q['identity']} will be retried {when} ({q['recipients']} recipient(s) due)")


@click.command("redirect")
@node_options
@click.option("--target", required=True, help="the peer (FQDN) that takes over this node's queued messages")
@click.option("--wait", "wait", type=click.FloatRange(min=0), default=30.0, show_default=True, metavar="SECONDS",
              help="how long to wait for delivery attempts under way (Active) to end, so that the recipients "
                   "they leave pending move too; 0 moves only what is pending now")
def redirect(cfg: Config, target: str, wait: float) -> None:
    """Drain this node's queues to a peer before maintenance (Exchange's Redirect-Message).

    Every queued message goes to the peer hop by hop with XSHADOW: the peer becomes primary and
    this node keeps a shadow until the peer's discard. A recipient in a delivery attempt (Active)
    finishes it here; if the attempt leaves it pending (a deferral), it is moved once the attempt
    ends, for up to --wait seconds. What an operator holds stays here, held, and is counted by
    hold: recipients of a suspended queue (the peer would send them on to the same next hop at
    once), suspended messages, the Poison queue. A running daemon starts within a second; a stopped one at its
    next start. As with Redirect-Message, message tracking shows the move as the hand-over itself
    (SEND to the peer, RECEIVE there); REDIRECT is Exchange's event for a recipient redirected to
    an alternate recipient, not written here.
    """
    target = target.strip().lower()
    if target not in {p.name for p in cfg.peers}:
        known = ", ".join(p.name for p in cfg.peers) or "none configured"
        raise ConfigCliError(f"--target: {target} is not a peer of {cfg.node.name} (peers: {known})")
    store = open_store(cfg)
    moved: set[int] = set()
    deadline = time.monotonic() + wait
    try:
        while True:
            moved.update(m["id"] for m in store.transaction(
                functools.partial(mq.redirect_to_peer, target=target, now=time.time())))
            in_attempt = store.read(functools.partial(mq.in_attempt_here, target=target))
            if not in_attempt or time.monotonic() >= deadline:
                break
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        held = store.read(mq.held_messages)
    finally:
        store.close()
    click.echo(f"{len(moved)} message(s) redirected to {target} (queue peer:{target})")
    if in_attempt:
        click.echo(f"{in_attempt} message(s) still in a delivery attempt here after {wait:g}s: what the attempt "
                   f"leaves pending stays here; run redirect again once it ends")
    if any(held.values()):
        # Each hold named: a suspended queue is resumed with 'queue resume', a message with 'message resume'.
        which = ", ".join(f"{n} {hold}" for hold, n in held.items() if n)
        click.echo(f"{sum(held.values())} suspended or poison message(s) stay here, held ({which}): resume "
                   f"them and redirect again to move them")
