"""Test-only fault injection: make one message's handling fail inside a named loop.

It exists so that tests can prove every loop that handles many messages isolates
each one (a failure is caught, counted towards the Poison queue, and the others
go on), and that a message which crashes the daemon ends in the Poison queue.
It is off unless the environment variable ``TRANSPORTD_TEST_FAULTS`` holds a JSON
plan when the process starts; nothing in the configuration, the CLI or the docs
for operators turns it on. It never changes data: it only raises or hangs.

Plan: ``{"match": "TEXT", "steps": ["deliver", ...], "action": "raise" | "hang" | "spin"}``.
A message matches when TEXT occurs in its subject, sender or network-message-id.
Steps are the loops of ``STEPS`` ("recorded": just after the commit that records a delivery's
outcomes, so that a "spin" there and a kill -9 stop the node between that commit and what
follows it); "hang" blocks the handling coroutine for ever (the
message waits, as on a next hop that never answers; the node goes on); "spin" blocks the
step's synchronous part for ever (as a message that sends a parser into a loop would): the
whole process where that part runs on the event loop (a DSN's, a local delivery's), the worker
thread where it runs in one (an SMTP delivery's conversion, node/connectors.py), so a test can
kill the process while a message is in that step.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

ENV = "TRANSPORTD_TEST_FAULTS"
STEPS = ("deliver", "shadow", "reshadow", "promote", "discard", "resubmit", "expire", "dsn", "settle", "recorded")


class InjectedFault(RuntimeError):
    """The error a test asked for (stands for any bug or unexpected input)."""


_plan: dict[str, Any] | None = None


def configure(plan: dict[str, Any] | None) -> None:
    """Set (or clear, with None) the plan; unit tests call this, processes read ``ENV``."""
    global _plan
    if plan is not None:
        unknown = set(plan.get("steps", ())) - set(STEPS)
        if unknown:
            raise ValueError(f"unknown fault steps: {sorted(unknown)}")
    _plan = plan


def _field(row: Any, name: str) -> str:
    value = row.get(name) if isinstance(row, dict) else getattr(row, name, None)
    return value if isinstance(value, str) else ""


def matches(step: str, row: Any) -> bool:
    if _plan is None or step not in _plan.get("steps", ()):
        return False
    text = _plan.get("match") or ""
    return bool(text) and any(text in _field(row, f) for f in ("subject", "sender", "network_message_id"))


def check(step: str, row: Any) -> None:
    """Raise InjectedFault when the plan says this step fails for this message ("spin": block
    the process for ever)."""
    if matches(step, row):
        while (_plan or {}).get("action") == "spin":
            time.sleep(1)
        raise InjectedFault(f"injected fault in {step}")


async def acheck(step: str, row: Any) -> None:
    """``check`` in a coroutine's asynchronous part: block the coroutine for ever when the
    plan's action is "hang"; "spin" is left to the step's synchronous ``check``."""
    if matches(step, row):
        action = (_plan or {}).get("action")
        if action == "spin":
            return
        if action == "hang":
            await asyncio.Event().wait()
        raise InjectedFault(f"injected fault in {step}")


if os.environ.get(ENV):
    configure(json.loads(os.environ[ENV]))
