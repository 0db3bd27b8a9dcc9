"""Benchmark: `transportd analyze` on generated logs of many messages (1 million by default) on local[2].

Generates the logs (``transportd.analytics.generate``, ~5.4 rows per message), then, in the same
Spark session on the same files: the bare scan of Spark's CSV reader (``spark.read.option("comment",
"#").csv(...).count()``) before and after the job, and the whole job. It prints the job's rows
per second beside the bare scan's and their ratio (so the figure holds under a varying load),
the seconds of each step of the job, the load average, the peak memory (resident high-water
mark) of the driver JVM and of this Python process, and checks the job's counts against the
truth file. The job never collects row-level data to the driver, so the driver's memory must
stay flat as the input grows.

    python3 benchmarks/analytics_scale.py                       # 1 M messages, ~5.4 M rows
    python3 benchmarks/analytics_scale.py --messages 2000       # CI size
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transportd.analytics.generate import generate
from transportd.analytics.job import analyze, spark_session


def peak_rss_kib(pid: int) -> int:
    """VmHWM (peak resident set) of a process and its descendants, in KiB (0 if gone)."""
    total = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1])
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return total
    return total + sum(peak_rss_kib(int(c)) for c in children)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=1_000_000)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--driver-memory", default="2g")
    p.add_argument("--workdir", default=None, help="keep logs and output here (default: a temp dir, removed)")
    p.add_argument("--json", default=None, help="write the figures here as JSON")
    p.add_argument("--reuse", action="store_true", help="reuse the logs already generated in --workdir")
    args = p.parse_args()

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="analytics-bench-"))
    try:
        started = time.monotonic()
        truth_file = work / "logs" / "truth.json"
        if args.reuse and truth_file.is_file():
            truth = json.loads(truth_file.read_text())
        else:
            truth = generate(work / "logs", args.messages, args.nodes, seed=42)
        gen_seconds = time.monotonic() - started
        size = sum(f.stat().st_size for f in (work / "logs").rglob("MSGTRK*"))
        print(("reused" if args.reuse else "generated") + f" {truth['rows']:,} rows ({size / 2**20:,.0f} MiB) for {truth['messages']:,} messages "
              f"in {gen_seconds:.1f}s ({truth['rows'] / gen_seconds:,.0f} rows/s)", flush=True)

        spark = spark_session(args.master, conf={"spark.driver.memory": args.driver_memory})
        jvm_pid = spark.sparkContext._gateway.proc.pid
        inputs = [str(work / "logs" / "*" / "msgtrk")]
        load_before = os.getloadavg()

        def bare_scan() -> tuple[int, float]:
            begun = time.monotonic()
            n = spark.read.option("comment", "#").csv(inputs).count()
            return n, time.monotonic() - begun

        try:
            bare_scan()  # warm: JIT, file cache
            scans = [bare_scan()[1]]
            started = time.monotonic()
            steps: dict[str, float] = {}
            summary = analyze(spark, inputs, str(work / "out"), progress=True, timings=steps)
            job_seconds = time.monotonic() - started
            scans.append(bare_scan()[1])
            jvm_peak = peak_rss_kib(jvm_pid)
        finally:
            spark.stop()
        load_after = os.getloadavg()
        py_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        scan_seconds = sum(scans) / len(scans)
        job_rate = summary["rows"] / job_seconds
        scan_rate = summary["rows"] / scan_seconds
        figures = {
            "messages": truth["messages"], "rows": summary["rows"], "input_mib": round(size / 2**20, 1),
            "generate_seconds": round(gen_seconds, 1), "job_seconds": round(job_seconds, 1),
            "rows_per_s": round(job_rate), "master": args.master,
            "bare_scan_seconds": [round(x, 2) for x in scans], "bare_scan_rows_per_s": round(scan_rate),
            "job_vs_bare_scan": round(job_rate / scan_rate, 3), "step_seconds": steps,
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in load_after],
            "driver_jvm_peak_mib": round(jvm_peak / 1024), "python_peak_mib": round(py_peak / 1024),
            "matches_truth": all((
                summary["messages"] == truth["messages"], summary["lost"] == truth["lost"],
                summary["promoted"] == truth["promoted"],
                summary["unprotected_messages"] == truth["unprotected"],
                summary["duplicates"]["outside_boundary"] == truth["duplicates"]["outside_boundary"],
                summary["duplicates"]["inside_boundary"] == truth["duplicates"]["inside_boundary"],
                summary["states"] == truth["states"])),
        }
        print(f"analyzed {figures['rows']:,} rows in {job_seconds:.1f}s on {args.master}: "
              f"{figures['rows_per_s']:,} rows/s; bare CSV scan {figures['bare_scan_rows_per_s']:,} rows/s "
              f"(mean of {scans[0]:.1f}s before, {scans[1]:.1f}s after); job/scan {figures['job_vs_bare_scan']:.2f}; "
              f"steps {steps}; load {load_before[0]:.2f} -> {load_after[0]:.2f}; peak memory: driver JVM "
              f"{figures['driver_jvm_peak_mib']} MiB, python {figures['python_peak_mib']} MiB; counts match the truth: "
              f"{figures['matches_truth']}")
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
        return 0 if figures["matches_truth"] else 1
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    sys.exit(main())
