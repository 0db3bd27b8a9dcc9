"""``transportd message``: queued messages (like Get-Message, Export-Message, Suspend-Message,
Resume-Message, Remove-Message).

It owns listing, showing (envelope, headers, per-recipient status and tracking events) and
exporting messages (the queued bytes, as Export-Message writes them), suspending, resuming (also out of the Poison queue) and removing
them (optionally with an NDR): one, the ids given (``-``: on stdin) or those ``--filter``
selects, a batch per transaction, with ``--dry-run``, and the ADMIN and DSN tracking
rows those actions write after each commit. It never writes SQL: each read and each
batch is one queue-layer function run in ``QueueStore.read`` or ``QueueStore.transaction``.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import click

from transportd.cli.common import (CliError, ConfigCliError, admin_event, emit_json, iso, json_line, json_option,
                                   node_options, open_store, printable, table, tracking_log_for)
from transportd.config import Config
from transportd.errors import FilterError
from transportd.queue import admin, bulk
from transportd.queue import messages as mq
from transportd.queue.selection import Selection, parse_terms


@click.group("message")
def message_group() -> None:
    """Messages in the queues (like Get-Message, Suspend-Message, Resume-Message, Remove-Message)."""


def selection_options(fn: Callable) -> Callable:
    """IDS (numbers, ``-`` for ids on stdin, ``ALL``) and repeatable ``--filter`` terms (AND)."""
    @click.argument("ids", nargs=-1, metavar="[ID...|-|ALL]")
    @click.option("--filter", "filters", multiple=True, metavar="FIELD=VALUE",
                  help="select by sender, recipient, subject (patterns with * and ?), queue, state, age, "
                       "received or size (age>1h, received>2026-11-28T10:00Z, size>=1MB); repeat for AND; "
                       "see docs/operations.md")
    @functools.wraps(fn)
    def wrapper(*args: Any, ids: tuple[str, ...], filters: tuple[str, ...], **kwargs: Any) -> Any:
        return fn(*args, selection=parse_selection(ids, filters), **kwargs)
    return wrapper



# Internal message ids are SQLite integers (at most 2**63 - 1): a larger number names no message.
MAX_MESSAGE_ID = 2**63 - 1
MESSAGE_ID = click.IntRange(0, MAX_MESSAGE_ID)


def parse_selection(words: Sequence[str], filters: Sequence[str]) -> Selection:
    """The selection of the command line; a bad id or term is one line and exit 2, nothing done."""
    try:
        terms = parse_terms(filters)
    except FilterError as exc:
        raise ConfigCliError(str(exc)) from None
    ids: list[int] = []
    given = everything = False
    for word in words:
        if word.upper() == "ALL":
            everything = True
            continue
        given = True
        for token in (read_stdin_ids() if word == "-" else [word]):
            if not (token.isascii() and token.isdigit()):
                raise ConfigCliError(f"message id {token!r}{' (on stdin)' if word == '-' else ''}: not a number")
            if int(token) > MAX_MESSAGE_ID:
                raise ConfigCliError(f"message id {token}: no message has so large an id (at most {MAX_MESSAGE_ID})")
            ids.append(int(token))
    if everything and given:
        raise ConfigCliError("give message ids or ALL, not both")
    return Selection(terms=terms, ids=tuple(dict.fromkeys(ids)) if given else None, everything=everything)


def read_stdin_ids() -> list[str]:
    """Ids on stdin (``postsuper -d -``): numbers separated by white space, or the JSON lines of
    ``message list --json`` (their ``id``)."""
    out = []
    for line in click.get_text_stream("stdin").read().splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(str(json.loads(line)["id"]))
            except (ValueError, KeyError, TypeError):
                out.append(line[:40])
        else:
            out += line.split()
    return out


def list_rows(cfg: Config, queue: str | None, include_done: bool, selection: Selection,
              limit: int | None) -> list[dict]:
    store = open_store(cfg, read_only=True)
    try:
        rows = store.read(functools.partial(admin.messages_in_queue, queue=queue, include_done=include_done,
                                            selection=selection, now=time.time(), limit=limit))
    finally:
        store.close()
    if rows is None:
        raise CliError(f"no queue {queue!r} (see 'transportd queue list')")
    return rows


def print_rows(rows: list[dict], as_json: bool, **extra: Any) -> None:
    for r in rows:
        for k in ("received_at", "expires_at", "next_retry_at"):
            r[k] = iso(r[k])
        r.update(extra)
    if as_json:
        emit_json(rows)
        return
    click.echo(table(["id", "from", "subject", "size", "status", "queue", "received", "last error"],
                     [(r["id"], r["from"] or "<>", r["subject"], r["size"], r["status"], ",".join(r["queues"]),
                       r["received_at"], r["last_error"]) for r in rows], max_width=50, wrap=["last error"]))


@message_group.command("list")
@node_options
@selection_options
@click.option("--queue", "queue", default=None,
              help="only messages in this queue (identity or id; 'Poison' for the Poison queue)")
@click.option("--all", "include_done", is_flag=True, help="include Safety Net copies, and removed messages not yet purged (a running node purges them within seconds)")
@click.option("--limit", type=click.IntRange(0), default=1000, show_default=True, help="at most this many; 0: all")
@json_option()
def message_list(cfg: Config, selection: Selection, queue: str | None, include_done: bool, limit: int,
                 as_json: bool) -> None:
    """List queued messages (all, the ids given, or those --filter selects)."""
    rows = list_rows(cfg, queue, include_done, selection, limit + 1 if limit else None)
    more = bool(limit) and len(rows) > limit
    rows = rows[:limit] if limit else rows
    missing = [] if selection.ids is None or selection.terms or queue or more else \
        sorted(set(selection.ids) - {r["id"] for r in rows})
    if not rows and not selection.empty and not selection.everything and not missing:
        say(f"no message matches {selection.describe()}", as_json)
        return
    print_rows(rows, as_json)
    if more:
        click.echo(f"transportd: only the first {limit} message(s) are listed (--limit; --limit 0 lists all)",
                   err=True)
    if missing:
        shown = ", ".join(str(i) for i in missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10
                                                           else "")
        raise CliError(f"no {'' if include_done else 'queued '}message {shown}")


def say(text: str, as_json: bool) -> None:
    """A summary line: on stdout, or on stderr where stdout holds JSON lines."""
    click.echo(text, err=as_json)


def get_message(cfg: Config, message_id: int) -> dict:
    store = open_store(cfg, read_only=True)
    try:
        m = store.read(functools.partial(admin.message_with_body, message_id=message_id, now=time.time()))
    finally:
        store.close()
    if m is None:
        raise CliError(f"no message {message_id} in {cfg.db_path}")
    return m


@message_group.command("show")
@node_options
@click.argument("message_id", type=MESSAGE_ID)
@json_option("one JSON object")
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
        click.echo(json_line(m))
        return
    click.echo(f"Message {m['id']}  status {m['status']}  ({m['role']}, {m['state']})")
    for label, key in (("Network message id", "network_message_id"), ("Message-ID", "message_id"),
                       ("From", "sender"), ("Subject", "subject"), ("Size", "size"),
                       ("Received", "received_at"), ("Expires", "expires_at"), ("Client", "client_ip"),
                       ("Origin", "origin"), ("Redundancy", "redundancy"), ("DSN (RFC 3461)", "dsn_params")):
        click.echo(f"  {label + ':':20} {printable(m[key]) if m[key] not in (None, '') else '-'}")
    if m["status"] == mq.POISON:
        click.echo(f"  {'Held:':20} in the Poison queue after {m['poison_count']} internal failure(s): never "
                   f"retried until 'transportd message resume {m['id']}' (or remove)")
    elif m["status"] == mq.SUSPENDED:
        click.echo(f"  {'Held:':20} suspended by an operator: nothing is delivered until "
                   f"'transportd message resume {m['id']}'")
    click.echo("\nRecipients:")
    dsn = any(r["dsn_params"] for r in m["recipients"])  # NOTIFY= / ORCPT= as the sender gave them
    click.echo(table(["address", "queue", "status", "attempts", "next retry", "last error"] + ["dsn"] * dsn,
                     [(r["address"], *recipient_queue_and_status(m, r), r["attempts"],
                       r["next_retry_at"] if r["status"] == mq.RETRY and m["status"] not in (mq.POISON, mq.SUSPENDED)
                       else "",
                       r["last_error"] or "", *[r["dsn_params"]] * dsn)
                      for r in m["recipients"]], max_width=70, wrap=["last error"]))
    click.echo("\nHeaders:")
    # Lines end in CRLF (or LF): a bare CR or any other control character in a field is shown as an
    # escape; a folded field's continuation starts with a tab: shown as the blanks it stands for.
    click.echo("\n".join("  " + printable(line.expandtabs()) for line in re.split(r"\r?\n", headers)
                         if headers))
    click.echo("\nTracking events:")
    click.echo(table(["date-time", "event", "source", "recipients", "status / context"],
                     [(e["date-time"], e["event-id"], e["source"], e["recipient-address"],
                       e["recipient-status"] or e["source-context"]) for e in events], max_width=70,
                     wrap=["status / context"]))


def recipient_queue_and_status(m: dict, r: dict) -> tuple[str, str]:
    """A recipient's queue and status as ``message list`` shows its message: one still to be
    delivered of a message held in the Poison queue is there, Poison (as Get-Message's
    PoisonMessage), whatever its next hop's queue and the status it had when it was moved (the
    Ready of a crash, the Retry of an internal error): nothing delivers it until it is resumed.
    One waiting (Ready, Retry) of a message an operator suspended is Suspended, in its queue."""
    if m["status"] == mq.POISON and r["status"] not in mq.TERMINAL:
        return mq.POISON, mq.POISON
    if m["status"] == mq.SUSPENDED and r["status"] in mq.PENDING:  # held by an operator, in its queue
        return r["queue"], mq.SUSPENDED
    return r["queue"], r["status"]


@message_group.command("export")
@node_options
@click.argument("message_id", type=MESSAGE_ID)
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), default=None,
              help="file to write (default: standard output)")
@click.option("--envelope", is_flag=True,
              help="put X-Sender and X-Receiver header fields (the envelope, one per recipient still to "
                   "deliver) before the message, as Exchange's Export-Message does for its Replay directory")
def message_export(cfg: Config, message_id: int, output: str | None, envelope: bool) -> None:
    """Write one message as it is queued (RFC 5322 octets, with the header fields this node added)
    to a file or standard output (Export-Message, postcat -q). Reading it changes nothing."""
    import sys
    m = get_message(cfg, message_id)
    data = m["body"]
    if data is None:
        raise CliError(f"message {message_id} has no body left (its copy was released)")
    if envelope:
        pending = [r["address"] for r in m["recipients"] if r["status"] not in mq.TERMINAL] or \
            [r["address"] for r in m["recipients"]]
        head = [f"X-Sender: <{m['sender']}>"] + [f"X-Receiver: <{a}>" for a in pending]
        data = "".join(line + "\r\n" for line in head).encode("utf-8", "surrogateescape") + data
    if output is None:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return
    try:
        with open(output, "wb") as f:
            f.write(data)
    except OSError as exc:
        raise CliError(f"cannot write {output}: {exc.strerror or exc}") from None
    click.echo(f"message {message_id}: {len(data)} octets written to {output}", err=True)


# ------------------------------------------------------------------------------ actions on a selection
#
# One message (``message remove 12``) or many (ids, ``-``, ``ALL``, ``--filter``): the ids the
# selection matches are read first, then changed a batch per transaction by the queue layer's
# one-message action (so a removal tells the shadows as a single one does), with the tracking
# rows of each batch written after its commit and the count at the end.

def action_options(fn: Callable) -> Callable:
    @selection_options
    @click.option("--dry-run", "-n", "dry_run", is_flag=True, help="list what would change and change nothing")
    @click.option("--batch-size", type=click.IntRange(1, 100_000), default=500, show_default=True,
                  help="messages changed per transaction, at most (a transaction also ends after about "
                       "0.15 s of work, so a running node's writer gets its turn)")
    @json_option("one JSON line per message changed (the count on stderr)")
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)
    return wrapper


@dataclass
class Action:
    """What a bulk command does: its words, the queue-layer batch function, and what it writes
    after each batch's commit (tracking rows, JSON lines)."""
    verb: str        # "removed"
    infinitive: str  # "remove"
    batch: Callable[..., list]
    after_batch: Callable[[Any, list, bool], list[dict]]
    # why a selected message was left as it was (besides leaving the queue meanwhile)
    unchanged: str = ""


