"""One process, an in-memory exporter: a gift's trace from the HTTP request to the leaderboard effect.

The request's server span continues the caller's traceparent; the command's span
has one child per stage of room_command_timing; the outbox row stores the
command's context, which the worker's delivery span continues (in mq mode, on the
embedded broker, and in direct mode), also after a restart; the broker message's
headers carry the publish span's context to the activity group's consumer span.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NoOpTracer, SpanKind, StatusCode
from structlog.testing import capture_logs
from tests.service.conftest import DIRECT, make_settings
from tests.tracing.conftest import hex_id, hex_trace, new_traceparent, of_trace, one, parent_id, traceparent_of

from roomservice.activity.store import ActivityStore
from roomservice.api.app import ApiContext, create_app
from roomservice.bootstrap import API, MAINTENANCE, OUTBOX, Process
from roomservice.domain import commands as c
from roomservice.domain.state import utc_day
from roomservice.observability import tracing
from roomservice.store import tables as t

APP = "demo"
ACTIVITY = "hyapp-activity-room-outbox"
PROBE = "tracing-probe"
MQ_ACTIVITY = {
    "outbox_worker.publish_mode": "mq",
    "broker.driver": "embedded",
    "rocketmq.room_outbox.enabled": True,
    "rocketmq.room_outbox.tencent_im_consumer_enabled": False,
    "rocketmq.treasure_open.enabled": False,
    "consumers.activity.enabled": True,
    "consumers.notice.enabled": False,
}
STAGES_OF_A_GIFT = {"lease", "idempotency", "wallet_debit", "save_mutation", "projection"}


async def eventually(check: Callable[[], Awaitable[bool]], *, deadline_s: float = 20.0, what: str = "") -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not in time: {what}")


def client(rt: Process) -> httpx.AsyncClient:
    app = create_app(ApiContext(service=rt.service, health=rt.health, admin_token="t"))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://room.test")


async def gift_over_http(http: httpx.AsyncClient, room: str, traceparent: str | None) -> str:
    """Create the room, join, send a gift (with ``traceparent``); the gift's event id."""
    base = f"/v1/apps/{APP}/rooms"
    assert (
        await http.post(base, json={"command_id": "c1", "room_id": room, "owner_id": "alice", "title": "t"})
    ).is_success
    assert (await http.post(f"{base}/{room}/join", json={"command_id": "c2", "user_id": "bob"})).is_success
    headers = {"traceparent": traceparent} if traceparent else {}
    body = {"command_id": "c3", "sender_id": "bob", "receiver_id": "alice", "gift_id": "rose", "count": 2}
    answer = await http.post(f"{base}/{room}/gifts", json=body, headers=headers)
    assert answer.status_code == 200, answer.text
    (event,) = [e for e in answer.json()["events"] if e["type"] == "RoomGiftSent"]
    return str(event["event_id"])


async def leaderboard(rt: Process, room: str) -> list[tuple[str, int]]:
    board = await ActivityStore(rt.db).gift_leaderboard(
        app_code=APP, room_id=room, day=utc_day(rt.service.clock()), board="received", limit=10
    )
    return [(e.user_id, e.value) for e in board]


async def stored_context(rt: Process, event_id: str) -> str | None:
    async with rt.db.read() as conn:
        value = await conn.scalar(sa.select(t.room_outbox.c.trace_context).where(t.room_outbox.c.event_id == event_id))
    return None if value is None else str(value)


@pytest.fixture
async def mq_process(tmp_path: Path) -> AsyncIterator[Process]:
    settings = make_settings(f"sqlite+aiosqlite:///{tmp_path}/room.db", tmp_path, **MQ_ACTIVITY)
    async with Process.running(settings) as rt:
        assert rt.broker is not None
        await rt.broker.declare_group("hyapp_room_outbox", PROBE, max_deliveries=3)
        yield rt


