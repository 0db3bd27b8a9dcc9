"""What every command group shares: node options, config loading, opening the store, output helpers.

It owns the CLI's error types (one line on stderr: exit 1, or 2 for a bad config or
argument), ``--config``/``--data-dir``/``--json`` (after a command or before it, and
TRANSPORTD_CONFIG through click's envvar) and how they become a Config, opening the
queue database for a command, tables, JSON lines and time formatting, and the
tracking log a command writes ADMIN rows to. It defines no command and never
touches the queue database's tables: queries are queue-layer functions.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import click

from transportd import config as config_mod
from transportd.config import Config, ConfigError
from transportd.queue.admin import recorded_config_path, recorded_node_name
from transportd.queue.store import QueueStore, StoreError, snapshot_refusal


class CliError(click.ClickException):
    exit_code = 1

    def show(self, file: Any = None) -> None:
        click.echo(f"transportd: error: {self.message}", err=True)


class ConfigCliError(CliError):
    exit_code = 2


CONFIG_ENVVAR = "TRANSPORTD_CONFIG"


def load_config(config: str | None, data_dir: str | None) -> Config:
    """The Config of ``--config`` (with ``--data-dir`` overriding its data_dir) or of ``--data-dir``
    alone; ConfigCliError (exit 2) when neither is given or the file is bad."""
    try:
        if config:
            cfg = config_mod.load(config)
            if data_dir:
                cfg = cfg.with_overrides({"node": {"data_dir": str(Path(data_dir).resolve())}})
            return cfg
        if data_dir:
            return config_for_data_dir(data_dir)
    except ConfigError as exc:
        raise ConfigCliError(str(exc)) from None
    raise ConfigCliError(f"give --config FILE or --data-dir DIR (or set {CONFIG_ENVVAR})")


def config_for_data_dir(data_dir: str) -> Config:
    """For --data-dir alone: the config file the node's daemon last ran with (recorded in the
    queue database), so routing (NDRs) and the tracking path match the node; else defaults."""
    cfg = config_mod.default_for_data_dir(data_dir)
    recorded = recorded_config_path(cfg.db_path)
    if not recorded or not Path(recorded).is_file():
        return cfg
    try:
        return config_mod.load(recorded).with_overrides({"node": {"data_dir": str(Path(data_dir).resolve())}})
    except ConfigError:
        return cfg


@dataclass(frozen=True)
class RootOptions:
    """``--config``, ``--data-dir`` and ``--json`` given before the command (``transportd -c FILE
    queue list``); ``config_from_env``: the config came from TRANSPORTD_CONFIG, not the line."""
    config: str | None = None
    data_dir: str | None = None
    as_json: bool = False
    config_from_env: bool = False


def _config_option(**kw: Any) -> Callable:
    return click.option("--config", "-c", "config", type=click.Path(dir_okay=False), default=None,
                        help=f"node config file (TOML; or {CONFIG_ENVVAR})", **kw)


def data_dir_option() -> Callable:
    return click.option("--data-dir", "-d", "data_dir", type=click.Path(file_okay=False), default=None,
                        help="node data directory (instead of --config)")


def root_options(fn: Callable) -> Callable:
    """The root group's node options: they apply to every command after them, where the same
    option given after the command wins. TRANSPORTD_CONFIG is read here, through click's envvar."""
    @_config_option(envvar=CONFIG_ENVVAR, show_envvar=True)
    @data_dir_option()
    @click.option("--json", "as_json", is_flag=True, help="JSON lines, for every command that prints a table")
    @click.pass_context
    @functools.wraps(fn)
    def wrapper(ctx: click.Context, *args: Any, config: str | None, data_dir: str | None, as_json: bool,
                **kwargs: Any) -> Any:
        from click.core import ParameterSource
        ctx.obj = RootOptions(config, data_dir, as_json,
                              ctx.get_parameter_source("config") == ParameterSource.ENVIRONMENT)
        return fn(*args, **kwargs)
    return wrapper


