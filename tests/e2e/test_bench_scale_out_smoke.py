"""bench/scale_out.py still runs: minimal sizes, its every phase, real processes on MariaDB + Redis + NATS."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_the_scale_out_benchmark_runs_every_phase(mariadb_server_url: Any, require_service: Any) -> None:
    require_service("Redis", "127.0.0.1", 6379)
    require_service("NATS", "127.0.0.1", 4222)
    args = ["--processes", "2", "--rounds", "1", "--rooms", "4", "--commands", "60", "--concurrency", "4"]
    args += ["--latency-samples", "10", "--takeovers", "1", "--ttl", "2s"]
    run = subprocess.run(
        [sys.executable, "-m", "bench.scale_out", *args],
        cwd=ROOT,
        env={**os.environ, "ROOMSERVICE_BENCH_MARIADB_URL": mariadb_server_url.render_as_string(hide_password=False)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert re.search(r"\d+ cores", out)
    assert re.search(r"^\[throughput\] round 1, 2 processes: +\d+ cmd/s .* ms a command", out, re.M)
    assert re.search(r"^\[throughput\] round 1, bare-driver baseline .*: +\d+ tx/s", out, re.M)
    median = r"^\[throughput\] median of 1, 2 processes: .* ratio to the baseline \(\d+ tx/s\) \d+\.\d+x"
    assert re.search(median, out, re.M)
    assert "rooms not on their process 0/4" in out  # every room stayed with the process it was created on
    assert re.search(r"^\[forwarding\] added by the hop: p50 [+-]\d", out, re.M)
    assert re.search(r"^\[takeover\] .* 1 times .* lease\.ttl 2 s", out, re.M)
    assert "the answering process holds the new lease: True" in out
