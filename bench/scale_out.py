"""Benchmark of scale-out (issue 10): N real ``room-service serve`` processes on MariaDB + Redis + NATS.

Every process is a real ``serve`` child (``lease.driver: redis``, the gRPC room
API on a free port, ``publish_mode: mq`` on the shared NATS JetStream under a
stream and namespace of this run, all on one fresh MariaDB database and one
Redis key prefix; all removed afterwards). The client is this process: one
keep-alive HTTP/1.1 connection per lane and process.

Prints:
  * throughput with 1, 2 and 3 processes: JoinRoom commands/s, rooms spread over
    the processes (room k created on process k mod N, which takes its lease) and
    every command sent to the process owning its room (nothing is forwarded),
    with p50/p99 latency and the CPU the servers and the client used (the servers'
    CPU a command is what a loaded machine disturbs least), in rounds with the
    order of the counts alternating, then the medians; beside it, once a round,
    the bare-driver baseline: the same transaction (guarded
    room_meta update + command log + outbox insert, rows of the sizes just
    measured) from a minimal asyncmy loop at the client's concurrency (``bench.bare``);
  * the latency a forwarded command adds over a local one: one room, commands
    one at a time, alternately to its owner and to a process that forwards them
    in one gRPC hop (p50/p99 of each, and the difference);
  * the lease takeover time after ``kill -9`` of a room's owner: from the kill
    until another process answers a command for the room with 200 (the client
    retries a 503 with the same command_id every 20 ms), repeated, each kill at a
    drawn point of the lease's renewal cycle; min/median/max beside the
    configured ``lease.ttl`` and ``lease.renew_every``.

The machine's core count is printed: with 2 cores, three servers, MariaDB, the
NATS server and the client share the same two, so the 2- and 3-process figures
measure contention more than capacity.

    .venv/bin/python -m bench.scale_out [--processes 1,2,3] [--rounds R] [--rooms R] [--commands N]
        [--concurrency C] [--latency-samples S] [--takeovers K] [--ttl 10s] [--no-outbox]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import secrets
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import redis

from bench.command_path import bare_run, stored_join_sizes
from bench.common import fresh_database, percentile
from bench.http_commands import KeepAliveClient
from roomservice.durations import parse_duration
from roomservice.store.database import Database

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.e2e.server import ServerProcess  # the same child the e2e tests start

NATS_URL = os.environ.get("ROOMSERVICE_BENCH_NATS_URL", "nats://127.0.0.1:4222")
REDIS_URL = os.environ.get("ROOMSERVICE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
APP = "scalebench"
SECRET = "bench-peer-secret"
RETRY_EVERY_S = 0.02
CLOCK_TICK = os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- the cluster


@dataclass(slots=True)
class Node:
    server: ServerProcess

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def pid(self) -> int:
        assert self.server.proc is not None
        return self.server.proc.pid

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{(self.server.data_dir / 'grpc-port').read_text().strip()}"

    def cpu_s(self) -> float:
        """User + system CPU seconds of the server process so far (``/proc/<pid>/stat``)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICK


@dataclass(slots=True)
class Cluster:
    nodes: list[Node]
    prefix: str
    database_url: str
    ttl_s: float
    renew_every_s: float
    clients: dict[tuple[int, int], KeepAliveClient] = field(default_factory=dict)  # (lane, node) -> connection

    async def client(self, lane: int, node: int) -> KeepAliveClient:
        key = (lane, node)
        if key not in self.clients:
            self.clients[key] = await KeepAliveClient.connect(self.nodes[node].port)
        return self.clients[key]

    def drop_clients(self, node: int | None = None) -> None:
        for key in [k for k in self.clients if node is None or k[1] == node]:
            self.clients.pop(key).close()

    def owner_address(self, room: str) -> str | None:
        client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
        try:
            raw = client.get(f"{self.prefix}lease:{APP}:{room}")
        finally:
            client.close()
        return None if raw is None else str(json.loads(str(raw))["address"])


