"""What each piece of a JoinRoom costs on its own, with a real join's inputs (issue 12, stop 23).

A room of ``--members`` members is built by the domain's own decide / stamp /
replay; then every piece of a join's path runs ``--loops`` times in a hot loop:
the answer (room view and its encoding), decide, stamp, replay, the request
body's parse and validation, the command log and outbox rows, the fingerprint,
the ``room_command_timing`` line and the command's metrics. Printed per call:

  * by default, microseconds (best of five ``timeit`` repeats; moves with the machine);
  * with ``--instructions``, instructions counted by callgrind (this script re-runs
    itself under valgrind, instrumentation on for each piece's loop only; the same count
    for the same code however busy the machine is: for comparing two versions).

In the server the same pieces run cold, interleaved with 63 other requests, and
cost more; the whole request is ``bench.http_commands`` (``--instructions`` too).

    .venv/bin/python -m bench.command_pieces [--members 30] [--loops 2000] [--instructions]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import subprocess
import sys
import tempfile
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import callgrind
from roomservice.api import json_body
from roomservice.api import schemas as s
from roomservice.domain import commands as c
from roomservice.domain import view
from roomservice.domain.decider import decide, replay, stamp
from roomservice.domain.events import new_event_id
from roomservice.domain.rules import RoomRules
from roomservice.domain.view import room_view
from roomservice.observability.logging import configure_logging
from roomservice.observability.metrics import COMMAND_METRICS
from roomservice.observability.timing import CommandTiming
from roomservice.service import answer_body, fingerprint, stored_timing
from roomservice.store import sql
from roomservice.store.port import Answer, Mutation

NOW = 1_764_000_000_000
APP, ROOM = "bench", "r0h1"
_UNDER_CALLGRIND = "ROOMBENCH_PIECES_UNDER_CALLGRIND"  # set by the parent for the re-run under valgrind


def pieces(members: int) -> dict[str, Callable[[], Any]]:
    """Each piece of a join, as a call on prepared inputs: a room of ``members`` members and one more joining."""
    rules = RoomRules()
    state = None
    commands: list[c.Command] = [c.CreateRoom(owner_id="o", title="t")]
    commands += [c.JoinRoom(user_id=f"u{i}") for i in range(members - 1)]
    for i, command in enumerate(commands):
        events = stamp(decide(state, command, now_ms=NOW + i, rules=rules), state=state, app_code=APP, room_id=ROOM,
                       now_ms=NOW + i, new_event_id=new_event_id)
        state = replay(state, events)
    assert state is not None and len(state.members) == members
    before, join = state, c.JoinRoom(user_id="newcomer")
    payloads = decide(before, join, now_ms=NOW, rules=rules)
    events = stamp(payloads, state=before, app_code=APP, room_id=ROOM, now_ms=NOW, new_event_id=new_event_id)
    after = replay(before, events)
    assert after is not None
    levels = len(rules.treasure_levels)

    def answer() -> Answer:
        return answer_body(after, events, now_ms=NOW, level_count=levels)

    # a join's answer comes after the room's last view (the member entries it reuses, domain.view):
    # each call starts from the view of the room before the join, as the server's does
    room_view(before, now_ms=NOW, level_count=levels)
    key = (APP, ROOM)
    before_entries = view._recent[key]  # what the cache holds after the view of the room before the join

    def join_answer() -> Answer:
        view._keep(key, before_entries)
        return answer()

    def cold_answer() -> Answer:  # the room not among the last rooms answered: every entry built
        view._take(key)
        return answer()

    def join_view() -> dict[str, Any]:
        view._keep(key, before_entries)
        return room_view(after, now_ms=NOW, level_count=levels)

    timing = CommandTiming(command="JoinRoom", app_code=APP, room_id=ROOM, command_id="j1", version=after.version,
                           total_ms=1.2345, lease_ms=0.01234, save_mutation_ms=0.9876, projection_ms=0.0123,
                           idempotency_ms=0.0021)
    values = {"app_code": APP, "room_id": ROOM, "command_id": "j1", "command_type": "JoinRoom",
              "fingerprint": "0" * 64, "command": join.to_dict(), "events": events, "response": answer(),
              "expected_version": before.version, "now_ms": NOW, "epoch": 1, "state_after": after,
              "trace_context": None, "timing": stored_timing(timing), "attached": None}
    mutation = Mutation(**{f.name: values[f.name] for f in dataclasses.fields(Mutation) if f.name in values})
    body = b'{"command_id":"j1","user_id":"newcomer"}'
    stages = (0.0021, 0.01234, 0.0, 0.9876, 0.0, 0.0123, 1.2345)

    recorded = [0]

    def metrics() -> None:  # a turn's share: record, and the apply of the turn's 12 commands, a twelfth
        COMMAND_METRICS.record("JoinRoom", "ok", stages)
        recorded[0] += 1
        if recorded[0] % 12 == 0:
            COMMAND_METRICS.flush()

    return {
        "answer (view + encoding)": join_answer,
        "  room view": join_view,
        "  answer, members as last (gift)": answer,
        "  answer, room not in the cache": cold_answer,
        "decide": lambda: decide(before, join, now_ms=NOW, rules=rules),
        "stamp": lambda: stamp(payloads, state=before, app_code=APP, room_id=ROOM, now_ms=NOW,
                               new_event_id=new_event_id),
        "replay": lambda: replay(before, events),
        "body: parse + validate": lambda: s.JoinBody.model_validate(json_body.parse(body)).to_command(),
        "fingerprint": lambda: fingerprint(join, join.to_dict()),
        "command log row": lambda: sql._command_row(mutation, after),
        "outbox rows": lambda: [sql._outbox_row(ev, NOW, None) for ev in events],
        "room meta row": lambda: sql._meta_write(mutation, after),
        "stored timing": lambda: stored_timing(timing),
        "timing line + metrics (emit)": timing.emit,
        "  metrics": metrics,
    }


def run(members: int, loops: int, counter: callgrind.PhaseCounter | None) -> None:
    with tempfile.TemporaryDirectory(prefix="roombench-pieces-") as tmp, open(Path(tmp) / "log", "w") as log:
        configure_logging(level="info", json=True, file=log)  # the timing line as serve writes it: to a file
        table = pieces(members)
        for name, fn in table.items():
            if counter is None:
                best = min(timeit.repeat(fn, number=loops, repeat=5)) / loops
                print(f"  {name:32s} {best * 1e6:8.2f} us", flush=True)
            else:
                fn()  # first call outside the count (caches filled, as in a running server)
                counter.phase(name.strip())
                for _ in range(loops):
                    fn()
                counter.phase("done")
        if counter is not None:
            counts = counter.totals()
            for name in table:
                print(f"  {name:32s} {counts[name.strip()] / loops / 1e3:8.1f}k instructions", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, default=30, help="members of the room a newcomer joins")
    parser.add_argument("--loops", type=int, default=2_000)
    parser.add_argument("--instructions", action="store_true", help="count instructions under callgrind")
    args = parser.parse_args()
    if args.members < 1 or args.loops < 1:
        parser.error("--members and --loops must be at least 1")
    counts_dir = os.environ.get(_UNDER_CALLGRIND)
    if counts_dir is not None:  # the re-run under valgrind
        asyncio.run(_counted(args.members, args.loops, Path(counts_dir)))
        return
    print(f"A join's pieces, a room of {args.members} members, {args.loops} calls each "
          f"({'instructions under callgrind' if args.instructions else 'microseconds, best of 5'}); "
          f"python {sys.version.split()[0]}", flush=True)
    if not args.instructions:
        asyncio.run(_timed(args.members, args.loops))
        return
    if missing := callgrind.available():
        parser.error(f"--instructions needs valgrind: missing {missing}")
    with tempfile.TemporaryDirectory(prefix="roombench-callgrind-") as counts:
        subprocess.run([*callgrind.callgrind_prefix(Path(counts)), sys.executable, "-m", "bench.command_pieces",
                        "--members", str(args.members), "--loops", str(args.loops)],
                       env={**os.environ, _UNDER_CALLGRIND: counts}, check=True)


async def _timed(members: int, loops: int) -> None:
    run(members, loops, None)  # in a running loop, as in the server (the metrics' turn flush)


async def _counted(members: int, loops: int, counts: Path) -> None:
    run(members, loops, callgrind.PhaseCounter(os.getpid(), counts))


if __name__ == "__main__":
    main()