def batches(ids: Sequence[int], size: int) -> Iterator[Sequence[int]]:
    for start in range(0, len(ids), size):
        yield ids[start:start + size]


def run_action(cfg: Config, selection: Selection, action: Action, *, dry_run: bool, batch_size: int,
               as_json: bool) -> list[dict]:
    """Carry out ``action`` on ``selection``; returns the per-message results it reported."""
    if selection.empty:
        raise click.UsageError("give message ids, '-' (ids on stdin), ALL or --filter FIELD=VALUE")
    now = time.time()
    store = open_store(cfg)
    try:
        ids = store.read(functools.partial(admin.selected_ids, selection=selection, now=now))
        unknown = store.read(functools.partial(admin.unknown_ids, ids=selection.ids)) if selection.ids else []
        if unknown:
            refuse_shadow_copies(store.read(functools.partial(admin.shadow_copies_named, ids=unknown)), action)
        if dry_run:
            for chunk in batches(ids, batch_size):
                print_rows(store.read(functools.partial(admin.listed, ids=chunk)), as_json,
                           action=action.infinitive, dry_run=True)
            if ids:
                say(f"{len(ids)} message(s) would be {action.verb} (dry run: nothing changed)", as_json)
            return finish([], ids, unknown, selection, action, as_json, dry_run=True)
        trk = tracking_log_for(cfg, store)
        results: list[dict] = []
        transactions = 0
        try:
            # Short transactions in turn with the running node's writer (queue/bulk.py): at most
            # batch_size messages each, fewer when they take longer than about 0.15 s.
            def change(conn: Any, chunk: Sequence[int]) -> list:
                return action.batch(conn, ids=chunk, selection=selection, now=now)
            for changed in bulk.in_turns(store, ids, change, max_batch=batch_size):
                transactions += 1
                results += action.after_batch(trk, changed, as_json)
        except Exception as exc:  # noqa: BLE001 - the batches committed so far stay; say how far it got
            raise CliError(f"{len(results)} message(s) {action.verb} in {transactions} transaction(s), then: "
                           f"{exc.__class__.__name__}: {exc}") from None
        finally:
            if trk is not None:
                trk.close()
    finally:
        store.close()
    if results and not single(selection):
        say(f"{len(results)} message(s) {action.verb} in {transactions} transaction(s) "
            f"(batches of at most {batch_size})", as_json)
    return finish(results, ids, unknown, selection, action, as_json, dry_run=False)


