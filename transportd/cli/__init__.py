"""The ``transportd`` command line: serve, config, queue, message, tracking.

Read commands open the queue database directly (read-only use), so they work
whether the daemon runs or not; operator actions are small durable
transactions on the same database, which a running daemon picks up at its next
scan (``delivery.queue_poll_interval``, 0.5 s by default). Tables by default,
JSON lines with ``--json``. A bad config or argument is one line on stderr and
exit code 2; a missing or unreadable queue database is one line and exit 1.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import click

from transportd import __version__
from transportd import config as config_mod
from transportd.queue import messages as mq
from transportd.config import Config, ConfigError
from transportd.queue.store import QueueStore, StoreError, meta


class CliError(click.ClickException):
    exit_code = 1

    def show(self, file: Any = None) -> None:
        click.echo(f"transportd: error: {self.message}", err=True)


class ConfigCliError(CliError):
    exit_code = 2


def load_config(config: str | None, data_dir: str | None) -> Config:
    try:
        if config:
            cfg = config_mod.load(config)
            if data_dir:
                cfg.node.data_dir = str(Path(data_dir).resolve())
            return cfg
        if data_dir:
            return config_for_data_dir(data_dir)
    except ConfigError as exc:
        raise ConfigCliError(str(exc)) from None
    env = os.environ.get("TRANSPORTD_CONFIG")
    if env:
        return load_config(env, None)
    raise ConfigCliError("give --config FILE or --data-dir DIR (or set TRANSPORTD_CONFIG)")


def config_for_data_dir(data_dir: str) -> Config:
    """For --data-dir alone: the config file the node's daemon last ran with (recorded in the
    queue database), so routing (NDRs) and the tracking path match the node; else defaults."""
    cfg = config_mod.default_for_data_dir(data_dir)
    recorded = None
    if cfg.db_path.is_file():
        import sqlite3
        try:
            con = sqlite3.connect(f"file:{cfg.db_path}?mode=ro", uri=True, timeout=5)
            try:
                row = con.execute("SELECT value FROM meta WHERE key = 'config_path'").fetchone()
            finally:
                con.close()
            recorded = row[0] if row else None
        except sqlite3.Error:
            recorded = None
    if not recorded or not Path(recorded).is_file():
        return cfg
    try:
        node_cfg = config_mod.load(recorded)
    except ConfigError:
        return cfg
    node_cfg.node.data_dir = str(Path(data_dir).resolve())
    return node_cfg


def node_options(fn: Callable) -> Callable:
    @click.option("--config", "-c", "config", type=click.Path(dir_okay=False), default=None,
                  help="node config file (TOML)")
    @click.option("--data-dir", "-d", "data_dir", type=click.Path(file_okay=False), default=None,
                  help="node data directory (instead of --config)")
    @functools.wraps(fn)
    def wrapper(*args: Any, config: str | None, data_dir: str | None, **kwargs: Any) -> Any:
        cfg = load_config(config, data_dir)
        return fn(cfg, *args, **kwargs)
    return wrapper


def open_store(cfg: Config) -> QueueStore:
    if not cfg.db_path.exists():
        raise CliError(f"no queue database at {cfg.db_path} (wrong --data-dir, or the node never ran)")
    try:
        return QueueStore.open(cfg.db_path, create=False, repair=False)
    except StoreError as exc:
        raise CliError(f"queue database {cfg.db_path}: {exc}") from None


def json_default(o: Any) -> Any:
    if isinstance(o, bytes):
        return o.decode("utf-8", "replace")
    if isinstance(o, datetime):
        return o.isoformat()
    return str(o)


def emit_json(rows: Iterable[dict]) -> None:
    for r in rows:
        click.echo(json.dumps(r, default=json_default, ensure_ascii=False))


def fmt_time(ts: float | None) -> str:
    if not ts:
        return ""
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def iso(ts: float | None) -> str | None:
    if not ts:
        return None
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], max_width: int = 60) -> str:
    cells = [[("" if v is None else str(v))[:max_width] for v in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(out)


def tracking_log_for(cfg: Config, store: QueueStore):
    from transportd.tracking import TrackingLog
    if not cfg.tracking.message_tracking_log_enabled:
        return None
    name = store.read(lambda c: c.execute(
        meta.select().where(meta.c.key == "node_name")).mappings().first())
    node_name = (name["value"] if name and name["value"] else cfg.node.name)
    return TrackingLog(cfg.tracking_dir, node_name, max_file_size=cfg.tracking.message_tracking_log_max_file_size)


# ---------------------------------------------------------------------------- root

@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="transportd")
def cli() -> None:
    """transportd: an SMTP transport daemon that never loses an acknowledged message."""


@cli.command()
@click.option("--config", "-c", "config", type=click.Path(dir_okay=False), required=True,
              help="node config file (TOML)")
@click.option("--log-format", type=click.Choice(["text", "json"]), default=None,
              help="operational log format (overrides node.log_format)")
def serve(config: str, log_format: str | None) -> None:
    """Run a node: frontend receive connector, queues and delivery."""
    from transportd.node.daemon import serve as run, setup_logging
    cfg = load_config(config, None)
    setup_logging(cfg.node.log_level, log_format or cfg.node.log_format)
    sys.exit(run(cfg))


@cli.command()
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
    try:
        asyncio.run(run_sink(host, port, Path(directory).resolve(), smtputf8=smtputf8, eightbitmime=eightbitmime))
    except OSError as exc:
        raise CliError(f"sink cannot listen on {listen}: {exc.strerror or exc}") from None


# ---------------------------------------------------------------------------- config

@cli.group("config")
def config_group() -> None:
    """Inspect configuration."""


@config_group.command("reference")
def config_reference() -> None:
    """Print the configuration reference as a Markdown table (as in the README)."""
    click.echo(config_mod.markdown_reference())


@config_group.command("show")
@node_options
@click.option("--json", "as_json", is_flag=True, help="JSON lines")
def config_show(cfg: Config, as_json: bool) -> None:
    """Print every key's effective value, with its Exchange name and meaning."""
    rows = []
    for key, value in cfg.effective():
        rows.append({"key": key.dotted, "value": config_mod.format_value(key, value),
                     "exchange_name": key.exchange, "meaning": key.meaning})
    if as_json:
        emit_json(rows)
        return
    click.echo(f"# {cfg.path or 'defaults'}; data dir {cfg.data_dir}")
    click.echo(table(["key", "value", "exchange name", "meaning"],
                     [(r["key"], r["value"], r["exchange_name"], r["meaning"]) for r in rows], max_width=90))