async def test_one_gift_is_one_trace_from_the_request_to_the_leaderboard(
    spans: InMemorySpanExporter, mq_process: Process
) -> None:
    rt = mq_process
    traceparent, trace_id, caller = new_traceparent()
    with capture_logs() as logs:
        async with client(rt) as http:
            event_id = await gift_over_http(http, "r1", traceparent)

    async def effect_traced() -> bool:
        return any(s.name == "activity.apply" and hex_trace(s) == trace_id for s in spans.get_finished_spans())

    await eventually(effect_traced, what="the activity group's effect span")
    assert await leaderboard(rt, "r1") == [("alice", 20)]
    trace = of_trace(spans, trace_id)

    request = one(trace, "POST /v1/apps/{app_code}/rooms/{room_id}/gifts")
    assert request.kind is SpanKind.SERVER and parent_id(request) == caller
    assert (request.attributes or {})["http.response.status_code"] == 200
    command = one(trace, "room.command SendGift")
    assert parent_id(command) == hex_id(request)
    assert (command.attributes or {})["room.command_id"] == "c3"

    # the stages: exactly those room_command_timing measured (> 0), each as long as it says
    (timing,) = [line for line in logs if line["event"] == "room_command_timing" and line["command_id"] == "c3"]
    stages = {s.name.removeprefix("room.stage."): s for s in trace if s.name.startswith("room.stage.")}
    assert (
        set(stages)
        == STAGES_OF_A_GIFT
        == {k.removesuffix("_ms") for k, v in timing.items() if k.endswith("_ms") and k != "total_ms" and v > 0}
    )
    for name, stage in stages.items():
        assert parent_id(stage) == hex_id(command)
        assert stage.start_time is not None and stage.end_time is not None and command.start_time is not None
        assert command.start_time <= stage.start_time <= stage.end_time <= (command.end_time or 0)
        assert abs((stage.end_time - stage.start_time) / 1e6 - timing[f"{name}_ms"]) < 0.01

    # the row stored the command's context; the worker's attempt continues it
    assert await stored_context(rt, event_id) == traceparent_of(command)
    deliver = one(trace, "outbox.deliver RoomGiftSent")
    assert parent_id(deliver) == hex_id(command)
    assert (deliver.attributes or {})["outbox.delivered"] is True
    publish = one(trace, "hyapp_room_outbox publish", **{"messaging.message.id": event_id})
    assert publish.kind is SpanKind.PRODUCER and parent_id(publish) == hex_id(deliver)

    # the broker message carries the publish span's context in its headers
    assert rt.broker is not None
    probe = await rt.broker.fetch("hyapp_room_outbox", PROBE, max_messages=50, wait_s=0.5, visibility_s=30)
    (message,) = [d for d in probe if d.key == event_id]
    assert message.headers["traceparent"] == traceparent_of(publish)

    consume = one(trace, f"consume {ACTIVITY}", **{"messaging.message.id": event_id})
    assert consume.kind is SpanKind.CONSUMER and parent_id(consume) == hex_id(publish)
    assert (consume.attributes or {})["consumer.outcome"] == "applied"
    effect = one(trace, "activity.apply")
    assert parent_id(effect) == hex_id(consume)
    # nothing else of the trace is a root or hangs off a span outside it
    ids = {hex_id(s) for s in trace} | {caller}
    assert all(parent_id(s) in ids for s in trace)


async def test_a_command_without_an_incoming_traceparent_starts_its_own_trace(
    spans: InMemorySpanExporter, mq_process: Process
) -> None:
    async with client(mq_process) as http:
        await gift_over_http(http, "r2", None)
    request = one(spans.get_finished_spans(), "POST /v1/apps/{app_code}/rooms/{room_id}/gifts")
    assert request.parent is None
    command = one(spans.get_finished_spans(), "room.command SendGift")
    assert hex_trace(command) == hex_trace(request) and parent_id(command) == hex_id(request)


