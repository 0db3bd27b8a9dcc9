"""Statements of the per-message path, run directly on the SQLite connection under SQLAlchemy's.

``Connection.execute`` of a prebuilt Core statement costs ~40 us of Python beside SQLite's own
2-5 us (its execution context, parameter processing and result wrapping; docs/performance.md),
and a shadowed message takes ~15 statements on its primary between its 250 and its Safety Net.
The statements of that path are written here from the tables' definitions and executed on the
driver connection of the same transaction (``conn.connection.driver_connection``): the same
BEGIN, the same job savepoint, the same commit; an error raises ``sqlite3.Error`` into the job as
SQLAlchemy's wrapped one did. Every other statement stays SQLAlchemy Core.

Only columns whose values SQLite stores as Python gives them belong here (Integer, Float,
String, Text, BLOB: SQLAlchemy has no processors for them on SQLite), and only scalar defaults.
"""

from __future__ import annotations

import sqlite3
from typing import Any, Iterable, Mapping, Sequence

from sqlalchemy import Table
from sqlalchemy.engine import Connection


def driver(conn: Connection) -> sqlite3.Connection:
    """The sqlite3 connection under ``conn``: statements on it join ``conn``'s transaction."""
    return conn.connection.driver_connection


def placeholders(n: int) -> str:
    """``?, ?, ...`` for an IN list of ``n`` values (n >= 1)."""
    return ", ".join("?" * n)


class Insert:
    """``INSERT INTO table`` of every column but an autoincremented key: a value left out of a row
    takes the column's default (``None`` where it has none; SQLite refuses that for NOT NULL)."""

    def __init__(self, table: Table):
        cols = [c for c in table.c if not (c.primary_key and c.autoincrement is True)]
        for c in cols:
            if c.default is not None and not c.default.is_scalar:
                raise ValueError(f"{table.name}.{c.name}: only scalar defaults are run directly")
        self.table = table.name
        self.columns = tuple(c.key for c in cols)
        self._known = frozenset(self.columns)
        self._defaults = {c.key: (c.default.arg if c.default is not None else None) for c in cols}
        self.sql = f"INSERT INTO {table.name} ({', '.join(c.name for c in cols)}) VALUES ({placeholders(len(cols))})"

    def values(self, row: Mapping[str, Any]) -> list[Any]:
        unknown = row.keys() - self._known
        if unknown:
            raise KeyError(f"{self.table} has no column {', '.join(sorted(unknown))}")
        return [row[k] if k in row else self._defaults[k] for k in self.columns]

    def run(self, conn: Connection, row: Mapping[str, Any]) -> int:
        """Insert one row; returns its rowid (the autoincremented key)."""
        return driver(conn).execute(self.sql, self.values(row)).lastrowid

    def run_many(self, conn: Connection, rows: Iterable[Mapping[str, Any]]) -> None:
        driver(conn).executemany(self.sql, [self.values(r) for r in rows])


class Update:
    """``UPDATE table SET <the columns given> WHERE <where>``; the SQL is made once per set of columns."""

    def __init__(self, table: Table, where: str = "id = ?"):
        self.table = table.name
        self.where = where
        self._known = frozenset(c.key for c in table.c)
        self._sql: dict[tuple[str, ...], str] = {}

    def _text(self, keys: tuple[str, ...]) -> str:
        sql = self._sql.get(keys)
        if sql is None:
            unknown = set(keys) - self._known
            if unknown or not keys:
                raise KeyError(f"{self.table}: no column {', '.join(sorted(unknown))}" if unknown
                               else f"{self.table}: nothing to set")
            sql = self._sql[keys] = f"UPDATE {self.table} SET {', '.join(k + ' = ?' for k in keys)} WHERE {self.where}"
        return sql

    def run(self, conn: Connection, values: Mapping[str, Any], *where: Any) -> int:
        """Set ``values`` on the rows ``where`` selects (its ``?`` in order); returns the rows changed."""
        params: Sequence[Any] = [*values.values(), *where]
        return driver(conn).execute(self._text(tuple(values)), params).rowcount