# ---------------------------------------------------------------------------- queue

@cli.group("queue")
def queue_group() -> None:
    """Delivery queues (like Exchange's Get-Queue, Retry-Queue, Suspend-Queue, Resume-Queue)."""


def queue_rows(cfg: Config) -> list[dict]:
    store = open_store(cfg)
    try:
        now = time.time()
        rows = store.read(lambda c: mq.list_queues(c, now))
        for r in rows:
            r["next_retry_at"] = iso(r["next_retry_at"])
        return rows
    finally:
        store.close()


def render_queues(rows: list[dict]) -> str:
    return table(["identity", "delivery type", "state", "messages", "next retry", "last error"],
                 [(r["identity"], r["delivery_type"], r["state"], r["message_count"],
                   r["next_retry_at"] or "", r["last_error"]) for r in rows], max_width=70)


@queue_group.command("list")
@node_options
@click.option("--json", "as_json", is_flag=True, help="JSON lines")
@click.option("--watch", "watch", is_flag=True, help="refresh in place until Ctrl-C")
@click.option("--interval", type=float, default=1.0, show_default=True, help="--watch refresh seconds")
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
            out = "\n".join(json.dumps(r, default=json_default) for r in rows) if as_json else render_queues(rows)
            click.echo("\x1b[H\x1b[2J" + f"transportd queue list  {fmt_time(time.time())} UTC  (Ctrl-C stops)\n\n"
                       + out, nl=True)
            time.sleep(max(0.1, interval))
    except KeyboardInterrupt:
        pass


def queue_action(cfg: Config, name: str, action: Callable[[Any, int], Any]) -> dict:
    store = open_store(cfg)
    try:
        def job(conn):
            q = mq.resolve_queue(conn, name)
            if q is None:
                return None
            action(conn, q["id"])
            return q
        q = store.transaction(job)
    finally:
        store.close()
    if q is None:
        raise CliError(f"no queue {name!r} (see 'transportd queue list')")
    return q


@queue_group.command("suspend")
@node_options
@click.argument("queue")
def queue_suspend(cfg: Config, queue: str) -> None:
    """Stop delivery from a queue (messages stay queued)."""
    q = queue_action(cfg, queue, lambda c, qid: mq.set_queue_suspended(c, qid, True))
    click.echo(f"queue {q['identity']} suspended")


@queue_group.command("resume")
@node_options
@click.argument("queue")
def queue_resume(cfg: Config, queue: str) -> None:
    """Resume delivery from a suspended queue."""
    q = queue_action(cfg, queue, lambda c, qid: mq.set_queue_suspended(c, qid, False))
    click.echo(f"queue {q['identity']} resumed")


@queue_group.command("retry")
@node_options
@click.argument("queue")
def queue_retry(cfg: Config, queue: str) -> None:
    """Retry a queue now, ignoring its back-off."""
    q = queue_action(cfg, queue, mq.retry_queue_now)
    click.echo(f"queue {q['identity']} will be retried now")


# ---------------------------------------------------------------------------- message

@cli.group("message")
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
        def job(conn):
            qid = None
            if queue is not None and queue.lower() == mq.POISON.lower():
                return mq.list_messages(conn, mq.POISON, include_done=include_done)
            if queue is not None:
                q = mq.resolve_queue(conn, queue)
                if q is None:
                    return None
                qid = q["id"]
            return mq.list_messages(conn, qid, include_done=include_done)
        rows = store.read(job)
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
        m = store.read(lambda c: mq.message_detail(c, message_id))
        body = store.read(lambda c: mq.body(c, message_id)) if m else None
    finally:
        store.close()
    if m is None:
        raise CliError(f"no message {message_id} in {cfg.db_path}")
    m["body"] = body
    return m


@message_group.command("show")
@node_options
@click.argument("message_id", type=int)
@click.option("--json", "as_json", is_flag=True, help="one JSON object")
def message_show(cfg: Config, message_id: int, as_json: bool) -> None:
    """Envelope, headers, per-recipient status and tracking events of one message."""
    from transportd.smtp.server import split_headers
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


def message_action(cfg: Config, message_id: int, fn: Callable[[Any], Any]) -> Any:
    store = open_store(cfg)
    try:
        return store.transaction(fn)
    finally:
        store.close()