def refuse_shadow_copies(shadows: dict[int, str], action: Action) -> None:
    """A named shadow copy stops the command before anything changes: its primary delivers the
    message and discards this copy, so removing it here would only drop the redundancy (and an NDR
    would tell the sender of a failure that did not happen)."""
    if shadows:
        mid, primary = next(iter(sorted(shadows.items())))
        more = f" (and {len(shadows) - 1} more shadow copies)" if len(shadows) > 1 else ""
        raise CliError(f"message {mid} is a shadow copy held for {primary}{more}: its primary delivers it "
                       f"and discards this copy; {action.infinitive} it on {primary} "
                       f"(see transportd shadow show {primary}); nothing {action.verb}")


def single(selection: Selection) -> bool:
    return selection.ids is not None and len(selection.ids) == 1 and not selection.terms


def finish(results: list[dict], ids: Sequence[int], unknown: Sequence[int], selection: Selection,
           action: Action, as_json: bool, dry_run: bool) -> list[dict]:
    if unknown:
        shown = ", ".join(str(i) for i in unknown[:10]) + (f" and {len(unknown) - 10} more" if len(unknown) > 10
                                                           else "")
        raise CliError(f"no queued message {shown}")
    if not ids:
        say(f"no queued message matches {selection.describe()} (nothing {action.verb})", as_json)
    elif not (results or dry_run):
        why = f"{action.unchanged} or " if action.unchanged else ""
        say(f"no message {action.verb}: the {len(ids)} selected {why}left the queue meanwhile", as_json)
    return results


