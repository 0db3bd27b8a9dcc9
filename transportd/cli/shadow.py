"""``transportd shadow``: the shadow queues this node holds for its primaries (Shadow Redundancy Manager).

It owns the per-primary view (shadows held, Shadow Safety Net copies, last heartbeat,
consecutive failures, recorded queue database ID) and the list of copies held for one
primary. It only reads: it never promotes, discards or changes a shadow, and never
writes SQL (the queries are queue-layer functions).
"""

from __future__ import annotations

import functools

import click

from transportd.cli.common import (
    CliError,
    emit_json,
    iso,
    json_option,
    node_options,
    open_store,
    table,
)
from transportd.config import Config
from transportd.queue import admin
from transportd.queue import messages as mq


@click.group("shadow")
def shadow_group() -> None:
    """Shadow queues this node holds for its primaries (Shadow Redundancy Manager)."""


def shadow_rows(cfg: Config) -> list[dict]:
    store = open_store(cfg, read_only=True)
    try:
        rows = store.read(admin.shadow_summary)
    finally:
        store.close()
    for r in rows:
        r["last_heartbeat_at"] = iso(r["last_heartbeat_at"])
    return rows


@shadow_group.command("list")
@node_options
@json_option("JSON lines")
def shadow_list(cfg: Config, as_json: bool) -> None:
    """Per primary: shadows held, last successful heartbeat, consecutive failures, recorded DB ID
    (a primary no longer polled, holding none of its shadows: "not polled: no shadows held")."""
    rows = shadow_rows(cfg)
    if as_json:
        emit_json(rows)
        return
    click.echo(table(["primary", "shadows", "safety net", "last heartbeat", "failures", "queue database id",
                      "last error"],
                     [(r["primary"], r["shadows"], r["shadow_safety_net"], r["last_heartbeat_at"] or "",
                       r["consecutive_failures"], r["queue_database_id"] or "", r["last_error"]) for r in rows]))


@shadow_group.command("show")
@node_options
@click.argument("primary")
@click.option("--all", "include_done", is_flag=True, help="include copies in the Shadow Safety Net")
@json_option("JSON lines")
def shadow_show(cfg: Config, primary: str, include_done: bool, as_json: bool) -> None:
    """The shadow copies held for one primary (a peer, or a node this one holds copies for)."""
    store = open_store(cfg, read_only=True)
    try:
        known = {r["primary"] for r in store.read(admin.shadow_summary)} | {p.name for p in cfg.peers}
        if primary not in known and primary.lower() in {k.lower() for k in known}:
            primary = next(k for k in known if k.lower() == primary.lower())  # host names: any case
        rows = store.read(functools.partial(admin.shadow_copies, primary=primary, include_done=include_done))
    finally:
        store.close()
    if not rows and primary not in known:
        raise CliError(f"no primary {primary!r}: neither a peer nor a node this one holds shadows for "
                       f"(known: {', '.join(sorted(known)) or 'none'})")
    out = [{"id": r["id"], "network_message_id": r["network_message_id"], "shadow_guid": r["shadow_guid"],
            "message_id": r["message_id"], "from": r["sender"], "size": r["size"],
            "received_at": iso(r["received_at"]), "state": "Shadow" if r["state"] == mq.QUEUED else r["state"],
            "shadow_rank": r["shadow_rank"]}
           for r in rows]
    if as_json:
        emit_json(out)
        return
    click.echo(table(["id", "shadow guid", "rank", "from", "size", "received", "state"],
                     [(r["id"], r["shadow_guid"], r["shadow_rank"], r["from"] or "<>", r["size"], r["received_at"],
                       r["state"]) for r in out]))