@message_group.command("suspend")
@node_options
@click.argument("message_id", type=int)
def message_suspend(cfg: Config, message_id: int) -> None:
    """Hold a message: no delivery attempts until resumed."""
    if not message_action(cfg, message_id, lambda c: mq.set_message_suspended(c, message_id, True)):
        raise CliError(f"no queued message {message_id}")
    click.echo(f"message {message_id} suspended")


@message_group.command("resume")
@node_options
@click.argument("message_id", type=int)
def message_resume(cfg: Config, message_id: int) -> None:
    """Release a suspended message, or one held in the Poison queue (its failure count is reset)."""
    def job(conn):
        row = mq.message_row(conn, message_id)
        released = mq.release_from_poison(conn, message_id)
        resumed = mq.set_message_suspended(conn, message_id, False)
        return row, released, resumed or released
    row, released, ok = message_action(cfg, message_id, job)
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


def admin_event(trk: Any, event_id: str, row: dict, context: str, **fields: Any) -> None:
    """One MSGTRK row (source ADMIN) about a message an operator acted on."""
    trk.write(event_id, "ADMIN", internal_message_id=row["id"], message_id=row["message_id"],
              network_message_id=row["network_message_id"], sender_address=row["sender"],
              message_subject=row["subject"], total_bytes=row["size"], source_context=context, **fields)


@message_group.command("remove")
@node_options
@click.argument("message_id", type=int)
@click.option("--ndr", is_flag=True, help="send a non-delivery report to the sender")
def message_remove(cfg: Config, message_id: int, ndr: bool) -> None:
    """Remove a message from the queues (logged as DROP), optionally with an NDR."""
    from transportd.node.delivery import dsn_message
    from transportd.smtp.dsn import RecipientReport
    store = open_store(cfg)
    reply = "550 5.2.0 Message deleted by an administrator"
    now = time.time()
    try:
        def job(conn):
            row = mq.message_row(conn, message_id)
            if row is None or row["state"] != mq.QUEUED:
                return None
            body = mq.body(conn, message_id)
            removed = mq.remove_message(conn, message_id, now)
            created = None
            if ndr and body is not None and removed:
                dsn = dsn_message(cfg, row, body, [RecipientReport(r["address"], "failed", "5.2.0", reply)
                                                   for r in removed], now)
                if dsn is not None:
                    created = (mq.enqueue(conn, dsn), dsn)
            return row, removed, created
        result = store.transaction(job)
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


@cli.command("redirect")
@node_options
@click.option("--target", required=True, help="the peer (FQDN) that takes over this node's queued messages")
def redirect(cfg: Config, target: str) -> None:
    """Drain this node's queues to a peer before maintenance (Exchange's Redirect-Message).

    Every queued message goes to the peer hop by hop with XSHADOW: the peer becomes primary and
    this node keeps a shadow until the peer's discard. A running daemon starts within a second;
    a stopped one at its next start.
    """
    target = target.strip().lower()
    if target not in {p.name for p in cfg.peers}:
        known = ", ".join(p.name for p in cfg.peers) or "none configured"
        raise ConfigCliError(f"--target: {target} is not a peer of {cfg.node.name} (peers: {known})")
    store = open_store(cfg)
    try:
        moved = store.transaction(lambda c: mq.redirect_to_peer(c, target, time.time()))
        held = store.read(mq.held_messages)
        trk = tracking_log_for(cfg, store)
    finally:
        store.close()
    if trk is not None:
        try:
            for row in moved:
                admin_event(trk, "REDIRECT", row, f"transportd redirect --target {target}")
        finally:
            trk.close()
    click.echo(f"{len(moved)} message(s) redirected to {target} (queue peer:{target})")
    if held:
        click.echo(f"{held} suspended or poison message(s) stay here, held: resume them and redirect again "
                   f"to move them")


@cli.group("safetynet")
def safetynet_group() -> None:
    """Safety Net: copies kept after processing, for resubmission (Exchange's Safety Net)."""


@safetynet_group.command("list")
@node_options
@click.option("--from", "source", type=click.Choice(["primary", "shadow", "both"]), default="both",
              show_default=True, help="which Safety Net")
@click.option("--json", "as_json", is_flag=True, help="JSON lines")
def safetynet_list(cfg: Config, source: str, as_json: bool) -> None:
    """Messages held in this node's Primary and Shadow Safety Net, with their hold time."""
    from sqlalchemy import select
    from transportd.queue.store import messages
    roles = ("primary", "shadow") if source == "both" else (source,)
    store = open_store(cfg)
    try:
        rows = store.read(lambda c: [dict(r) for r in c.execute(
            select(messages).where(messages.c.state == mq.SAFETY_NET, messages.c.role.in_(roles))
            .order_by(messages.c.id)).mappings()])
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
              help="a mailbox database (MDB01) or a queue identity (smarthost:127.0.0.1:2500)")
@click.option("--start", required=True, help="window start (ISO 8601)")
@click.option("--end", default=None, help="window end (ISO 8601; default now)")
@click.option("--from", "source", type=click.Choice(["primary", "shadow", "both"]), default="both",
              show_default=True, help="which Safety Net of this node to resubmit from")
@click.option("--for-primary", "for_primary", default=None, metavar="NODE",
              help="on a shadow node: resubmit the Shadow Safety Net copies of NODE, which has been "
                   "unreachable longer than safety_net.primary_safety_net_unreachable_time")
