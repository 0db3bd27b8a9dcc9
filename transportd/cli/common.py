"""What every command group shares: node options, config loading, opening the store, output helpers.

It owns the CLI's error types (one line on stderr: exit 1, or 2 for a bad config or
argument), ``--config``/``--data-dir`` and how they become a Config, opening the
queue database for a command, tables, JSON lines and time formatting, and the
tracking log a command writes ADMIN rows to. It defines no command and never
touches the queue database's tables: queries are queue-layer functions.
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import click

from transportd import config as config_mod
from transportd.config import Config, ConfigError
from transportd.queue.admin import recorded_config_path, recorded_node_name
from transportd.queue.store import QueueStore, StoreError


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
                cfg = cfg.with_overrides({"node": {"data_dir": str(Path(data_dir).resolve())}})
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
    recorded = recorded_config_path(cfg.db_path)
    if not recorded or not Path(recorded).is_file():
        return cfg
    try:
        return config_mod.load(recorded).with_overrides({"node": {"data_dir": str(Path(data_dir).resolve())}})
    except ConfigError:
        return cfg


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


def parse_when(value: str | None, name: str) -> datetime | None:
    if value is None:
        return None
    from transportd.tracking import parse_datetime
    try:
        return parse_datetime(value)
    except ValueError:
        raise click.BadParameter(f"expected an ISO time like 2026-11-22T10:00:00Z, got {value!r}",
                                 param_hint=name) from None


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
    node_name = store.read(recorded_node_name) or cfg.node.name
    return TrackingLog(cfg.tracking_dir, node_name, max_file_size=cfg.tracking.message_tracking_log_max_file_size)


def admin_event(trk: Any, event_id: str, row: dict, context: str, **fields: Any) -> None:
    """One MSGTRK row (source ADMIN) about a message an operator acted on."""
    trk.write(event_id, "ADMIN", internal_message_id=row["id"], message_id=row["message_id"],
              network_message_id=row["network_message_id"], sender_address=row["sender"],
              message_subject=row["subject"], total_bytes=row["size"], source_context=context, **fields)
