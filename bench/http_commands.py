"""Benchmark of the HTTP API (issue 12, item 4): command rate against the same server's own floor.

For each server below, a real ``room-service serve`` child process is driven from
this process by a minimal HTTP/1.1 keep-alive client (:class:`KeepAliveClient`,
one connection per concurrent caller, 64 by default), the same client for every
figure:

  * the floor: ``GET /healthz`` (no pipeline, no database);
  * ``JoinRoom`` commands over 100 rooms, then ``SendGift`` commands (each joined
    user sends one rose to the owner; a wallet debit per gift);
  * ratio = commands/s / the same server's /healthz req/s (targets: >= 0.5 with the
    outbox worker off, >= 0.25 for the embedded default); beside it the server
    process's own CPU time per request (all threads, from /proc), and the same
    ratio in CPU (healthz's CPU per request / the command's), which a loaded
    machine disturbs far less than rates;
  * the phases are cut into slices (``--slices``, 4 by default) taken in turn,
    healthz, join, gift, healthz, join, gift, ...: the machine is shared, its
    speed drifts over a run, and a floor measured in one stretch and the commands
    in the next would carry that drift into the ratio. A healthz slice starts
    once the server is idle (what its worker owed for the commands before is
    delivered), as the one healthz stretch used to start.

Servers:
  * ``worker-off``: SQLite, the outbox worker off, logging at info (one
    room_command_timing line per command, to the server's log file);
  * ``embedded``: ``room-service serve`` with no --config, exactly as a newcomer
    runs it (the packaged configs/local.yaml: outbox worker in mq mode on the
    embedded broker, its four consumer groups, the IM sandbox, the activity
    service and the embedded wallet, all in the one process), started in an empty
    directory.

Before it exits, each server's outbox is not checked: with the worker on, delivery
runs on behind the commands (the figure is the command rate the server sustains
while its in-process parts keep up or fall behind; the server's stderr shows any error).

    .venv/bin/python -m bench.http_commands [--servers worker-off,embedded] [--commands N] [--rounds R]
        [--concurrency C] [--slices S] [--profile DIR]   # --profile: py-spy record of each phase (one slice)
        [--instructions]   # instructions per request under callgrind (bench/callgrind.py), not rates
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import callgrind
from bench.common import percentile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.e2e.server import ServerProcess, write_config  # noqa: E402

APP = "bench"
ROOMS = 100


class KeepAliveClient:
    """A minimal HTTP/1.1 keep-alive client on one connection.

    httpx's pool, shared by 64 concurrent requests, costs more CPU than the
    server it measures (measured: /healthz at concurrency 64 gave 190 req/s
    through httpx and 3,087 req/s through this), so every HTTP figure is taken
    with this client, one connection per concurrent caller.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, port: int) -> KeepAliveClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
        if body is None:
            self.writer.write(f"{method} {path} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
        else:
            data = json.dumps(body).encode()
            self.writer.write(
                f"{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n".encode() + data
            )
        await self.writer.drain()
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        length = next(int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length"))
        return status, await self.reader.readexactly(length)

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        return await self.request("POST", path, body)

    def close(self) -> None:
        self.writer.close()


Request = tuple[str, str, "dict[str, Any] | None"]


async def drive(clients: list[KeepAliveClient], requests: list[Request]) -> dict[str, Any]:
    """Send every request, one lane per client; rate, latencies and any answer that was not 200."""
    jobs = iter(requests)
    latencies: list[float] = []
    failures: list[str] = []

    async def lane(client: KeepAliveClient) -> None:
        for method, path, body in jobs:
            started = time.perf_counter()
            status, answer = await client.request(method, path, body)
            latencies.append((time.perf_counter() - started) * 1000)
            if status != 200 and len(failures) < 5:
                failures.append(f"{status} {answer[:200]!r}")

    start = time.perf_counter()
    await asyncio.gather(*(lane(client) for client in clients))
    elapsed = time.perf_counter() - start
    return {"rate": len(requests) / elapsed, "latencies": latencies, "failures": failures}


def healthz(n: int) -> list[Request]:
    return [("GET", "/healthz", None)] * n


def joins(n: int, tag: str) -> list[Request]:
    return [("POST", f"/v1/apps/{APP}/rooms/{tag}h{i % ROOMS}/join", {"command_id": f"{tag}j{i}",
                                                                    "user_id": f"{tag}u{i}"}) for i in range(n)]


def gifts(n: int, tag: str) -> list[Request]:
    return [("POST", f"/v1/apps/{APP}/rooms/{tag}h{i % ROOMS}/gifts",
             {"command_id": f"{tag}g{i}", "sender_id": f"{tag}u{i}", "receiver_id": "o", "gift_id": "rose",
              "count": 1}) for i in range(n)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU of process ``pid`` and all its threads so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


KEEP_ALIVE_S = 2.0  # well inside uvicorn's keep-alive timeout (5 s)


async def quiet(pid: int, *, below: float = 0.05, within_s: float = 60.0) -> float:
    """Until process ``pid`` uses less than ``below`` of a core over 200 ms: the delivery a server with
    its outbox worker on (the embedded default) still owes for the commands sent, done. The seconds
    it waited."""
    started = time.monotonic()
    while time.monotonic() - started < within_s:
        before = cpu_seconds(pid)
        await asyncio.sleep(0.2)
        if cpu_seconds(pid) - before < below * 0.2:
            break
    return time.monotonic() - started


async def measure(port: int, *, commands: int, concurrency: int, tag: str, slices: int = 1,
                  on_phase: Callable[[str], None] = lambda _: None,
                  pid: int | None = None, floor: int | None = None) -> dict[str, dict[str, Any]]:
    """The three phases, each cut into ``slices`` taken in turn (healthz, join, gift, healthz, join,
    gift, ...): a machine whose speed drifts (other tenants) meets every phase alike. Each slice of
    gifts is sent by the users the slice of joins before it let in. Rates, latencies and CPU are
    summed over a phase's slices. Each healthz slice waits for the server to be idle first (:func:`quiet`):
    with the worker on, the deliveries still owed for the last gifts would otherwise run in it."""
    clients = [await KeepAliveClient.connect(port) for _ in range(concurrency)]
    try:
        for r in range(ROOMS):
            body = {"command_id": f"{tag}c{r}", "room_id": f"{tag}h{r}", "owner_id": "o", "title": "t"}
            status, answer = await clients[0].post(f"/v1/apps/{APP}/rooms", body)
            assert status == 200, answer
        await drive(clients, healthz(concurrency * 20))  # warm-up: every connection accepted and used
        floor = max(commands, 3_000) if floor is None else floor  # a rate needs a long enough floor
        phases = {"healthz": healthz(floor), "join": joins(commands, tag), "gift": gifts(commands, tag)}
        totals: dict[str, dict[str, Any]] = {
            phase: {"seconds": 0.0, "latencies": [], "failures": [], "cpu_s": 0.0, "n": 0} for phase in phases
        }
        for part in range(slices):
            for phase, requests in phases.items():
                share = requests[len(requests) * part // slices : len(requests) * (part + 1) // slices]
                if phase == "healthz" and pid and await quiet(pid) > KEEP_ALIVE_S:
                    # the floor on an idle server, as in one stretch before any command; connections left
                    # idle that long may have been closed by the server: new ones, warmed up
                    for client in clients:
                        client.close()
                    clients[:] = [await KeepAliveClient.connect(port) for _ in range(concurrency)]
                    await drive(clients, healthz(concurrency * 20))
                on_phase(phase)
                cpu = cpu_seconds(pid) if pid else 0.0
                done = await drive(clients, share)
                on_phase("done")  # the phase ends with its requests: a wait or warm-up after it is not in it
                total = totals[phase]
                total["seconds"] += len(share) / done["rate"]
                total["latencies"] += done["latencies"]
                total["failures"] += done["failures"][: 5 - len(total["failures"])]
                # the server's own CPU per request: much steadier than rates on a shared machine
                total["cpu_s"] += cpu_seconds(pid) - cpu if pid else 0.0
                total["n"] += len(share)
        on_phase("done")
        return {
            phase: {
                "rate": t["n"] / t["seconds"],
                "latencies": t["latencies"],
                "failures": t["failures"],
                "cpu_us": t["cpu_s"] / t["n"] * 1e6,
                "n": t["n"],
            }
            for phase, t in totals.items()
        }
    finally:
        for client in clients:
            client.close()


SERVERS = ("worker-off", "embedded")


def start_server(kind: str, tmp: Path, wrapper: list[str] | None = None) -> ServerProcess:
    if kind == "worker-off":
        config = write_config(tmp / "c.yaml", extra="outbox_worker: {enabled: false}\n")
        config.write_text(config.read_text().replace("level: warning", "level: info"))
        server = ServerProcess(config=config, data_dir=tmp / "data", wrapper=wrapper)
    elif kind == "embedded":  # no --config, no --data-dir: the packaged local.yaml, ./var in an empty dir
        cwd = tmp / "newcomer"
        cwd.mkdir()
        server = ServerProcess(config=None, data_dir=cwd / "var", cwd=cwd, wrapper=wrapper)
    else:
        raise ValueError(kind)
    server.start(timeout_s=300 if wrapper else 60)  # under valgrind start-up takes ~20 s here
    return server


class Profiler:
    """py-spy record of the server process for one phase (root on this machine, so ptrace works);
    read a profile with speedscope, or ``python -m bench.spy_summary FILE``."""

    def __init__(self, pid: int, out_dir: Path | None, name: str) -> None:
        self.pid, self.out_dir, self.name = pid, out_dir, name
        self.proc: subprocess.Popen[bytes] | None = None

    def phase(self, phase: str) -> None:
        if self.proc is not None:
            self.proc.send_signal(2)  # SIGINT: py-spy writes its output and exits
            self.proc.wait(timeout=60)
            self.proc = None
        if self.out_dir is None or phase in ("done", "healthz"):
            return
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        out = self.out_dir / f"{self.name}-{phase}.speedscope.json"
        # --gil: only the thread holding the GIL is sampled, so the profile shows where the Python
        # CPU goes (the event loop and the database threads share one GIL)
        self.proc = subprocess.Popen([spy, "record", "--pid", str(self.pid), "--rate", "200", "--gil", "--format",
                                      "speedscope", "-o", str(out)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)


def run_server(kind: str, *, commands: int, concurrency: int, round_: int, profile: Path | None,
               slices: int = 1, instructions: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="roombench-http-") as tmp:
        counts = Path(tmp) / "callgrind"
        counts.mkdir()
        server = start_server(kind, Path(tmp), callgrind.callgrind_prefix(counts) if instructions else None)
        counter: callgrind.PhaseCounter | None = None
        try:
            assert server.proc is not None
            counter = callgrind.PhaseCounter(server.proc.pid, counts) if instructions else None
            on_phase = (counter or Profiler(server.proc.pid, profile, f"{kind}-r{round_}")).phase
            figures = asyncio.run(measure(server.port, commands=commands, concurrency=concurrency, slices=slices,
                                          tag=f"r{round_}", on_phase=on_phase, pid=server.proc.pid,
                                          floor=commands if instructions else None))
        finally:
            server.stop()
        if counter is not None:
            for phase, count in counter.totals().items():
                figures[phase]["instructions"] = count / figures[phase]["n"]
        return figures


def report(kind: str, round_: int, figures: dict[str, dict[str, Any]], target: float) -> None:
    floor = figures["healthz"]["rate"]
    floor_cpu = figures["healthz"]["cpu_us"]
    parts = [f"healthz {floor:6.0f} req/s (p99 {percentile(figures['healthz']['latencies'], 0.99):.0f} ms, "
             f"server CPU {floor_cpu:.0f} us/req)"]
    for phase in ("join", "gift"):
        f = figures[phase]
        lat = f["latencies"]
        cpu_ratio = floor_cpu / f["cpu_us"] if f["cpu_us"] else 0.0
        parts.append(f"{phase} {f['rate']:5.0f} cmd/s = {f['rate'] / floor:.2f}x healthz "
                     f"(p50 {percentile(lat, 0.5):.0f} / p99 {percentile(lat, 0.99):.0f} ms, "
                     f"server CPU {f['cpu_us']:.0f} us/cmd = {cpu_ratio:.2f}x healthz's)")
        if f["failures"]:
            parts.append(f"{phase} FAILURES: {f['failures']}")
    print(f"[http/{kind}] round {round_}: " + "   ".join(parts) + f"   (target >= {target:.2f}x)", flush=True)


def report_instructions(kind: str, round_: int, figures: dict[str, dict[str, Any]], target: float) -> None:
    """Instructions per request (callgrind: user space, the same count for the same work on a busy machine)."""
    floor = figures["healthz"]["instructions"]
    parts = [f"healthz {floor / 1e3:7.1f}k instructions/req"]
    for phase in ("join", "gift"):
        f = figures[phase]
        parts.append(f"{phase} {f['instructions'] / 1e3:7.1f}k/cmd = "
                     f"healthz's / {phase}'s {floor / f['instructions']:.3f}x")
        if f["failures"]:
            parts.append(f"{phase} FAILURES: {f['failures']}")
    print(f"[http/{kind} instructions] round {round_}: " + "   ".join(parts)
          + f"   (the target, in rates: >= {target:.2f}x)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--commands", type=int, default=3_000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--profile", type=Path, default=None, help="directory for py-spy speedscope profiles")
    parser.add_argument("--slices", type=int, default=4,
                        help="each phase in this many slices, taken in turn with the others' (1 with --profile)")
    parser.add_argument("--instructions", action="store_true",
                        help="run each server under valgrind's callgrind and print instructions per request instead "
                             "of rates (bench/callgrind.py; use --commands 600 or so: ~50x slower)")
    args = parser.parse_args()
    if args.slices < 1:
        parser.error("--slices must be at least 1")
    if args.instructions and args.profile:
        parser.error("--instructions and --profile: one at a time")
    if args.instructions and (missing := callgrind.available()):
        parser.error(f"--instructions needs valgrind: missing {missing}")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        args.slices = 1  # one profile a phase: the profiler writes a file per phase it is told of
    print(f"HTTP benchmark: {args.commands} commands per phase in {args.slices} slices taken in turn, "
          f"concurrency {args.concurrency}, {ROOMS} rooms; "
          f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}",
          flush=True)
    for round_ in range(1, args.rounds + 1):
        for kind in args.servers.split(","):
            figures = run_server(kind, commands=args.commands, concurrency=args.concurrency, round_=round_,
                                 profile=args.profile, slices=args.slices, instructions=args.instructions)
            target = 0.5 if kind == "worker-off" else 0.25
            (report_instructions if args.instructions else report)(kind, round_, figures, target)


if __name__ == "__main__":
    main()
