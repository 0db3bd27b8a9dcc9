"""Test-only fault injection: make one message's handling fail inside a named loop.

It exists so that tests can prove every loop that handles many messages isolates
each one (a failure is caught, counted towards the Poison queue, and the others
go on), and that a message which crashes the daemon ends in the Poison queue.
It is off unless the environment variable ``TRANSPORTD_TEST_FAULTS`` holds a JSON
plan when the process starts; nothing in the configuration, the CLI or the docs
for operators turns it on. It never changes data: it only raises or hangs.

Plan: ``{"match": "TEXT", "steps": ["deliver", ...], "action": "raise" | "hang"}``.
A message matches when TEXT occurs in its subject, sender or network-message-id.
Steps are the loops of ``STEPS``; "hang" blocks the handling coroutine for ever (so
a test can kill the process while a message is being handled).
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

ENV = "TRANSPORTD_TEST_FAULTS"
STEPS = ("deliver", "shadow", "reshadow", "promote", "discard", "resubmit", "expire", "dsn", "settle")


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
    """Raise InjectedFault when the plan says this step fails for this message."""
    if matches(step, row):
        raise InjectedFault(f"injected fault in {step}")


async def acheck(step: str, row: Any) -> None:
    """``check``, or block for ever when the plan's action is "hang"."""
    if matches(step, row):
        if (_plan or {}).get("action") == "hang":
            await asyncio.Event().wait()
        raise InjectedFault(f"injected fault in {step}")


if os.environ.get(ENV):
    configure(json.loads(os.environ[ENV]))