@click.option("--force", is_flag=True, help="with --for-primary: even if NODE answered recently")
def safetynet_resubmit(cfg: Config, destination: str, start: str, end: str | None, source: str,
                       for_primary: str | None, force: bool) -> None:
    """Queue again what this node's Safety Net holds for DESTINATION in a time window."""
    from transportd.queue.safetynet import database_created_at, resubmit
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
        failures: list = []
        done = store.transaction(lambda c: resubmit(c, cfg, destination=destination, start=s, end=e, sources=sources,
                                                    failures=failures))
        created = store.read(database_created_at)
        trk = tracking_log_for(cfg, store)
    finally:
        store.close()
    log_resubmits(trk, done, destination)
    click.echo(f"{len(done)} message(s) resubmitted to {destination} from this node's Safety Net")
    report_resubmit_failures(failures)
    if created > s and "primary" in sources:
        gap_end = min(created, e)
        if not cfg.peers:
            click.echo(f"note: this queue database was created at {fmt_time(created)} UTC; nothing here covers "
                       f"the window before that, and no peers are configured to ask", err=True)
        else:
            click.echo(f"this queue database was created at {fmt_time(created)} UTC: asking the peers' Shadow "
                       f"Safety Nets for {fmt_time(s)} - {fmt_time(gap_end)} UTC")
            for peer, answer in ask_peers_to_resubmit(cfg, destination, s, gap_end):
                click.echo(f"  {peer}: {answer}")


def _resubmit_for_unreachable_primary(cfg: Config, destination: str, start: str, end: str | None,
                                      primary: str, force: bool) -> None:
    from sqlalchemy import select
    from transportd.queue.safetynet import resubmit
    from transportd.queue.store import shadow_contexts
    s = parse_when(start, "--start").timestamp()
    e = parse_when(end, "--end").timestamp() if end else time.time()
    limit = cfg.safety_net.primary_safety_net_unreachable_time
    store = open_store(cfg)
    try:
        ctx = store.read(lambda c: c.execute(select(shadow_contexts).where(
            shadow_contexts.c.peer == primary)).mappings().first())
        last = ctx["last_heartbeat_at"] if ctx else None
        if not force and ctx is None:
            raise CliError(f"this node holds nothing of {primary} (never polled it): nothing to resubmit")
        if not force and last is not None and time.time() - last < limit:
            from transportd.queue.store import resubmit_requests
            store.transaction(lambda c: c.execute(resubmit_requests.insert().values(
                for_primary=primary, destination=destination, start_at=s, end_at=e, created_at=time.time())))
            click.echo(f"{primary} answered a heartbeat at {fmt_time(last)} UTC, within "
                       f"{config_mod.format_duration(limit)}: ask it (transportd safetynet resubmit on {primary}). "
                       f"The request is filed: the running node resubmits it from its Shadow Safety Net on its own "
                       f"once {primary} has been unreachable for {config_mod.format_duration(limit)} "
                       f"(--force does it now)")
            return
        failures: list = []
        done = store.transaction(lambda c: resubmit(c, cfg, destination=destination, start=s, end=e,
                                                    sources=("shadow",), for_primary=primary, failures=failures))
        trk = tracking_log_for(cfg, store)
    finally:
        store.close()
    log_resubmits(trk, done, destination)
    click.echo(f"{len(done)} message(s) of {primary} resubmitted to {destination} from this node's Shadow Safety Net")
    report_resubmit_failures(failures)


def report_resubmit_failures(failures: list) -> None:
    """Each Safety Net copy that could not be resubmitted (the others were), on stderr."""
    for row, exc in failures:
        click.echo(f"message {row['id']} (network id {row['network_message_id']}) could not be resubmitted: "
                   f"{exc.__class__.__name__}: {exc}", err=True)


def log_resubmits(trk: Any, done: list, destination: str) -> None:
    """RESUBMIT rows (source SAFETYNET) for copies queued again; closes the tracking log."""
    if trk is None:
        return
    try:
        for r in done:
            trk.write("RESUBMIT", "SAFETYNET", internal_message_id=r.new_id, network_message_id=r.network_message_id,
                      recipients=r.recipients, reference=str(r.original_id),
                      source_context=f"{destination};MessageResubmit")
    finally:
        trk.close()


def ask_peers_to_resubmit(cfg: Config, destination: str, start: float, end: float) -> list[tuple[str, str]]:
    """XRESUBMIT to every peer's transport connector (authenticated with the cluster secret)."""
    import asyncio
    import aiosmtplib

    async def one(peer) -> tuple[str, str]:
        host, _, port = peer.transport.rpartition(":")
        client = aiosmtplib.SMTP(hostname=host, port=int(port), local_hostname=cfg.node.name, timeout=30,
                                 **config_mod.peer_tls_options(cfg))
        try:
            await client.connect()
            await client.ehlo()
            await client.auth_plain(cfg.node.name.lower(), cfg.cluster.secret)
            resp = await client.execute_command(b"XRESUBMIT", destination.encode("utf-8"),
                                                f"{start:.3f}".encode(), f"{end:.3f}".encode())
            return peer.name, f"{resp.code} {resp.message}"
        except (aiosmtplib.SMTPException, OSError, asyncio.TimeoutError) as exc:
            return peer.name, f"unreachable: {exc or exc.__class__.__name__}"
        finally:
            client.close()

    async def run() -> list[tuple[str, str]]:
        return list(await asyncio.gather(*(one(p) for p in cfg.peers)))
    return asyncio.run(run())