def config_text(*, database_url: str, prefix: str, stream: str, ttl_s: float, outbox: bool) -> str:
    # renewal and safety margin in the defaults' proportions (10s / 3s / 2s)
    lease = f'ttl: "{ttl_s * 1000:.0f}ms", renew_every: "{ttl_s * 300:.0f}ms", safety_margin: "{ttl_s * 200:.0f}ms"'
    outbox_cfg = (
        f"outbox_worker: {{enabled: true, publish_mode: mq}}\n"
        f'rocketmq: {{namespace: "{stream}", room_outbox: {{enabled: true}}}}\n'
        f'broker: {{driver: nats, nats: {{url: "{NATS_URL}", stream: "{stream}"}}}}\n'
        if outbox
        else "outbox_worker: {enabled: false}\n"
    )
    # 16 connections a process at most: three of them and the baseline stay well inside MariaDB's
    # default max_connections (151), shared with whatever else runs on the server
    return f"""
logging: {{level: warning, json: true}}
database: {{url: "{database_url}", pool_size: 16, max_overflow: 0}}
lease: {{driver: redis, {lease}}}
redis: {{url: "{REDIS_URL}", key_prefix: "{prefix}"}}
grpc: {{host: 127.0.0.1, port: 0, shared_secret: "${{ROOMSERVICE_GRPC_SHARED_SECRET}}"}}
{outbox_cfg}gifts:
  - {{id: rose, name: Rose, price: 10}}
"""


@asynccontextmanager
async def running_cluster(n: int, *, ttl_s: float, outbox: bool) -> AsyncIterator[Cluster]:
    """``n`` serve processes on a fresh MariaDB database, a Redis prefix and a NATS stream of their own."""
    tag = secrets.token_hex(4)
    prefix, stream = f"bench-scale-{tag}:", f"scalebench_{tag}"
    async with fresh_database("mariadb") as url:
        with tempfile.TemporaryDirectory(prefix="roombench-scale-") as tmp:
            config = Path(tmp) / "c.yaml"
            config.write_text(config_text(database_url=url, prefix=prefix, stream=stream, ttl_s=ttl_s, outbox=outbox))
            cluster = Cluster(nodes=[], prefix=prefix, database_url=url, ttl_s=ttl_s, renew_every_s=ttl_s * 0.3)
            try:
                for i in range(n):
                    server = ServerProcess(
                        config=config, data_dir=Path(tmp) / f"node{i}", env={"ROOMSERVICE_GRPC_SHARED_SECRET": SECRET}
                    )
                    server.start(timeout_s=60)
                    cluster.nodes.append(Node(server))
                yield cluster
            finally:
                cluster.drop_clients()
                for node in cluster.nodes:
                    node.server.stop()
                drop_redis_prefix(prefix)
                if outbox:
                    await drop_streams(stream)


