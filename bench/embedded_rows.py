"""Benchmark: what one outbox row costs in the embedded default, part by part (issue 12).

``room-service serve`` with no ``--config`` runs the packaged ``configs/local.yaml``:
the outbox worker in mq mode on the embedded broker and the consumer groups of the
room outbox topic (activity, notice, IM bridge against the in-process IM sandbox) in
the process that takes the commands. This benchmark runs exactly those parts in
process (``Process.running`` with the serve roles, the packaged settings and serve's
garbage-collector settings, ``cli/collector.py``; no HTTP:
``bench.http_commands`` measures the HTTP server), one configuration per part:

  * ``commands``: the outbox worker off (the command path alone);
  * ``worker``: the worker publishing every row to the embedded broker, no group of the
    room outbox topic (so a publish writes the message and no delivery row);
  * ``activity``, ``notice``, ``im-bridge``: the worker and that one group;
  * ``all``: the worker and every group, as ``serve`` runs them.

Each configuration gets a fresh data directory, creates 100 rooms (waiting until their
rows are delivered everywhere), then sends ``--commands`` JoinRoom commands at
``--concurrency`` and waits until every outbox row is delivered and every group's lag is 0.
Printed per configuration: the command rate, the process CPU per command while the
commands ran, and the process CPU per row until everything was delivered and consumed
(``time.process_time``: all threads). The part's cost per row is its figure minus the
``commands`` (worker) figure of the same round; on this shared machine compare CPU, not rates.
The IM bridge is bound by ``tencent_im.rate_limit_per_second`` (200/s in the sandbox and
the client), so its part takes ``commands / 200`` seconds at least; CPU per row is unaffected.

    .venv/bin/python -m bench.embedded_rows [--parts commands,worker,activity,notice,im-bridge,all]
        [--commands N] [--rounds R] [--concurrency C] [--profile DIR]   # --profile: py-spy per part
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from roomservice.bootstrap import SERVE_ROLES, Process
from roomservice.cli.collector import settle_after_start
from roomservice.config import Settings, load_settings
from roomservice.domain import commands as c
from roomservice.observability.logging import configure_logging
from roomservice.store import tables as t

APP = "bench"
ROOMS = 100
WAIT_S = 300.0
PARTS = ("commands", "worker", "activity", "notice", "im-bridge", "all")


def settings_for(part: str, data_dir: Path) -> tuple[Settings, frozenset[str] | None]:
    """The packaged settings (as ``serve`` without ``--config``), and the consumer groups of ``part``."""
    settings = load_settings().with_data_dir(data_dir)
    cs, mq = settings.consumers, settings.rocketmq
    treasure = mq.treasure_open.consumer_group  # on its own topic: idle under this load
    groups = {
        "commands": None,
        "worker": frozenset({treasure}),
        "activity": frozenset({treasure, cs.activity.group}),
        "notice": frozenset({treasure, cs.notice.group}),
        "im-bridge": frozenset({treasure, mq.room_outbox.tencent_im_consumer_group}),
        "all": None,
    }[part]
    if part == "commands":
        settings = settings.with_overrides({"outbox_worker.enabled": False})
    return settings, groups


async def caught_up(rt: Process, *, since_id: int = 0) -> None:
    """Every outbox row delivered and every group's lag 0 (a worker-off process: nothing to wait for)."""
    if rt.worker is None:
        return
    o = t.room_outbox.c
    pending = sa.select(sa.func.count()).select_from(t.room_outbox).where(o.id > since_id, o.status != "delivered")
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        async with rt.db.read() as conn:
            left = int(await conn.scalar(pending) or 0)
        if not left:
            runners = rt.consumers.runners if rt.consumers is not None else []
            assert rt.broker is not None or not runners
            lags = [(await rt.broker.group_stats(r.handler.topic, r.group)).lag for r in runners]  # type: ignore[union-attr]
            if not any(lags):
                return
        await asyncio.sleep(0.1)  # the look itself costs CPU, counted in the figures: not too often
    raise AssertionError("the process did not deliver and consume every row in time")