# ---------------------------------------------------------------------------- shadow

@cli.group("shadow")
def shadow_group() -> None:
    """Shadow queues this node holds for its primaries (Shadow Redundancy Manager)."""


def shadow_rows(cfg: Config) -> list[dict]:
    from sqlalchemy import func, select
    from transportd.queue.store import messages, shadow_contexts
    store = open_store(cfg)
    try:
        def q(conn):
            held = dict(conn.execute(select(messages.c.primary_node, func.count()).where(
                messages.c.role == "shadow", messages.c.state == mq.QUEUED).group_by(messages.c.primary_node)).all())
            safety = dict(conn.execute(select(messages.c.primary_node, func.count()).where(
                messages.c.role == "shadow", messages.c.state == mq.SAFETY_NET).group_by(messages.c.primary_node)).all())
            ctx = {r["peer"]: dict(r) for r in conn.execute(select(shadow_contexts)).mappings()}
            out = []
            for primary in sorted(set(held) | set(safety) | set(ctx)):
                c = ctx.get(primary, {})
                out.append({"primary": primary, "shadows": held.get(primary, 0),
                            "shadow_safety_net": safety.get(primary, 0),
                            "last_heartbeat_at": iso(c.get("last_heartbeat_at")),
                            "consecutive_failures": c.get("consecutive_failures", 0),
                            "queue_database_id": c.get("queue_database_id"),
                            "last_error": c.get("last_error") or ""})
            return out
        return store.read(q)
    finally:
        store.close()


@shadow_group.command("list")
@node_options
@click.option("--json", "as_json", is_flag=True, help="JSON lines")
def shadow_list(cfg: Config, as_json: bool) -> None:
    """Per primary: shadows held, last successful heartbeat, consecutive failures, recorded DB ID."""
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
@click.option("--json", "as_json", is_flag=True, help="JSON lines")
def shadow_show(cfg: Config, primary: str, include_done: bool, as_json: bool) -> None:
    """The shadow copies held for one primary."""
    from sqlalchemy import select
    from transportd.queue.store import messages
    store = open_store(cfg)
    try:
        def q(conn):
            stmt = select(messages).where(messages.c.role == "shadow",
                                          messages.c.primary_node == primary.lower()).order_by(messages.c.id)
            if not include_done:
                stmt = stmt.where(messages.c.state == mq.QUEUED)
            return [dict(r) for r in conn.execute(stmt).mappings()]
        rows = store.read(q)
    finally:
        store.close()
    out = [{"id": r["id"], "network_message_id": r["network_message_id"], "shadow_guid": r["shadow_guid"],
            "message_id": r["message_id"], "from": r["sender"], "size": r["size"],
            "received_at": iso(r["received_at"]), "state": "Shadow" if r["state"] == mq.QUEUED else r["state"]}
           for r in rows]
    if as_json:
        emit_json(out)
        return
    click.echo(table(["id", "shadow guid", "from", "size", "received", "state"],
                     [(r["id"], r["shadow_guid"], r["from"] or "<>", r["size"], r["received_at"], r["state"])
                      for r in out]))


# ---------------------------------------------------------------------------- cluster

@cli.group("cluster")
def cluster_group() -> None:
    """A local multi-node cluster on loopback (127.0.0.x addresses)."""


def _cluster_options(fn: Callable) -> Callable:
    options = [
        click.option("--nodes", default=3, show_default=True, type=click.IntRange(1, 200)),
        click.option("--sites", default=2, show_default=True, type=click.IntRange(1, 200)),
        click.option("--ip-base", default=11, show_default=True, type=click.IntRange(2, 254),
                     help="node N listens on 127.0.0.(ip-base + N - 1)"),
        click.option("--frontend-port", default=2525, show_default=True, type=click.IntRange(1, 65535)),
        click.option("--transport-port", default=2526, show_default=True, type=click.IntRange(1, 65535)),
        click.option("--sink", "sink_address", default="127.0.0.10:2500", show_default=True,
                     help="address of the external sink (outside the boundary)"),
        click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
                     help="a config value for every node, e.g. --set shadow_redundancy.shadow_heartbeat_frequency=2"),
    ]
    for opt in reversed(options):
        fn = opt(fn)
    return fn


def _generate(directory: Path, nodes: int, sites: int, ip_base: int, frontend_port: int, transport_port: int,
              sink_address: str, overrides: tuple[str, ...], secret: str | None = None):
    from transportd.devtools.cluster import generate, parse_overrides
    if sites > nodes:
        raise click.BadParameter(f"{sites} sites need at least {sites} nodes", param_hint="--sites")
    try:
        host, _ = config_mod.parse_hostport(sink_address)
        extra = parse_overrides(overrides)
        specs = generate(directory, nodes=nodes, sites=sites, ip_base=ip_base, frontend_port=frontend_port,
                         transport_port=transport_port, sink_address=sink_address, overrides=extra,
                         secret=secret)
    except ValueError as exc:
        raise ConfigCliError(str(exc)) from None
    if not host.startswith("127."):
        raise ConfigCliError("--sink: the local cluster stays on loopback (127.0.0.0/8)")
    for spec in specs:
        load_config(spec.config, None)  # a bad --set fails here, naming the key
    return specs


