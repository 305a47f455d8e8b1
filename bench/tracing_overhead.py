"""What tracing costs on the command path (issue 11, item 3).

Runs the in-process command path of ``bench.command_path`` (JoinRoom, concurrency 64,
1,000 rooms, SQLite) with ``tracing.exporter`` none, with a tracer that samples
nothing (``sample_ratio: 0``: spans exist but do not record), and with the file
exporter recording every span (command, stages, stored trace context), beside the
bare-driver baseline of the same transaction, in interleaved rounds of one run.

    .venv/bin/python -m bench.tracing_overhead [--commands N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.command_path import APP, CONCURRENCY, ROOMS, _settings, raw_run, service_run
from bench.common import describe, fresh_database, run_concurrently
from roomservice.bootstrap import API, MAINTENANCE, Process
from roomservice.domain import commands as c
from roomservice.observability.logging import configure_logging

VARIANTS: dict[str, dict[str, Any]] = {  # "none" is bench.command_path's own run (the configured default)
    "unsampled": {"tracing.exporter": "file", "tracing.sample_ratio": 0.0},
    "file": {"tracing.exporter": "file", "tracing.sample_ratio": 1.0},
}


async def traced_run(url: str, commands: int, overrides: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as data_dir:
        settings = _settings(url, data_dir).with_overrides(overrides)
        async with Process.running(settings, roles=(API, MAINTENANCE), loops=False) as rt:
            svc = rt.service
            await run_concurrently(
                CONCURRENCY,
                list(range(ROOMS)),
                lambda r: svc.execute(APP, f"room{r}", f"create-{r}", c.CreateRoom(owner_id="owner", title="bench")),
            )
            start = time.perf_counter()
            latencies = await run_concurrently(
                CONCURRENCY,
                list(range(commands)),
                lambda i: svc.execute(APP, f"room{i % ROOMS}", f"join-{i}", c.JoinRoom(user_id=f"user{i}")),
            )
            elapsed = time.perf_counter() - start
        lines = _count_lines(Path(data_dir, "traces.jsonl"))
    return {"cps": commands / elapsed, "latencies": latencies, "spans": lines}


def _count_lines(path: Path) -> int:
    if not path.exists():
        return 0
    with path.open() as f:
        return sum(1 for _ in f)


async def one_round(commands: int) -> dict[str, dict[str, Any]]:
    async with fresh_database("sqlite") as url:
        none = await service_run(url, commands)  # tracing.exporter none; also the row sizes for the baseline
    results: dict[str, dict[str, Any]] = {"none": {**none, "spans": 0}}
    for name, overrides in VARIANTS.items():
        async with fresh_database("sqlite") as url:
            results[name] = await traced_run(url, commands, overrides)
    async with fresh_database("sqlite") as url:
        results["bare"] = await raw_run(url, commands, none["sizes"], "thread")
    return results


async def main(commands: int, rounds: int) -> None:
    configure_logging(level="warning", json=True)
    runs = [await one_round(commands) for _ in range(rounds)]  # interleaved: a busy spell hits every variant

    def cps(name: str) -> float:
        return statistics.median(run[name]["cps"] for run in runs)

    print(f"SQLite, {commands} JoinRoom commands, concurrency {CONCURRENCY}, median of {rounds} interleaved rounds")
    print(f"  bare driver (same transaction, the store's thread path): {cps('bare'):.0f} commands/s")
    for name in ("none", *VARIANTS):
        last = runs[-1][name]
        print(
            f"  tracing {name:9s}: {cps(name):.0f} commands/s = {cps(name) / cps('bare'):.2f} x bare driver, "
            f"{cps(name) / cps('none'):.2f} x tracing none; last round {describe(last['latencies'])}; "
            f"{last['spans']} spans written"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--commands", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.commands, args.rounds))