def context(selection: Selection, infinitive: str) -> str:
    how = "" if selection.ids is not None and not selection.terms else f" --filter {selection.describe()}"
    return f"transportd message {infinitive}{how}"[:200]


def one_line(row: dict, action: str, **extra: Any) -> dict:
    return {"id": row["id"], "network_message_id": row["network_message_id"], "from": row["sender"],
            "subject": row["subject"], "action": action, **extra}


@message_group.command("suspend")
@node_options
@action_options
def message_suspend(cfg: Config, selection: Selection, dry_run: bool, batch_size: int, as_json: bool) -> None:
    """Hold messages (Suspend-Message, postsuper -h): no delivery attempts until resumed."""
    def after(trk: Any, rows: list[dict], as_json: bool) -> list[dict]:
        out = [one_line(r, "suspended") for r in rows]
        if as_json:
            emit_json(out)
        return out
    done = run_action(cfg, selection, Action("suspended", "suspend", admin.suspend_batch, after,
                                         "were already suspended"),
                      dry_run=dry_run, batch_size=batch_size, as_json=as_json)
    if done and single(selection) and not as_json:
        click.echo(f"message {done[0]['id']} suspended")
    warn_if_stopped(cfg, done, "suspended")


@message_group.command("resume")
@node_options
@action_options
def message_resume(cfg: Config, selection: Selection, dry_run: bool, batch_size: int, as_json: bool) -> None:
    """Release suspended messages, or ones held in the Poison queue (their failure count is reset)
    (Resume-Message, postsuper -H)."""
    def after(trk: Any, changed: list[tuple[dict, bool]], as_json: bool) -> list[dict]:
        out = []
        for row, released in changed:
            if released:
                log_poison_release(trk, row, "Resumed")
            out.append(one_line(row, "resumed", released_from_poison=released))
        if as_json:
            emit_json(out)
        return out
    done = run_action(cfg, selection, Action("resumed", "resume", admin.resume_batch, after,
                                         "were neither suspended nor in the Poison queue"),
                      dry_run=dry_run, batch_size=batch_size, as_json=as_json)
    if done and single(selection) and not as_json:
        r = done[0]
        click.echo(f"message {r['id']} resumed" + (" from the Poison queue" if r["released_from_poison"] else ""))