@cluster_group.command("config")
@click.option("--out", "out", type=click.Path(file_okay=False), required=True, help="folder for the node configs")
@_cluster_options
def cluster_config(out: str, nodes: int, sites: int, ip_base: int, frontend_port: int, transport_port: int,
                   sink_address: str, overrides: tuple[str, ...]) -> None:
    """Write the node configs of a local cluster without starting it."""
    specs = _generate(Path(out), nodes, sites, ip_base, frontend_port, transport_port, sink_address, overrides)
    for s in specs:
        click.echo(f"{s.config}  {s.name}  {s.site}  frontend {s.frontend}  transport {s.transport}")


@cluster_group.command("up")
@click.option("--data-dir", "data_dir", type=click.Path(file_okay=False), default="./data/cluster",
              show_default=True, help="folder for configs, node data, the sink and cluster.json")
@_cluster_options
def cluster_up(data_dir: str, nodes: int, sites: int, ip_base: int, frontend_port: int, transport_port: int,
               sink_address: str, overrides: tuple[str, ...]) -> None:
    """Start the cluster in the foreground (Ctrl-C or SIGTERM stops every process)."""
    from transportd.devtools.cluster import Cluster
    directory = Path(data_dir).resolve()
    secret = None
    old = directory / "node1.toml"
    if old.exists():  # keep the secret of an existing cluster so its data dirs stay usable
        import tomllib
        try:
            secret = tomllib.loads(old.read_text()).get("cluster", {}).get("secret")
        except (tomllib.TOMLDecodeError, OSError):
            secret = None
    specs = _generate(directory, nodes, sites, ip_base, frontend_port, transport_port, sink_address,
                      overrides, secret=secret)
    cluster = Cluster(directory, specs, sink_address)
    cluster.start()
    first = specs[0]
    host, _, port = first.frontend.rpartition(":")
    click.echo(f"[cluster] {len(specs)} nodes in {sites} site(s), sink on {sink_address} "
               f"storing mail in {directory / 'sink' / 'new'}; cluster.json in {directory}")
    click.echo(f"[cluster] try: swaks --server {host}:{port} --to someone@elsewhere.test  "
               f"(or --to alice@example.test for a local mailbox)")
    click.echo(f"[cluster]      transportd shadow list --config {specs[-1].config}   "
               "(the shadows it holds for its peers)")
    sys.exit(cluster.wait())


@cluster_group.command("status")
@click.option("--data-dir", "data_dir", type=click.Path(file_okay=False), default="./data/cluster",
              show_default=True)
@click.option("--json", "as_json", is_flag=True, help="JSON lines")
def cluster_status(data_dir: str, as_json: bool) -> None:
    """Each node alive or not, with its queue and shadow counts."""
    import socket as socket_mod
    from transportd.devtools.cluster import load_cluster_json, pid_alive
    try:
        doc = load_cluster_json(Path(data_dir).resolve())
    except FileNotFoundError as exc:
        raise CliError(str(exc)) from None
    rows = []
    for n in doc["nodes"]:
        host, _, port = n["frontend"].rpartition(":")
        listening = False
        try:
            with socket_mod.create_connection((host, int(port)), timeout=0.5):
                listening = True
        except OSError:
            pass
        queued = shadows = None
        cfg = load_config(n["config"], None)
        if cfg.db_path.exists():
            try:
                queued = sum(q["message_count"] for q in queue_rows(cfg))
                shadows = sum(r["shadows"] for r in shadow_rows(cfg))
            except CliError:
                pass
        rows.append({"name": n["name"], "site": n["site"], "frontend": n["frontend"], "transport": n["transport"],
                     "pid": n.get("pid"), "alive": pid_alive(n.get("pid")) and listening,
                     "queued": queued, "shadows": shadows})
    if as_json:
        emit_json(rows)
        return
    click.echo(table(["node", "site", "frontend", "transport", "pid", "alive", "queued", "shadows held"],
                     [(r["name"], r["site"], r["frontend"], r["transport"], r["pid"], "yes" if r["alive"] else "NO",
                       r["queued"], r["shadows"]) for r in rows]))


# ---------------------------------------------------------------------------- tracking

def parse_when(value: str | None, name: str) -> datetime | None:
    if value is None:
        return None
    from transportd.tracking import parse_datetime
    try:
        return parse_datetime(value)
    except ValueError:
        raise click.BadParameter(f"expected an ISO time like 2026-11-22T10:00:00Z, got {value!r}",
                                 param_hint=name) from None


@cli.group("tracking")
def tracking_group() -> None:
    """Message tracking logs (like Get-MessageTrackingLog)."""


@tracking_group.command("search")
@node_options
@click.option("--message-id", default=None, help="Message-ID header (with or without <>)")
@click.option("--network-message-id", default=None)
@click.option("--internal-message-id", default=None)
@click.option("--sender", default=None)
@click.option("--recipient", default=None)
@click.option("--event-id", default=None, help="RECEIVE, DELIVER, SENDEXTERNAL, DEFER, FAIL, DSN, ...")
@click.option("--start", default=None, help="from this time (ISO 8601, UTC by default)")
@click.option("--end", default=None, help="up to this time (ISO 8601)")
@click.option("--json", "as_json", is_flag=True, help="JSON lines")
def tracking_search(cfg: Config, message_id: str | None, network_message_id: str | None,
                    internal_message_id: str | None, sender: str | None, recipient: str | None,
                    event_id: str | None, start: str | None, end: str | None, as_json: bool) -> None:
    """Search this node's MSGTRK files."""
    from transportd.tracking import search
    s, e = parse_when(start, "--start"), parse_when(end, "--end")
    if not cfg.tracking_dir.is_dir():
        raise CliError(f"no tracking logs at {cfg.tracking_dir}")
    rows = search(cfg.tracking_dir, message_id=message_id, network_message_id=network_message_id,
                  internal_message_id=internal_message_id, sender=sender, recipient=recipient,
                  event_id=event_id, start=s, end=e)
    if as_json:
        emit_json(rows)
        return
    rows = list(rows)
    click.echo(table(["date-time", "event", "source", "internal id", "sender", "recipients", "message-id",
                      "status / context"],
                     [(r["date-time"], r["event-id"], r["source"], r["internal-message-id"], r["sender-address"],
                       r["recipient-address"], r["message-id"], r["recipient-status"] or r["source-context"])
                      for r in rows], max_width=48))


