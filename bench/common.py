"""Shared helpers for benchmarks: percentiles, fresh databases, printing ratios."""

from __future__ import annotations

import asyncio
import os
import secrets
import statistics
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from roomservice.config import DIRECT_TOPOLOGY

MARIADB_SERVER_URL = os.environ.get("ROOMSERVICE_BENCH_MARIADB_URL", "mysql+asyncmy://root@127.0.0.1:3306/test")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def describe(values: list[float]) -> str:
    p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
    return f"p50 {p50:.2f} ms, p99 {p99:.2f} ms, mean {statistics.fmean(values):.2f} ms"


@asynccontextmanager
async def fresh_database(backend: str) -> AsyncIterator[str]:
    """A URL of a new, empty database on ``backend`` ("sqlite" or "mariadb"), removed afterwards."""
    if backend == "sqlite":
        with tempfile.TemporaryDirectory(prefix="roombench-") as tmp:
            yield f"sqlite+aiosqlite:///{tmp}/bench.db"
        return
    name = f"roombench_{secrets.token_hex(4)}"
    admin = create_async_engine(MARIADB_SERVER_URL, isolation_level="AUTOCOMMIT")
    async with admin.connect() as conn:
        await conn.execute(text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
    try:
        yield MARIADB_SERVER_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        async with admin.connect() as conn:
            await conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))
        await admin.dispose()


async def run_concurrently(concurrency: int, jobs: list[object], worker: object) -> list[float]:
    """Run ``await worker(job)`` for every job with ``concurrency`` tasks; returns latencies in ms."""
    import time

    queue = iter(jobs)
    latencies: list[float] = []

    async def lane() -> None:
        for job in queue:
            start = time.perf_counter()
            await worker(job)  # type: ignore[operator]
            latencies.append((time.perf_counter() - start) * 1000)

    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return latencies


# The "direct mode with instant publishers": configs/local.yaml (what load_settings() starts from)
# runs mq on the embedded broker with its consumer groups in the process; this turns all of that off.
# poll_interval 1s: the commit's wake-up, not the poll, must carry the latency.
DIRECT_MODE = {**DIRECT_TOPOLOGY, "outbox_worker.poll_interval": "1s"}