def log_poison_release(trk: Any, row: dict, how: str) -> None:
    """POISONMESSAGE (source ADMIN): an operator took a message out of the Poison queue."""
    if trk is not None:
        admin_event(trk, "POISONMESSAGE", row, f"{how} from the Poison queue by transportd message")


@message_group.command("remove")
@node_options
@action_options
@click.option("--ndr", is_flag=True, help="send a non-delivery report to each sender")
def message_remove(cfg: Config, selection: Selection, dry_run: bool, batch_size: int, as_json: bool,
                   ndr: bool) -> None:
    """Remove messages from the queues (Remove-Message, postsuper -d), logged as DROP and told to
    their shadows (DeletedByAdmin), optionally with an NDR."""
    from transportd.node.outcomes import dsn_message
    from transportd.smtp.dsn import RecipientReport
    reply = "550 5.2.0 Message deleted by an administrator"
    how = context(selection, "remove")

    def make_ndr(row: dict, body: bytes, removed: list[dict]) -> mq.NewMessage | None:
        return dsn_message(cfg, row, body, [RecipientReport(r["address"], "failed", "5.2.0", reply)
                                            for r in removed], time.time())

    def batch(conn: Any, ids: Sequence[int], selection: Selection, now: float) -> list:
        return admin.remove_batch(conn, ids, selection, now, make_ndr if ndr else None)

    def after(trk: Any, changed: list, as_json: bool) -> list[dict]:
        out = []
        for row, removed, created in changed:
            if trk is not None:
                log_removal(trk, row, removed, created, reply, how)
                if row.get("poisoned"):
                    log_poison_release(trk, row, "Removed")
            out.append(one_line(row, "removed", ndr=created is not None))
        if as_json:
            emit_json(out)
        return out
    done = run_action(cfg, selection, Action("removed", "remove", batch, after),
                      dry_run=dry_run, batch_size=batch_size, as_json=as_json)
    if done and single(selection) and not as_json:
        click.echo(f"message {done[0]['id']} removed" + (" (NDR queued to the sender)" if done[0]["ndr"] else ""))
    warn_if_stopped(cfg, done, "removed")


def warn_if_stopped(cfg: Config, done: list[dict], verb: str) -> None:
    """With the node stopped its peers hear of nothing: a shadow copy of a message removed or
    suspended here is still theirs to take over once the node has been silent for
    shadow_resubmit_time_span. Said on stderr, so the operator can start the node in time."""
    from transportd.config import format_duration
    from transportd.node import datalock
    sr = cfg.shadow_redundancy
    if not done or not (sr.shadow_redundancy_enabled and cfg.peers) or datalock.holder(cfg.data_dir) is not None:
        return
    click.echo(f"transportd: note: the node is not running: its peers learn that these messages were {verb} "
               f"when it starts; a peer holding a shadow copy takes it over and delivers it if the node "
               f"stays down longer than shadow_resubmit_time_span ({format_duration(sr.shadow_resubmit_time_span)})",
               err=True)


def log_removal(trk: Any, row: dict, removed: list[dict], created: tuple[int, Any] | None, reply: str,
                how: str) -> None:
    """DROP (source ADMIN) for a removed message, and DSN for its NDR."""
    admin_event(trk, "DROP", row, how, recipients=[r["address"] for r in removed],
                recipient_status=[reply] * len(removed))
    if created:
        dsn_id, dsn = created
        trk.write("DSN", "DSN", internal_message_id=dsn_id, message_id=dsn.message_id,
                  network_message_id=dsn.network_message_id, recipients=[row["sender"]],
                  reference=row["message_id"],
                  source_context=f"original internal id {row['id']}; network id {row['network_message_id']}")