# ---------------------------------------------------------------------------- health

def smtp_greets(address: str, timeout: float) -> str | None:
    """None when ``host:port`` answers with an SMTP 220 greeting, else what went wrong."""
    import socket as socket_mod
    try:
        host, port = config_mod.parse_hostport(address)
        with socket_mod.create_connection((host.strip("[]"), port), timeout=timeout) as s:
            s.settimeout(timeout)
            greeting = s.recv(512)
            s.sendall(b"QUIT\r\n")
    except ValueError as exc:
        return str(exc)
    except OSError as exc:
        return exc.strerror or str(exc) or exc.__class__.__name__
    return None if greeting.startswith(b"220") else f"answered {greeting[:60]!r}"


@cli.command("health")
@click.option("--config", "-c", "config", type=click.Path(dir_okay=False), default=None,
              help="node config file (TOML; or TRANSPORTD_CONFIG)")
@click.option("--server", "servers", multiple=True, metavar="HOST:PORT",
              help="check this SMTP listener instead of the node's (repeatable)")
@click.option("--timeout", type=float, default=5.0, show_default=True, help="seconds per listener")
def health(config: str | None, servers: tuple[str, ...], timeout: float) -> None:
    """Exit 0 when the node's frontend and transport connectors (or each --server) greet with 220.

    The container healthcheck: ``transportd health`` in a node, ``transportd health --server
    sink:2500`` for the sink.
    """
    if not servers:
        cfg = load_config(config, None)
        servers = tuple(a for a in (cfg.frontend.listen, cfg.transport.listen) if a)
    bad = [(a, why) for a in servers if (why := smtp_greets(a, timeout)) is not None]
    for address, why in bad:
        click.echo(f"transportd: unhealthy: {address}: {why}", err=True)
    if bad:
        sys.exit(1)
    click.echo("healthy: " + ", ".join(servers))
# ---------------------------------------------------------------------------- chaos (issue 6)

@cli.command("chaos")
@click.option("--messages", default=300, show_default=True, type=click.IntRange(1, 1_000_000))
@click.option("--faults", default=6, show_default=True, type=click.IntRange(0, 10_000))
@click.option("--seed", default=None, type=int, help="fault schedule seed (printed; default: random)")
@click.option("--no-shadow", is_flag=True, help="control run: shadow_redundancy_enabled = false")
@click.option("--expect-loss", is_flag=True, help="exit 0 only if lost > 0 (for the control run)")
@click.option("--clients", default=6, show_default=True, type=click.IntRange(1, 200))
@click.option("--rate", default=None, type=click.FloatRange(0.1, 10_000),
              help="messages per second in all (default: spread over the fault schedule)")
@click.option("--ip-base", default=101, show_default=True, type=click.IntRange(3, 250),
              help="node N listens on 127.0.0.(ip-base + N - 1), the sink on ip-base - 1")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="run folder (configs, node data, logs); default: a new temporary folder")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None,
              help="write the summary as JSON here")
@click.option("--drain-timeout", default=120.0, show_default=True, type=click.FloatRange(1, 3600))
def chaos(messages: int, faults: int, seed: int | None, no_shadow: bool, expect_loss: bool, clients: int,
          rate: float | None, ip_base: int, directory: str | None, json_out: str | None,
          drain_timeout: float) -> None:
    """Fault injection on a local 3-node cluster with a total-queue check (docs/reliability.md).

    Exit 0 when lost = 0, unexpected = 0 and no mailbox duplicates (with --expect-loss: when lost > 0
    and unexpected = 0), 1 otherwise."""
    import json
    import random
    import tempfile
    from transportd.devtools.chaos.harness import format_summary, run
    import signal

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through run(): its cluster and proxy are stopped
    signal.signal(signal.SIGTERM, stop)
    if seed is None:
        seed = random.SystemRandom().randrange(1, 2**31)
    folder = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="transportd-chaos-"))
    summary = run(messages=messages, faults=faults, seed=seed, shadow=not no_shadow, directory=folder.resolve(),
                  clients=clients, ip_base=ip_base, rate=rate, drain_timeout=drain_timeout,
                  say=lambda m: click.echo(m))
    click.echo(format_summary(summary))
    if json_out:
        Path(json_out).write_text(json.dumps(summary, indent=2))
    if expect_loss:
        good = summary.get("lost", 0) > 0 and summary.get("unexpected", 1) == 0
        click.echo(f"control run: {'lost > 0 as expected' if good else 'expected lost > 0: checker did not fail'}")
    else:
        good = bool(summary.get("ok"))
    sys.exit(0 if good else 1)


