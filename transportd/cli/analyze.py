"""``transportd analyze``: Spark analytics over many nodes' MSGTRK logs, and a generator of test logs.

It owns the ``analyze`` group (``run`` is its default sub-command, so ``analyze PATHS
--out DIR`` works), checking its options and printing the summary. The analysis is
``analytics.job`` (pyspark, optional) and the generator ``analytics.generate``; this
module never reads tracking files or the queue database itself.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from transportd.cli.common import CliError, ConfigCliError


class DefaultCommandGroup(click.Group):
    """A group whose first argument, when it is not a sub-command, goes to ``default_command``."""

    default_command = "run"

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)


@click.group("analyze", cls=DefaultCommandGroup)
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
@click.option("--events", "write_events", is_flag=True,
              help="also write every row, typed, to OUT/events/ (Parquet, partitioned by valid)")
@click.option("--no-progress", is_flag=True, help="no progress display on stderr")
@click.option("--json", "as_json", is_flag=True, help="print summary.json instead of the table")
def analyze_run(paths: tuple[str, ...], out: str, master: str | None, recursive: bool, name_filter: str | None,
                grace: float, episode_gap: float, confs: tuple[str, ...], write_events: bool, no_progress: bool,
                as_json: bool) -> None:
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
        job.check_local_out(out)
    except job.AnalyzeError as exc:
        raise ConfigCliError(str(exc)) from None
    spark = job.spark_session(master, conf=conf)
    try:
        summary = job.analyze(spark, list(paths), out, name_filter=name_filter or job.DEFAULT_NAME_FILTER,
                              recursive=recursive, grace_seconds=grace, episode_gap=episode_gap,
                              progress=not no_progress, write_events=write_events)
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
@click.option("--split-rate", type=click.FloatRange(0, 1), default=0.1, show_default=True,
              help="messages to several outside recipients sent to one first, the rest minutes later")
@click.option("--fail-rate", type=click.FloatRange(0, 1), default=0.005, show_default=True)
@click.option("--lost-discard-rate", type=click.FloatRange(0, 1), default=0.001, show_default=True)
@click.option("--malformed", type=click.IntRange(0), default=10, show_default=True, help="malformed rows to inject")
@click.option("--exchange2010-nodes", type=click.IntRange(0), default=0, show_default=True,
              help="the first N nodes write Exchange 2010's 26 fields (no network-message-id), as in a mixed cluster")
def analyze_generate(messages: int, nodes: int, out: str, seed: int, deaths: int | None, rate: float | None,
                     redirect_fail_rate: float, defer_rate: float, split_rate: float, fail_rate: float,
                     lost_discard_rate: float, malformed: int, exchange2010_nodes: int) -> None:
    """Write realistic multi-node MSGTRK logs with injected failures, and truth.json beside them."""
    from transportd.analytics.generate import generate
    started = time.monotonic()
    try:
        truth = generate(out, messages, nodes, seed, deaths=(1 if nodes > 2 else 0) if deaths is None else deaths,
                         rate=rate, redirect_fail_rate=redirect_fail_rate, defer_rate=defer_rate,
                         split_rate=split_rate, fail_rate=fail_rate, lost_discard_rate=lost_discard_rate, malformed=malformed,
                         exchange2010_nodes=exchange2010_nodes)
    except ValueError as exc:
        raise ConfigCliError(str(exc)) from None
    click.echo(f"wrote {truth['rows']} rows for {truth['messages']} messages on {nodes} nodes to {out} "
               f"in {time.monotonic() - started:.1f}s; truth: {Path(out) / 'truth.json'}")