class Profiler:
    """py-spy (``--gil``) on this process for one part; ``python -m bench.spy_summary FILE`` reads it."""

    def __init__(self, out: Path | None) -> None:
        self.out = out
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Profiler:
        if self.out is not None:
            spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
            self.proc = subprocess.Popen(
                [spy, "record", "--pid", str(os.getpid()), "--rate", "200", "--gil", "--format", "speedscope",
                 "-o", str(self.out)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        return self

    def __exit__(self, *_: object) -> None:
        if self.proc is not None:
            self.proc.send_signal(2)  # SIGINT: py-spy writes its output and exits
            self.proc.wait(timeout=60)


async def run_part(part: str, *, commands: int, concurrency: int, tag: str, profile: Path | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="roombench-rows-") as tmp:
        settings, groups = settings_for(part, Path(tmp))
        async with Process.running(settings, roles=SERVE_ROLES, groups=groups) as rt:
            settle_after_start()  # the collector as `serve` runs it (cli/collector.py)
            svc = rt.service
            for r in range(ROOMS):
                await svc.execute(APP, f"{tag}h{r}", f"{tag}c{r}", c.CreateRoom(owner_id="o", title="t"))
            await caught_up(rt)
            async with rt.db.read() as conn:
                last_id = int(await conn.scalar(sa.select(sa.func.max(t.room_outbox.c.id))) or 0)
            jobs = iter(range(commands))

            async def lane() -> None:
                for i in jobs:
                    await svc.execute(APP, f"{tag}h{i % ROOMS}", f"{tag}j{i}", c.JoinRoom(user_id=f"{tag}u{i}"))

            with Profiler(profile):
                cpu0, t0 = time.process_time(), time.perf_counter()
                await asyncio.gather(*(lane() for _ in range(concurrency)))
                cpu1, t1 = time.process_time(), time.perf_counter()
                await caught_up(rt, since_id=last_id)
                cpu2, t2 = time.process_time(), time.perf_counter()
            runners = rt.consumers.runners if rt.consumers is not None else []
            retried = {r.group: (r.counts.failures, r.counts.redelivered) for r in runners if any(
                (r.counts.failures, r.counts.redelivered))}  # fmt: skip
    return {
        "rate": commands / (t1 - t0),
        "cpu_commands_us": (cpu1 - cpu0) / commands * 1e6,
        "cpu_row_us": (cpu2 - cpu0) / commands * 1e6,
        "all_done_s": t2 - t0,
        "retried": retried,  # group -> (failures, redeliveries), where any
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    parser.add_argument("--commands", type=int, default=3_000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--profile", type=Path, default=None, help="directory for py-spy speedscope profiles")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    configure_logging(level="info", json=True, file=open(os.devnull, "w"))  # noqa: SIM115 - as serve logs
    print(
        f"embedded default per row: {args.commands} JoinRoom, concurrency {args.concurrency}, {ROOMS} rooms; "
        f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    for round_ in range(1, args.rounds + 1):
        base: float | None = None
        for part in parts:
            profile = args.profile / f"{part}-r{round_}.speedscope.json" if args.profile else None
            f = asyncio.run(run_part(part, commands=args.commands, concurrency=args.concurrency,
                                     tag=f"r{round_}", profile=profile))  # fmt: skip
            if part == "commands":
                base = f["cpu_row_us"]
            extra = f" = commands + {f['cpu_row_us'] - base:5.0f} us" if base is not None and part != "commands" else ""
            print(
                f"[rows] round {round_} {part:9s}: {f['rate']:5.0f} cmd/s, CPU {f['cpu_commands_us']:5.0f} us/cmd "
                f"while commanding, {f['cpu_row_us']:5.0f} us/row until all delivered and consumed{extra} "
                f"(all done after {f['all_done_s']:.1f} s; load {os.getloadavg()[0]:.1f})"
                + (f"; failures, redeliveries: {f['retried']}" if f["retried"] else ""),
                flush=True,
            )


if __name__ == "__main__":
    main()
