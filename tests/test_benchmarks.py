"""CI keeps the benchmarks working at a tiny size; the figures themselves are not asserted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_accept_throughput_benchmark_runs_small(tmp_path):
    out = tmp_path / "figures.json"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "accept_throughput.py"),
                          "--messages", "40", "--sessions", "4", "--size", "2048", "--timeout", "60",
                          "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    figures = json.loads(out.read_text())
    assert figures["delivered"] == 40
    assert figures["accepted_per_s"] > 0