def root() -> RootOptions:
    ctx = click.get_current_context(silent=True)
    obj = ctx.find_root().obj if ctx is not None else None
    return obj if isinstance(obj, RootOptions) else RootOptions()


def node_location(config: str | None, data_dir: str | None) -> tuple[str | None, str | None]:
    """The config file and data dir a command runs on: its own options, else those given before
    it, else TRANSPORTD_CONFIG (unless a --data-dir was given: that node's own config is used)."""
    top = root()
    data_dir = data_dir or top.data_dir
    if config is None and top.config is not None and not (top.config_from_env and data_dir):
        config = top.config
    return config, data_dir


def node_options(fn: Callable) -> Callable:
    @_config_option()
    @data_dir_option()
    @functools.wraps(fn)
    def wrapper(*args: Any, config: str | None, data_dir: str | None, **kwargs: Any) -> Any:
        cfg = load_config(*node_location(config, data_dir))
        return fn(cfg, *args, **kwargs)
    return wrapper


def json_option(help: str = "JSON lines") -> Callable:
    """``--json`` after the command, or before it (``transportd --json queue list``)."""
    def decorate(fn: Callable) -> Callable:
        @click.option("--json", "as_json", is_flag=True, help=help)
        @functools.wraps(fn)
        def wrapper(*args: Any, as_json: bool, **kwargs: Any) -> Any:
            return fn(*args, as_json=as_json or root().as_json, **kwargs)
        return wrapper
    return decorate


def open_store(cfg: Config, *, read_only: bool = False) -> QueueStore:
    """The node's queue database. ``read_only`` (listings): where it cannot be opened as usual
    because nothing beside it can be written (disk full, read-only mount or folder), a stopped
    node's database is read as it stands on disk, with a warning."""
    if not cfg.db_path.exists():
        raise CliError(f"no queue database at {cfg.db_path} (wrong --data-dir, or the node never ran)")
    try:
        return QueueStore.open(cfg.db_path, create=False, repair=False)
    except StoreError as exc:
        text = str(exc)
        problem = f"queue database {text}" if text.startswith(str(cfg.db_path)) else \
            f"queue database {cfg.db_path}: {text}"
        if not read_only or "cannot be used" not in text:
            raise CliError(problem) from None
    from transportd.node import datalock
    if datalock.holder(cfg.data_dir) is not None:
        raise CliError(f"{problem}; its node is running") from None
    refusal = snapshot_refusal(cfg.db_path)
    if refusal:
        raise CliError(f"{problem}; {refusal}") from None
    try:
        store = QueueStore.open_snapshot(cfg.db_path)
    except StoreError as exc:
        raise CliError(f"{problem}; reading it as it stands failed too: {exc}") from None
    click.echo(f"transportd: warning: {problem}; the node is stopped: read as it stands on disk "
               "(nothing written)", err=True)
    return store


# What a terminal must never be sent raw from the mail: a control character (C0, DEL, C1: an ESC
# sequence in a Subject clears the screen or moves the cursor, a CR or backspace hides what came
# before it, a BEL rings) and a lone surrogate (an octet of a sender's that was no UTF-8, kept as
# such: no terminal encoding can write it).
_NOT_TO_TERMINAL = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
# ... and what JSON leaves as it is within a string (it escapes C0 itself).
_NOT_TO_TERMINAL_IN_JSON = re.compile(r"[\x7f-\x9f\ud800-\udfff]")


def _escaped(m: re.Match) -> str:
    ch = m.group()
    if 0xDC80 <= ord(ch) <= 0xDCFF:  # surrogateescape: the octet that was no UTF-8
        return f"\\x{ord(ch) - 0xDC00:02x}"
    return ascii(ch)[1:-1]  # \x1b, \n, \t, \x9b, \ud800