def drop_redis_prefix(prefix: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


async def drop_streams(stream: str) -> None:
    nc = await nats.connect(NATS_URL)
    try:
        for name in (stream, f"{stream}_dlq"):
            with contextlib.suppress(Exception):  # a stream nobody published to was never created
                await nc.jetstream().delete_stream(name)
    finally:
        await nc.close()


async def post_until_answered(
    cluster: Cluster, lane: int, node: int, path: str, body: dict[str, Any], *, give_up_s: float = 30.0
) -> tuple[int, int]:
    """POST, retrying a 503 (or a refused connection) with the same body; (status, retries)."""
    end = time.monotonic() + give_up_s
    retries = 0
    while True:
        try:
            status, answer = await (await cluster.client(lane, node)).post(path, body)
        except (OSError, asyncio.IncompleteReadError):
            cluster.drop_clients(node)
            status, answer = 0, b""
        if status not in (0, 503):
            if status != 200:
                raise RuntimeError(f"{path}: {status} {answer[:300]!r}")
            return status, retries
        if time.monotonic() >= end:
            raise RuntimeError(f"{path}: no answer within {give_up_s}s (last status {status})")
        retries += 1
        await asyncio.sleep(RETRY_EVERY_S)


async def create_room(cluster: Cluster, node: int, room: str) -> None:
    body = {"command_id": f"create-{room}", "room_id": room, "owner_id": "owner", "title": "bench"}
    await post_until_answered(cluster, 0, node, f"/v1/apps/{APP}/rooms", body)


def join_path(room: str) -> str:
    return f"/v1/apps/{APP}/rooms/{room}/join"


# --------------------------------------------------------------------------- throughput


@contextlib.contextmanager
def cpu_meter(cluster: Cluster) -> Iterator[dict[str, float]]:
    """CPU seconds the servers and this client used inside the block."""
    result: dict[str, float] = {}
    servers_before = sum(n.cpu_s() for n in cluster.nodes)
    me = resource.getrusage(resource.RUSAGE_SELF)
    yield result
    after = resource.getrusage(resource.RUSAGE_SELF)
    result["servers"] = sum(n.cpu_s() for n in cluster.nodes) - servers_before
    result["client"] = (after.ru_utime - me.ru_utime) + (after.ru_stime - me.ru_stime)


async def throughput(cluster: Cluster, *, rooms: int, commands: int, concurrency: int) -> dict[str, Any]:
    n = len(cluster.nodes)
    room_ids = [f"t{k}" for k in range(rooms)]
    for k, room in enumerate(room_ids):  # one connection per (lane, process): one request at a time on it
        await create_room(cluster, k % n, room)
    owners = [cluster.owner_address(room) for room in room_ids]
    misplaced = sum(owners[k] != cluster.nodes[k % n].grpc_target for k in range(rooms))

    async def run(first: int, count: int) -> tuple[float, list[float], int]:
        jobs = iter(range(first, first + count))
        latencies: list[float] = []
        retries = 0

        async def lane(number: int) -> None:
            nonlocal retries
            for i in jobs:
                k = i % rooms
                started = time.perf_counter()
                body = {"command_id": f"j{i}", "user_id": f"u{i}"}
                _, again = await post_until_answered(cluster, number, k % n, join_path(room_ids[k]), body)
                latencies.append((time.perf_counter() - started) * 1000)
                retries += again

        start = time.perf_counter()
        await asyncio.gather(*(lane(number) for number in range(concurrency)))
        return time.perf_counter() - start, latencies, retries

    await run(0, max(concurrency * 4, commands // 10))  # warm up: connections, pools, cells
    with cpu_meter(cluster) as cpu:
        elapsed, latencies, retries = await run(commands, commands)
    return {
        "cps": commands / elapsed,
        "elapsed": elapsed,
        "latencies": latencies,
        "retries": retries,
        "misplaced": misplaced,
        "cpu": cpu,
    }


async def row_sizes(database_url: str) -> list[int]:
    """Average bytes of a JoinRoom's command, events, response, timing and outbox payload, as stored."""
    db = Database.from_url(database_url)
    try:
        async with db.read() as conn:
            return await stored_join_sizes(conn)
    finally:
        await db.dispose()


# --------------------------------------------------------------------------- forwarding


async def forwarded_latency(cluster: Cluster, *, samples: int) -> dict[str, list[float]]:
    """One room on node 0; commands one at a time, alternately to node 0 (local) and node 1 (one hop)."""
    await create_room(cluster, 0, "fwd")
    assert cluster.owner_address("fwd") == cluster.nodes[0].grpc_target
    result: dict[str, list[float]] = {"local": [], "forwarded": []}
    for i in range(-20, samples):  # the first 20 pairs warm the channels up
        for kind, node in (("local", 0), ("forwarded", 1)):
            body = {"command_id": f"f{kind}{i}", "user_id": f"{kind}{i}"}
            started = time.perf_counter()
            _, retries = await post_until_answered(cluster, 0, node, join_path("fwd"), body)
            took = (time.perf_counter() - started) * 1000
            if i >= 0 and retries == 0:
                result[kind].append(took)
    return result


# --------------------------------------------------------------------------- takeover


async def takeovers(cluster: Cluster, *, repeats: int) -> list[dict[str, Any]]:
    """Kill -9 a room's owner, time until a survivor answers a command for it; restart the owner."""
    n = len(cluster.nodes)
    results = []
    phases = random.Random(10)  # the same draws in every run
    for k in range(repeats):
        victim = k % n
        room = f"k{k}"
        await create_room(cluster, victim, room)
        assert cluster.owner_address(room) == cluster.nodes[victim].grpc_target
        for i in range(5):  # a few commands through the owner first
            await post_until_answered(
                cluster, 0, victim, join_path(room), {"command_id": f"w{k}-{i}", "user_id": f"w{i}"}
            )
        # the kill lands at a uniformly drawn point of the lease's renewal cycle (renewed every renew_every
        # since it was taken), so the lease has between ttl - renew_every and ttl left
        await asyncio.sleep(cluster.renew_every_s * (1 + phases.random()))
        survivors = [i for i in range(n) if i != victim]
        for s in survivors:  # the survivors' connections are open before the clock starts
            await cluster.client(0, s)
        node = cluster.nodes[victim]
        os.kill(node.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        body = {"command_id": f"after-kill-{k}", "user_id": f"after{k}"}
        attempts, answered_by = 0, None
        while answered_by is None:
            survivor = survivors[attempts % len(survivors)]
            attempts += 1
            try:
                status, _ = await (await cluster.client(0, survivor)).post(join_path(room), body)
            except (OSError, asyncio.IncompleteReadError):
                cluster.drop_clients(survivor)
                status = 0
            if status == 200:
                answered_by = survivor
            elif status not in (0, 503):
                raise RuntimeError(f"takeover of {room}: answered {status}")
            elif time.monotonic() - killed_at > cluster.ttl_s + 30:
                raise RuntimeError(f"takeover of {room}: no answer {cluster.ttl_s + 30:.0f}s after the kill")
            else:
                await asyncio.sleep(RETRY_EVERY_S)
        took = time.monotonic() - killed_at
        assert node.server.proc is not None
        node.server.proc.wait(timeout=10)
        new_owner = cluster.owner_address(room)
        results.append(
            {"seconds": took, "attempts": attempts, "taken_by": cluster.nodes[answered_by].grpc_target == new_owner}
        )
        cluster.drop_clients(victim)
        if k + 1 < repeats:
            node.server.start(timeout_s=60)  # back for the next round (a new gRPC port)
    return results


# --------------------------------------------------------------------------- report


def fmt_ms(values: list[float]) -> str:
    return f"p50 {percentile(values, 0.5):6.2f} ms, p99 {percentile(values, 0.99):6.2f} ms"


def plural(n: int) -> str:
    return f"{n} process{'es' if n > 1 else '  '}"


async def run(args: argparse.Namespace) -> None:
    counts = sorted({int(x) for x in args.processes.split(",")})
    ttl_s = parse_duration(args.ttl).total_seconds()
    outbox = not args.no_outbox
    measured: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
    bare_cps: list[float] = []
    for round_ in range(args.rounds):
        order = counts if round_ % 2 == 0 else counts[::-1]  # interleaved: a slow minute hurts every count
        for n in order:
            async with running_cluster(n, ttl_s=ttl_s, outbox=outbox) as cluster:
                result = await throughput(
                    cluster, rooms=args.rooms, commands=args.commands, concurrency=args.concurrency
                )
                measured[n].append(result)
                cpu = result["cpu"]
                print(
                    f"[throughput] round {round_ + 1}, {plural(n)}: {result['cps']:7.0f} cmd/s  "
                    f"{fmt_ms(result['latencies'])}  503-retries {result['retries']}  "
                    f"rooms not on their process {result['misplaced']}/{args.rooms}  "
                    f"CPU: servers {cpu['servers'] / result['elapsed']:.2f} cores "
                    f"({cpu['servers'] / args.commands * 1000:.2f} ms a command), "
                    f"client {cpu['client'] / result['elapsed']:.2f} cores",
                    flush=True,
                )
                sizes = await row_sizes(cluster.database_url)
                if round_ == 0 and n == counts[-1] and n >= 2:  # the largest cluster: the hop and the takeover
                    await hop_and_takeover(cluster, args)
            if n == order[0]:  # once a round, between clusters: nothing else of ours runs
                async with fresh_database("mariadb") as url:
                    bare = await bare_run(url, args.commands, sizes, concurrency=args.concurrency)
                bare_cps.append(bare["cps"])
                print(
                    f"[throughput] round {round_ + 1}, bare-driver baseline (asyncmy, concurrency "
                    f"{args.concurrency}, the same transaction, row sizes {sizes}): {bare['cps']:7.0f} tx/s",
                    flush=True,
                )
    baseline = statistics.median(bare_cps)
    first = statistics.median(r["cps"] for r in measured[counts[0]])
    for n, results in measured.items():
        cps = statistics.median(r["cps"] for r in results)
        cpu_ms = statistics.median(r["cpu"]["servers"] / args.commands * 1000 for r in results)
        print(
            f"[throughput] median of {len(results)}, {plural(n)}: {cps:7.0f} cmd/s, "
            f"ratio to the baseline ({baseline:.0f} tx/s) {cps / baseline:.2f}x, "
            f"to {plural(counts[0]).strip()} {cps / first:.2f}x; server CPU {cpu_ms:.2f} ms a command"
        )


async def hop_and_takeover(cluster: Cluster, args: argparse.Namespace) -> None:
    lat = await forwarded_latency(cluster, samples=args.latency_samples)
    local, fwd = lat["local"], lat["forwarded"]
    print(f"[forwarding] local     ({len(local)} commands, one at a time): {fmt_ms(local)}")
    print(f"[forwarding] forwarded ({len(fwd)} commands, one at a time): {fmt_ms(fwd)}")
    print(
        f"[forwarding] added by the hop: p50 {percentile(fwd, 0.5) - percentile(local, 0.5):+.2f} ms, "
        f"p99 {percentile(fwd, 0.99) - percentile(local, 0.99):+.2f} ms "
        f"(ratio p50 {percentile(fwd, 0.5) / percentile(local, 0.5):.2f}x)",
        flush=True,
    )
    if not args.takeovers:
        return
    taken = await takeovers(cluster, repeats=args.takeovers)
    seconds = [r["seconds"] for r in taken]
    print(
        f"[takeover] kill -9 of the owner -> a command answered 200 by a survivor, {len(seconds)} times "
        f"({len(cluster.nodes)} processes): min {min(seconds):.2f} s, median {statistics.median(seconds):.2f} s, "
        f"max {max(seconds):.2f} s; lease.ttl {cluster.ttl_s:g} s, renew_every {cluster.renew_every_s:g} s "
        f"(the lease had {cluster.ttl_s - cluster.renew_every_s:g}..{cluster.ttl_s:g} s left at the kill; "
        f"median / ttl {statistics.median(seconds) / cluster.ttl_s:.2f}); "
        f"the answering process holds the new lease: {all(r['taken_by'] for r in taken)}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", default="1,2,3", help="comma-separated process counts for the throughput runs")
    parser.add_argument("--rooms", type=int, default=60)
    parser.add_argument("--commands", type=int, default=6_000)
    parser.add_argument("--concurrency", type=int, default=48, help="client lanes, one command in flight each")
    parser.add_argument("--latency-samples", type=int, default=400)
    parser.add_argument("--takeovers", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="throughput rounds, the order of counts alternating")
    parser.add_argument("--ttl", default="10s", help="lease.ttl (renew_every 0.3 x ttl, safety_margin 0.2 x ttl)")
    parser.add_argument("--no-outbox", action="store_true", help="outbox worker off (default: mq on NATS)")
    args = parser.parse_args()
    load = os.getloadavg()
    print(
        f"scale-out benchmark: MariaDB + Redis + {'NATS' if not args.no_outbox else 'no broker (outbox off)'}; "
        f"{os.cpu_count()} cores (servers, MariaDB, Redis, NATS and this client share them); "
        f"load average {load[0]:.2f}; python {sys.version.split()[0]}",
        flush=True,
    )
    # SIGTERM as Ctrl-C: the clusters stop and their database, Redis keys and streams are removed
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