def _show_usage_error(self: click.UsageError, file: Any = None) -> None:
    """Bad CLI arguments: one line on stderr (exit code 2), like a bad config."""
    where = self.ctx.command_path if self.ctx is not None else "transportd"
    click.echo(f"transportd: error: {self.format_message()} (see '{where} --help')", err=True)
# ---------------------------------------------------------------------------- analyze (Spark)


class DefaultCommandGroup(click.Group):
    """A group whose first argument, when it is not a sub-command, goes to ``default_command``."""

    default_command = "run"

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)


@cli.group("analyze", cls=DefaultCommandGroup)
def analyze_group() -> None:
    """Spark analytics over the MSGTRK logs of many nodes (`analyze PATHS... --out DIR`).

    See docs/analytics.md. pyspark is needed (pip install -e '.[analytics]').
    """


@analyze_group.command("run")
@click.argument("paths", nargs=-1, required=True)
@click.option("--out", "out", required=True, help="output folder (any path Spark writes: local, hdfs://, s3a://)")
@click.option("--master", default=None, help="Spark master URL (default: spark-submit's, else local[*])")
@click.option("--recursive", is_flag=True, help="read folders recursively")
@click.option("--name-filter", default=None, help="file-name glob inside folders (default MSGTRK*, any case)")
@click.option("--grace", type=float, default=600.0, show_default=True,
              help="seconds after delivery before a shadow never discarded is an anomaly")
@click.option("--episode-gap", type=float, default=60.0, show_default=True,
              help="promotions further apart (seconds) are separate failover episodes")
@click.option("--conf", "confs", multiple=True, metavar="KEY=VALUE", help="extra Spark configuration")
@click.option("--no-progress", is_flag=True, help="no progress display on stderr")
@click.option("--json", "as_json", is_flag=True, help="print summary.json instead of the table")
def analyze_run(paths: tuple[str, ...], out: str, master: str | None, recursive: bool, name_filter: str | None,
                grace: float, episode_gap: float, confs: tuple[str, ...], no_progress: bool, as_json: bool) -> None:
    """Analyze MSGTRK files, folders or globs; write messages/, anomalies/, summary.json, report.html."""
    try:
        from transportd.analytics import job
    except ImportError as exc:
        raise CliError(f"pyspark is not installed ({exc}); pip install -e '.[analytics]'") from None
    conf = {}
    for item in confs:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--conf")
        conf[key.strip()] = value
    if grace < 0 or episode_gap <= 0:
        raise click.BadParameter("must be positive", param_hint="--grace/--episode-gap")
    try:
        job.check_local_paths(paths)
    except job.AnalyzeError as exc:
        raise ConfigCliError(str(exc)) from None
    spark = job.spark_session(master, conf=conf)
    try:
        summary = job.analyze(spark, list(paths), out, name_filter=name_filter or job.DEFAULT_NAME_FILTER,
                              recursive=recursive, grace_seconds=grace, episode_gap=episode_gap,
                              progress=not no_progress)
    except job.AnalyzeError as exc:
        raise ConfigCliError(str(exc)) from None
    finally:
        spark.stop()
    if as_json:
        click.echo(json.dumps(summary, indent=2, default=str))
    else:
        click.echo(job.console_table(summary))
        click.echo(f"\nreport: {out.rstrip('/')}/report.html")


@analyze_group.command("generate")
@click.option("--messages", type=click.IntRange(1), required=True, help="messages to simulate")
@click.option("--nodes", type=click.IntRange(2, 200), default=3, show_default=True)
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), help="folder for <node>/msgtrk/ and truth.json")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--deaths", type=click.IntRange(0), default=None, help="nodes that die (default 1, 0 with 2 nodes)")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=None,
              help="messages per second (default 50, lower for small runs)")
@click.option("--redirect-fail-rate", type=click.FloatRange(0, 1), default=0.02, show_default=True)
@click.option("--defer-rate", type=click.FloatRange(0, 1), default=0.05, show_default=True)
@click.option("--fail-rate", type=click.FloatRange(0, 1), default=0.005, show_default=True)
@click.option("--lost-discard-rate", type=click.FloatRange(0, 1), default=0.001, show_default=True)
@click.option("--malformed", type=click.IntRange(0), default=10, show_default=True, help="malformed rows to inject")
def analyze_generate(messages: int, nodes: int, out: str, seed: int, deaths: int | None, rate: float | None,
                     redirect_fail_rate: float, defer_rate: float, fail_rate: float, lost_discard_rate: float,
                     malformed: int) -> None:
    """Write realistic multi-node MSGTRK logs with injected failures, and truth.json beside them."""
    from transportd.analytics.generate import generate
    started = time.monotonic()
    try:
        truth = generate(out, messages, nodes, seed, deaths=(1 if nodes > 2 else 0) if deaths is None else deaths,
                         rate=rate, redirect_fail_rate=redirect_fail_rate, defer_rate=defer_rate,
                         fail_rate=fail_rate, lost_discard_rate=lost_discard_rate, malformed=malformed)
    except ValueError as exc:
        raise ConfigCliError(str(exc)) from None
    click.echo(f"wrote {truth['rows']} rows for {truth['messages']} messages on {nodes} nodes to {out} "
               f"in {time.monotonic() - started:.1f}s; truth: {Path(out) / 'truth.json'}")


def main() -> None:
    click.UsageError.show = _show_usage_error  # the real CLI only; CliRunner tests keep click's text
    try:
        cli.main(standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
