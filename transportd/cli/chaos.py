"""``transportd chaos``: fault injection on a local 3-node cluster with a total-queue check.

It owns the command's options, stopping cleanly on SIGTERM, printing the summary
(and writing it as JSON) and the exit code from the checker's verdict. The run itself
is ``devtools.chaos``; this module never starts nodes or injects faults on its own.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click


@click.command("chaos")
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
@click.option("--fault-types", default=None, metavar="TYPE,...",
              help="draw faults only of these types (default: all; the first is the sink-refusing wipe "
                   "when it is among them)")
@click.option("--versions", default=None, metavar="V,V,V",
              help="shadow redundancy version of node1..node3 (2010 or 2013), e.g. 2010,2013,2013")
@click.option("--concurrent", default=1, show_default=True, type=click.IntRange(1, 3),
              help="up to K faults at once: about half the faults overlap the ones before, and pair faults "
                   "(two failures together) are drawn too; the first wipes a primary and its shadow holder")
@click.option("--shadow-copies", default=1, show_default=True, type=click.IntRange(1, 2),
              help="shadow_redundancy.shadow_copies of every node (2: survives two failures at once)")
def chaos(messages: int, faults: int, seed: int | None, no_shadow: bool, expect_loss: bool, clients: int,
          rate: float | None, ip_base: int, directory: str | None, json_out: str | None,
          drain_timeout: float, fault_types: str | None, versions: str | None, concurrent: int,
          shadow_copies: int) -> None:
    """Fault injection on a local 3-node cluster with a total-queue check (docs/reliability.md).

    Exit 0 when lost = 0, unexpected = 0, no mailbox duplicates and no internal errors (with
    --expect-loss, the control run: when lost > 0 and unexpected = 0); 1 otherwise, and in either
    kind of run whenever the nemesis failed, the nodes' logs show a code error (an exception only a
    bug raises) or a node answered 5xx while its disk was full (harness.judge)."""
    import json
    import random
    import signal
    import tempfile

    from transportd.devtools.chaos.harness import format_summary, judge, run
    from transportd.devtools.chaos.nemesis import FAULT_TYPES, PAIR_TYPES
    types = [t.strip() for t in fault_types.split(",") if t.strip()] if fault_types else None
    unknown = [t for t in types or [] if t not in FAULT_TYPES]
    if unknown or types == []:
        raise click.BadParameter(f"unknown fault type(s) {', '.join(unknown) or '(none given)'}; known: "
                                 f"{', '.join(FAULT_TYPES)}", param_hint="--fault-types")
    pairs = [t for t in types or [] if t in PAIR_TYPES]
    if pairs and concurrent < 2:
        raise click.BadParameter(f"{', '.join(pairs)}: two failures at once need --concurrent 2 or more",
                                 param_hint="--fault-types")

    per_node = [v.strip() for v in versions.split(",")] if versions else None
    if per_node is not None and (len(per_node) != 3 or not set(per_node) <= {"2010", "2013"}):
        raise click.BadParameter(f"three versions (2010 or 2013), one per node, not {versions!r}",
                                 param_hint="--versions")
    if per_node is not None and "2010" in per_node and shadow_copies > 1:
        raise click.BadParameter("Exchange 2010 nodes keep one shadow (the sender's): --shadow-copies 1 with them",
                                 param_hint="--shadow-copies")

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through run(): its cluster and proxy are stopped
    signal.signal(signal.SIGTERM, stop)
    if seed is None:
        seed = random.SystemRandom().randrange(1, 2**31)
    folder = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="transportd-chaos-"))
    summary = run(messages=messages, faults=faults, seed=seed, shadow=not no_shadow, directory=folder.resolve(),
                  clients=clients, ip_base=ip_base, rate=rate, drain_timeout=drain_timeout, fault_types=types,
                  versions=per_node, expect_loss=expect_loss, concurrent=concurrent, shadow_copies=shadow_copies,
                  say=lambda m: click.echo(m))
    click.echo(format_summary(summary))
    if json_out:
        Path(json_out).write_text(json.dumps(summary, indent=2))
    good, reason = judge(summary, expect_loss)
    if expect_loss:
        click.echo(f"control run: {'lost > 0 as expected' if good else 'FAILED: ' + reason}")
    sys.exit(0 if good else 1)