def printable(value: Any) -> str:
    """A value as text for the operator's terminal: every control character shown as its Python
    escape (an ESC as ``\\x1b``, a line feed as ``\\n``), so a Subject, an address, a reply or a
    header a sender controls is still readable and cannot act on the terminal. ``--json`` keeps
    the exact value (json_line)."""
    text = "" if value is None else str(value)
    return _NOT_TO_TERMINAL.sub(_escaped, text) if _NOT_TO_TERMINAL.search(text) else text


def json_line(obj: Any) -> str:
    """One JSON value on one line, its strings exact: JSON escapes the C0 controls; DEL, the C1
    controls (a terminal may read U+009B as the CSI that starts an escape sequence) and lone
    surrogates are written as ``\\u`` escapes too, which every JSON reader reads back as they were."""
    text = json.dumps(obj, default=json_default, ensure_ascii=False)
    return _NOT_TO_TERMINAL_IN_JSON.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def json_default(o: Any) -> Any:
    if isinstance(o, bytes):
        return o.decode("utf-8", "replace")
    if isinstance(o, datetime):
        return o.isoformat()
    return str(o)


def emit_json(rows: Iterable[dict]) -> None:
    for r in rows:
        click.echo(json_line(r))


def fmt_time(ts: float | None) -> str:
    if not ts:
        return ""
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def iso(ts: float | None) -> str | None:
    if not ts:
        return None
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def parse_when(value: str | None, name: str) -> datetime | None:
    if value is None:
        return None
    from transportd.tracking import parse_datetime
    try:
        return parse_datetime(value)
    except ValueError:
        raise click.BadParameter(f"expected an ISO time like 2026-11-22T10:00:00Z, got {value!r}",
                                 param_hint=name) from None


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], max_width: int = 60,
          wrap: Sequence[str] = ()) -> str:
    """Rows under their headers, each value on the terminal as ``printable`` shows it and cut at
    ``max_width``; a column named in ``wrap`` (a reply, a tracking row's status: the cause is at
    its end) is never cut: its value goes on over the next lines of the row, ``max_width`` at a time."""
    cells = [[_wrapped(printable(v), max_width) if h in wrap else [printable(v)[:max_width]]
              for h, v in zip(headers, r)] for r in rows]
    widths = [max([len(h)] + [len(line) for r in cells for line in r[i]]) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(),
           "  ".join("-" * w for w in widths)]
    for r in cells:
        out += ["  ".join((c[n] if n < len(c) else "").ljust(w) for c, w in zip(r, widths)).rstrip()
                for n in range(max(len(c) for c in r))]
    return "\n".join(out)


def _wrapped(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width``, broken at the last blank that fits (a word longer
    than a line where the line ends): nothing of it is left out but the blanks a line ends on."""
    lines = []
    while len(text) > width:
        cut = text.rfind(" ", 1, width + 1)
        cut = width if cut < 0 else cut + 1
        lines.append(text[:cut].rstrip(" ") or text[:cut])
        text = text[cut:]
    return lines + [text]


def tracking_log_for(cfg: Config, store: QueueStore):
    from transportd.tracking import TrackingLog
    if not cfg.tracking.message_tracking_log_enabled:
        return None
    node_name = store.read(recorded_node_name) or cfg.node.name
    return TrackingLog(cfg.tracking_dir, node_name, max_file_size=cfg.tracking.message_tracking_log_max_file_size,
                       fields=config_mod.tracking_fields(cfg),
                       subject_logging=cfg.tracking.message_tracking_log_subject_logging_enabled)


def admin_event(trk: Any, event_id: str, row: dict, context: str, **fields: Any) -> None:
    """One MSGTRK row (source ADMIN) about a message an operator acted on."""
    from transportd.tracking import return_path, sender_address
    trk.write(event_id, "ADMIN", internal_message_id=row["id"], message_id=row["message_id"],
              network_message_id=row["network_message_id"], sender_address=sender_address(row),
              return_path=return_path(row.get("sender")),
              message_subject=row["subject"], total_bytes=row["size"], source_context=context, **fields)