async def test_a_refused_command_is_a_failed_span_with_its_error_code(
    spans: InMemorySpanExporter, mq_process: Process, caplog: pytest.LogCaptureFixture
) -> None:
    async with client(mq_process) as http:
        answer = await http.post(f"/v1/apps/{APP}/rooms/nowhere/join", json={"command_id": "j1", "user_id": "bob"})
    assert answer.status_code == 404
    command = one(spans.get_finished_spans(), "room.command JoinRoom")
    assert command.status.status_code is StatusCode.ERROR and command.status.description == "room_not_found"
    assert (command.attributes or {})["room.result"] == "room_not_found"
    request = one(spans.get_finished_spans(), "POST /v1/apps/{app_code}/rooms/{room_id}/join")
    assert (request.attributes or {})["http.response.status_code"] == 404
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry")]  # the SDK had nothing to complain of


async def test_a_direct_mode_rows_delivery_continues_the_commands_trace(
    spans: InMemorySpanExporter, tmp_path: Path
) -> None:
    settings = make_settings(f"sqlite+aiosqlite:///{tmp_path}/room.db", tmp_path, **DIRECT)
    async with Process.running(settings) as rt:
        await rt.service.execute(APP, "d1", "c1", c.CreateRoom(owner_id="alice", title="direct"))
        await rt.service.execute(APP, "d1", "c2", c.JoinRoom(user_id="bob"))
        body = await rt.service.execute(
            APP, "d1", "c3", c.SendGift(sender_id="bob", receiver_id="alice", gift_id="rose", count=1)
        )
        (event_id,) = [e["event_id"] for e in body["events"] if e["type"] == "RoomGiftSent"]
        command = one(spans.get_finished_spans(), "room.command SendGift")
        assert command.parent is None  # no request span: the command is the root

        async def delivered() -> bool:
            return any(s.name == "outbox.deliver RoomGiftSent" for s in spans.get_finished_spans())

        await eventually(delivered, what="the direct delivery span")
    deliver = one(spans.get_finished_spans(), "outbox.deliver RoomGiftSent")
    assert hex_trace(deliver) == hex_trace(command) and parent_id(deliver) == hex_id(command)
    assert (deliver.attributes or {})["outbox.event_id"] == event_id
    assert set((deliver.attributes or {})["outbox.targets_done"]) == {"activity", "im"}
    # the activity service's side of the gRPC call continues the delivery's trace
    handled = [
        s for s in spans.get_finished_spans() if s.name == "roomservice.activity.v1.ActivityService/HandleRoomEvent"
    ]
    server = next(s for s in handled if parent_id(s) == hex_id(deliver))
    assert server.kind is SpanKind.SERVER and hex_trace(server) == hex_trace(command)
    effects = [s for s in spans.get_finished_spans() if s.name == "activity.apply" and parent_id(s) == hex_id(server)]
    assert [(e.attributes or {})["activity.event_type"] for e in effects] == ["RoomGiftSent"]


async def test_a_treasure_wake_up_continues_the_countdowns_trace_to_the_open_command(
    spans: InMemorySpanExporter, tmp_path: Path
) -> None:
    overrides = {**MQ_ACTIVITY, "rocketmq.treasure_open.enabled": True, "treasure.countdown_seconds": 1}
    settings = make_settings(f"sqlite+aiosqlite:///{tmp_path}/room.db", tmp_path, **overrides)
    async with Process.running(settings) as rt:
        await rt.service.execute(APP, "b1", "c1", c.CreateRoom(owner_id="alice", title="box"))
        await rt.service.execute(APP, "b1", "c2", c.JoinRoom(user_id="bob"))
        await rt.service.execute(
            APP, "b1", "c3", c.SendGift(sender_id="bob", receiver_id="alice", gift_id="rocket", count=1)
        )

        async def opened() -> bool:
            return any(s.name == "room.command OpenTreasure" for s in spans.get_finished_spans())

        await eventually(opened, what="the box opened by its wake-up")
    finished = spans.get_finished_spans()
    gift = one(finished, "room.command SendGift")
    trace = of_trace(spans, hex_trace(gift))
    countdown = one(trace, "outbox.deliver RoomTreasureCountdownStarted")
    assert parent_id(countdown) == hex_id(gift)
    wakeup = one(trace, "consume hyapp-room-treasure-open")
    assert parent_id(wakeup) == hex_id(countdown)
    open_command = one(trace, "room.command OpenTreasure")
    assert parent_id(open_command) == hex_id(wakeup)


