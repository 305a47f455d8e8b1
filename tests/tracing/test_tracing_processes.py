"""Across processes: ``room-service serve`` and ``room-service consume`` as real processes, NATS between them.

Both use ``tracing.exporter: file`` with one shared file. A gift sent over HTTP
with a traceparent yields spans in both processes that all carry the request's
trace id: the request, the command and its stages, the outbox delivery and the
broker publish in the serving process; the activity group's consumer span and
its leaderboard effect in the consuming one, parented across the broker.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.e2e.server import ServerProcess, write_config
from tests.nats_server import drop_streams
from tests.tracing.conftest import new_traceparent

pytestmark = pytest.mark.slow

ACTIVITY = "hyapp-activity-room-outbox"


def broker_yaml(stream: str, namespace: str) -> str:
    return f"""
broker: {{driver: nats, nats: {{url: "nats://127.0.0.1:4222", stream: {stream}}}}}
rocketmq:
  namespace: {namespace}
  room_outbox: {{enabled: true, tencent_im_consumer_enabled: false}}
  treasure_open: {{enabled: false}}
"""


def tracing_yaml(path: Path, service: str) -> str:
    return f"""
tracing: {{exporter: file, service_name: {service}, file: {{path: "{path}"}}}}
"""


@pytest.fixture
def nats_names(require_service: Callable[..., None]) -> Iterator[tuple[str, str]]:
    require_service("NATS", "127.0.0.1", 4222)
    tag = secrets.token_hex(4)
    stream = f"trc_{tag}"
    yield stream, f"trc{tag}"
    drop_streams(stream)


def read_spans(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_serve_and_consume_processes_share_the_requests_trace(tmp_path: Path, nats_names: tuple[str, str]) -> None:
    stream, namespace = nats_names
    traces = tmp_path / "traces.jsonl"
    broker = broker_yaml(stream, namespace)
    serve_config = write_config(
        tmp_path / "serve.yaml",
        extra=broker
        + "outbox_worker: {publish_mode: mq}\n"
        + "consumers: {activity: {enabled: false}, notice: {enabled: false}}\n"
        + tracing_yaml(traces, "room-service-api"),
    )
    consume_config = write_config(
        tmp_path / "consume.yaml",
        extra=broker
        + "consumers: {activity: {enabled: true}, notice: {enabled: false}}\n"
        + tracing_yaml(traces, "room-service-activity"),
    )
    consume_dir = tmp_path / "consume"
    consume_dir.mkdir()
    consumer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "roomservice.cli",
            "consume",
            "--config",
            str(consume_config),
            "--data-dir",
            str(consume_dir),
        ],
        stdout=(consume_dir / "consume.log").open("ab"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    server = ServerProcess(config=serve_config, data_dir=tmp_path / "serve")
    try:
        server.start()
        traceparent, trace_id, caller = new_traceparent()
        base = f"{server.url}/v1/apps/demo/rooms"
        with httpx.Client(timeout=10) as http:
            create = {"command_id": "c1", "room_id": "x1", "owner_id": "alice", "title": "traced"}
            assert http.post(base, json=create).status_code == 200
            assert http.post(f"{base}/x1/join", json={"command_id": "c2", "user_id": "bob"}).status_code == 200
            gift = {"command_id": "c3", "sender_id": "bob", "receiver_id": "alice", "gift_id": "rose", "count": 3}
            answer = http.post(f"{base}/x1/gifts", json=gift, headers={"traceparent": traceparent})
            assert answer.status_code == 200, answer.text
        (event_id,) = [e["event_id"] for e in answer.json()["events"] if e["type"] == "RoomGiftSent"]

        deadline = time.monotonic() + 60
        while not any(s["name"] == "activity.apply" and s["trace_id"] == trace_id for s in read_spans(traces)):
            assert consumer.poll() is None, (consume_dir / "consume.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the consumer's effect span never reached the file"
            time.sleep(0.1)
    finally:
        server.stop()
        stop(consumer)
    assert consumer.returncode == 0 and server.proc is not None and server.proc.returncode == 0

    trace = [s for s in read_spans(traces) if s["trace_id"] == trace_id]
    by_name: dict[str, list[dict[str, Any]]] = {}
    for span in trace:
        by_name.setdefault(span["name"], []).append(span)

    def one(name: str, **attributes: Any) -> dict[str, Any]:
        found = [s for s in by_name.get(name, []) if all(s["attributes"].get(k) == v for k, v in attributes.items())]
        assert len(found) == 1, (name, sorted(by_name))
        return found[0]

    request = one("POST /v1/apps/{app_code}/rooms/{room_id}/gifts")
    command = one("room.command SendGift")
    deliver = one("outbox.deliver RoomGiftSent")
    publish = one("hyapp_room_outbox publish", **{"messaging.message.id": event_id})
    consume = one(f"consume {ACTIVITY}", **{"messaging.message.id": event_id})
    effect = one("activity.apply")
    stages = [s for s in trace if s["name"].startswith("room.stage.")]
    assert {s["name"] for s in stages} >= {"room.stage.save_mutation", "room.stage.wallet_debit"}
    assert request["parent_span_id"] == caller and command["parent_span_id"] == request["span_id"]
    assert all(s["parent_span_id"] == command["span_id"] for s in stages)
    assert deliver["parent_span_id"] == command["span_id"] and publish["parent_span_id"] == deliver["span_id"]
    assert consume["parent_span_id"] == publish["span_id"] and effect["parent_span_id"] == consume["span_id"]

    # two processes, one trace: each span says which process wrote it
    api_side = {request["resource"]["process.pid"], deliver["resource"]["process.pid"]}
    consumer_side = {consume["resource"]["process.pid"], effect["resource"]["process.pid"]}
    assert api_side == {server.proc.pid} and consumer_side == {consumer.pid}
    assert {s["resource"]["service.name"] for s in trace} == {"room-service-api", "room-service-activity"}

    with contextlib.closing(sqlite3.connect(consume_dir / "room.db")) as db:  # the effect, in the consumer's database
        board = db.execute("SELECT user_id, value FROM activity_gift_board WHERE board = 'received'").fetchall()
    assert board == [("alice", 30)]
