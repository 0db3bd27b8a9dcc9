"""``transportd safetynet``: the Primary and Shadow Safety Net of a node, listed and resubmitted.

It owns listing the copies held after processing, resubmitting those of a time
window to a destination (also for an unreachable primary, or by filing a shadow
resubmit request the running node carries out), asking the peers' Shadow Safety
Nets for what predates this queue database, and the RESUBMIT tracking rows. It never
writes SQL: reads and transactions are queue-layer functions run through QueueStore.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import click

from transportd import config as config_mod
from transportd.cli.common import (
    CliError,
    emit_json,
    fmt_time,
    iso,
    json_option,
    node_options,
    open_store,
    parse_when,
    printable,
    table,
    tracking_log_for,
)
from transportd.config import Config
from transportd.queue import admin, bulk
from transportd.tracking import return_path


@click.group("safetynet")
def safetynet_group() -> None:
    """Safety Net: copies kept after processing, for resubmission (Exchange's Safety Net)."""


@safetynet_group.command("list")
@node_options
@click.option("--from", "source", type=click.Choice(["primary", "shadow", "both"]), default="both",
              show_default=True, help="which Safety Net")
@json_option("JSON lines")
def safetynet_list(cfg: Config, source: str, as_json: bool) -> None:
    """Messages held in this node's Primary and Shadow Safety Net, with their hold time."""
    roles = ("primary", "shadow") if source == "both" else (source,)
    store = open_store(cfg, read_only=True)
    try:
        rows = store.read(functools.partial(admin.safety_net_messages, roles=roles))
    finally:
        store.close()
    out = [{"id": r["id"], "safety_net": "Primary" if r["role"] == "primary" else "Shadow",
            "network_message_id": r["network_message_id"], "message_id": r["message_id"], "from": r["sender"],
            "primary": r["primary_node"] or cfg.node.name, "received_at": iso(r["received_at"]),
            "processed_at": iso(r["completed_at"]), "held_until": iso(r["safety_net_until"])} for r in rows]
    if as_json:
        emit_json(out)
        return
    click.echo(table(["id", "safety net", "from", "message-id", "primary", "received", "held until"],
                     [(r["id"], r["safety_net"], r["from"] or "<>", r["message_id"], r["primary"], r["received_at"],
                       r["held_until"]) for r in out]))


@safetynet_group.command("resubmit")
@node_options
@click.option("--destination", required=True,
              help="a mailbox database (MDB01), or the queue of a peer of the boundary (peer:NODE); never a "
                   "next hop outside the boundary")
@click.option("--start", required=True, help="window start (ISO 8601)")
@click.option("--end", default=None, help="window end (ISO 8601; default now)")
@click.option("--from", "source", type=click.Choice(["primary", "shadow", "both"]), default="both",
              show_default=True, help="which Safety Net of this node to resubmit from")
@click.option("--for-primary", "for_primary", default=None, metavar="NODE",
              help="on a shadow node: resubmit the Shadow Safety Net copies of NODE (and this node's Primary "
                   "Safety Net copies for DESTINATION), NODE having been unreachable longer than "
                   "safety_net.primary_safety_net_unreachable_time")
@click.option("--force", is_flag=True, help="with --for-primary: even if NODE answered recently")
def safetynet_resubmit(cfg: Config, destination: str, start: str, end: str | None, source: str,
                       for_primary: str | None, force: bool) -> None:
    """Queue again what this node's Safety Net holds for DESTINATION in a time window."""
    from transportd.queue.safetynet import database_created_at, known_destinations, outside_boundary
    if outside_boundary(destination):
        raise click.BadParameter(
            f"{destination} is a next hop outside the boundary: Safety Net never resubmits what crossed it "
            f"(its recipients would see the message twice, as in Exchange); name a mailbox database or a "
            f"peer's queue", param_hint="--destination")
    known = known_destinations(cfg)
    if destination not in known:
        raise click.BadParameter(
            f"{destination} is no mailbox database or peer queue this node knows (known: "
            f"{', '.join(sorted(known))})", param_hint="--destination")
    if for_primary:
        _resubmit_for_unreachable_primary(cfg, destination, start, end, for_primary.lower(), force)
        return
    s = parse_when(start, "--start").timestamp()
    e = parse_when(end, "--end").timestamp() if end else time.time()
    if e < s:
        raise click.BadParameter("the window ends before it starts", param_hint="--end")
    sources = ("primary", "shadow") if source == "both" else (source,)
    store = open_store(cfg)
    try:
        trk = tracking_log_for(cfg, store)
        done, failures = resubmit_in_turns(cfg, store, trk, destination=destination, start=s, end=e, sources=sources)
        created = store.read(database_created_at)
    finally:
        store.close()
    click.echo(f"{len(done)} message(s) resubmitted to {destination} from this node's Safety Net")
    report_resubmit_failures(failures)
    if created > s and "primary" in sources:
        gap_end = min(created, e)
        if not cfg.peers:
            click.echo(f"note: this queue database was created at {fmt_time(created)} UTC; nothing here covers "
                       f"the window before that, and no peers are configured to ask", err=True)
        else:
            click.echo(f"this queue database was created at {fmt_time(created)} UTC: asking the peers' "
                       f"Safety Nets for {fmt_time(s)} - {fmt_time(gap_end)} UTC")
            for peer, answer in ask_peers_to_resubmit(cfg, destination, s, gap_end):
                click.echo(f"  {peer}: {printable(answer)}")


def _resubmit_for_unreachable_primary(cfg: Config, destination: str, start: str, end: str | None,
                                      primary: str, force: bool) -> None:
    from transportd.queue.shadows import shadow_context
    s = parse_when(start, "--start").timestamp()
    e = parse_when(end, "--end").timestamp() if end else time.time()
    limit = cfg.safety_net.primary_safety_net_unreachable_time
    store = open_store(cfg)
    try:
        ctx = store.read(functools.partial(shadow_context, primary=primary))
        last = ctx["last_heartbeat_at"] if ctx else None
        if not force and ctx is None:
            raise CliError(f"this node holds nothing of {primary} (never polled it): nothing to resubmit")
        if not force and last is not None and time.time() - last < limit:
            store.transaction(functools.partial(admin.file_resubmit_request, primary=primary, destination=destination,
                                                start=s, end=e, now=time.time()))
            click.echo(f"{primary} answered a heartbeat at {fmt_time(last)} UTC, within "
                       f"{config_mod.format_duration(limit)}: ask it (transportd safetynet resubmit on {primary}). "
                       f"The request is filed: the running node resubmits it from its Shadow Safety Net on its own "
                       f"once {primary} has been unreachable for {config_mod.format_duration(limit)} "
                       f"(--force does it now)")
            return
        trk = tracking_log_for(cfg, store)
        done, failures = resubmit_in_turns(cfg, store, trk, destination=destination, start=s, end=e,
                                           sources=("primary", "shadow"), for_primary=primary)
    finally:
        store.close()
    click.echo(f"{len(done)} message(s) resubmitted to {destination} for {primary} from this node's Safety Net "
               f"(its shadows here, and what this node processed for {destination})")
    report_resubmit_failures(failures)


# Copies resubmitted per transaction, at most (fewer when they take longer than ~0.15 s).
RESUBMIT_BATCH = 500


def resubmit_in_turns(cfg: Config, store: Any, trk: Any, **window: Any) -> tuple[list, list]:
    """Resubmit the copies of ``window`` (``resubmit``'s arguments), their RESUBMIT rows written
    (and ``trk`` closed); returns (the copies resubmitted, the failures). Which copies is read
    first, without their bodies and outside any write transaction; then the chosen ones are
    resubmitted in short transactions in turn with the node's writer (queue/bulk.py): one
    transaction over the whole Safety Net held a running node's 250s for seconds, even when it
    resubmitted nothing. An error stops it after the transactions committed so far, said with
    their count (their RESUBMIT rows are written)."""
    from transportd.queue.safetynet import resubmit, resubmit_candidates
    ids = store.read(functools.partial(resubmit_candidates, cfg=cfg, **window))
    now, done, failures = time.time(), [], []

    def change(conn: Any, chunk: Any) -> list:
        return resubmit(conn, cfg, now=now, failures=failures, among=chunk, **window)
    try:
        for part in bulk.in_turns(store, ids, change, max_batch=RESUBMIT_BATCH, step=1):
            done += part
            log_resubmits(trk, part, window["destination"])  # after each commit
    except Exception as exc:  # noqa: BLE001 - the transactions committed so far stay; say how far it got
        raise CliError(f"{len(done)} message(s) resubmitted to {window['destination']}, then: "
                       f"{exc.__class__.__name__}: {exc}") from None
    finally:
        if trk is not None:
            trk.close()
    return done, failures


def report_resubmit_failures(failures: list) -> None:
    """Each Safety Net copy that could not be resubmitted (the others were), on stderr."""
    for row, exc in failures:
        click.echo(f"message {row['id']} (network id {row['network_message_id']}) could not be resubmitted: "
                   f"{exc.__class__.__name__}: {printable(exc)}", err=True)


def log_resubmits(trk: Any, done: list, destination: str) -> None:
    """RESUBMIT rows (source SAFETYNET) for copies queued again."""
    if trk is None:
        return
    for r in done:
        trk.write("RESUBMIT", "SAFETYNET", internal_message_id=r.new_id, network_message_id=r.network_message_id,
                  message_id=r.message_id, sender_address=r.author or r.sender, return_path=return_path(r.sender),
                  message_subject=r.subject, total_bytes=r.size, recipients=r.recipients,
                  reference=str(r.original_id), source_context=f"{destination};MessageResubmit")


def ask_peers_to_resubmit(cfg: Config, destination: str, start: float, end: float) -> list[tuple[str, str]]:
    """XRESUBMIT to every peer's transport connector, through the redundancy layer's peer sessions."""
    import asyncio

    from transportd.redundancy.peers import ask_resubmit
    from transportd.redundancy.protocol import Peer

    peers = [Peer(p.name, p.site, p.transport) for p in cfg.peers]

    async def run() -> list[str]:
        return list(await asyncio.gather(*(ask_resubmit(cfg, p, destination, start, end) for p in peers)))
    return list(zip((p.name for p in peers), asyncio.run(run())))