async def test_the_trace_context_survives_a_worker_restart_in_the_row(
    spans: InMemorySpanExporter, database_url: str, tmp_path: Path
) -> None:
    settings = make_settings(database_url, tmp_path, **DIRECT)
    # no loops: the worker never runs before this process stops
    async with Process.running(settings, roles=(API, MAINTENANCE, OUTBOX), loops=False) as rt:
        await rt.service.execute(APP, "w1", "c1", c.CreateRoom(owner_id="alice", title="restart"))
        command = one(spans.get_finished_spans(), "room.command CreateRoom")
        async with rt.db.read() as conn:
            (stored,) = (await conn.execute(sa.select(t.room_outbox.c.trace_context, t.room_outbox.c.status))).all()
        assert tuple(stored) == (traceparent_of(command), "pending")
    assert not [s for s in spans.get_finished_spans() if s.name.startswith("outbox.deliver")]
    spans.clear()

    async with Process.running(settings) as rt:  # a new worker (new owner) takes the row

        async def delivered() -> bool:
            return any(s.name == "outbox.deliver RoomCreated" for s in spans.get_finished_spans())

        await eventually(delivered, what="the row delivered after the restart")
    deliver = one(spans.get_finished_spans(), "outbox.deliver RoomCreated")
    assert hex_trace(deliver) == hex_trace(command) and parent_id(deliver) == hex_id(command)


async def test_grpc_requests_continue_the_callers_traceparent(spans: InMemorySpanExporter, tmp_path: Path) -> None:
    import grpc.aio

    from roomservice.proto import room_api_pb2 as pb
    from roomservice.proto import room_api_pb2_grpc as pb_grpc

    settings = make_settings(f"sqlite+aiosqlite:///{tmp_path}/room.db", tmp_path, **DIRECT)
    traceparent, trace_id, caller = new_traceparent()
    async with Process.running(settings, room_api=True, loops=False) as rt:
        assert rt.room_api is not None
        async with grpc.aio.insecure_channel(rt.room_api.target) as channel:
            stub = pb_grpc.RoomApiStub(channel)
            request = pb.CreateRoomRequest(app_code=APP, room_id="g1", command_id="c1", owner_id="alice", title="g")
            await stub.CreateRoom(request, metadata=(("traceparent", traceparent),))
    trace = of_trace(spans, trace_id)
    server = one(trace, "roomservice.v1.RoomApi/CreateRoom")
    assert server.kind is SpanKind.SERVER and parent_id(server) == caller
    assert parent_id(one(trace, "room.command CreateRoom")) == hex_id(server)


async def test_exporter_none_installs_nothing_creates_no_span_and_stores_no_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_span(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a span was started with tracing off")

    # not even a no-op span: every hook checks tracing.ENABLED first
    monkeypatch.setattr(NoOpTracer, "start_span", no_span)
    monkeypatch.setattr(NoOpTracer, "start_as_current_span", no_span)
    settings = make_settings(f"sqlite+aiosqlite:///{tmp_path}/room.db", tmp_path, **MQ_ACTIVITY)
    assert settings.tracing.exporter == "none"
    async with Process.running(settings) as rt:
        assert tracing.ENABLED is False and isinstance(tracing.tracer(), NoOpTracer)
        assert tracing.current_traceparent() is None and tracing.inject({"a": "b"}) == {"a": "b"}
        assert rt.broker is not None
        await rt.broker.declare_group("hyapp_room_outbox", PROBE, max_deliveries=3)
        traceparent, _, _ = new_traceparent()
        async with client(rt) as http:
            event_id = await gift_over_http(http, "n1", traceparent)

        async def applied() -> bool:
            return await leaderboard(rt, "n1") == [("alice", 20)]

        await eventually(applied, what="the gift on the leaderboard")
        assert await stored_context(rt, event_id) is None
        probe = await rt.broker.fetch("hyapp_room_outbox", PROBE, max_messages=50, wait_s=0.5, visibility_s=30)
        (message,) = [d for d in probe if d.key == event_id]
        assert "traceparent" not in message.headers
