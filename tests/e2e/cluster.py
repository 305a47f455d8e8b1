"""Helpers for tests that run several room-service processes on MariaDB + Redis leases + NATS JetStream.

Each test gets a Redis key prefix and a NATS stream and subject namespace
(``rocketmq.namespace``) of its own on the shared services, removed afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import redis

APP = "scale"
SECRET = "peer-secret-for-tests"
SHARED_REDIS = "redis://127.0.0.1:6379/0"
SHARED_NATS = "nats://127.0.0.1:4222"


@dataclass(frozen=True, slots=True)
class Stream:
    """A stream and subject namespace of one test on the shared NATS (subjects may not overlap across streams)."""

    name: str
    namespace: str


@contextlib.contextmanager
def nats_stream() -> Iterator[Stream]:
    """A new stream name and namespace; the stream (and its dead-letter stream) deleted afterwards."""
    tag = secrets.token_hex(4)
    value = Stream(name=f"scale_{tag}", namespace=f"scale{tag}")
    try:
        yield value
    finally:
        asyncio.run(_drop_streams(value.name))


async def _drop_streams(name: str) -> None:
    nc = await nats.connect(SHARED_NATS)
    try:
        for each in (name, f"{name}_dlq"):
            with contextlib.suppress(Exception):  # a stream nobody published to was never created
                await nc.jetstream().delete_stream(each)
    finally:
        await nc.close()


@contextlib.contextmanager
def redis_prefix() -> Iterator[str]:
    """A new key prefix on the shared Redis; its keys deleted afterwards."""
    value = f"test-scale-{uuid.uuid4().hex[:8]}:"
    try:
        yield value
    finally:
        client = redis.Redis.from_url(SHARED_REDIS)
        try:
            keys = list(client.scan_iter(match=f"{value}*"))
            if keys:
                client.delete(*keys)
        finally:
            client.close()


def cluster_config(
    path: Path,
    *,
    database_url: str,
    redis_url: str,
    prefix: str,
    stream: Stream,
    outbox_worker: str = "",
    extra: str = "",
) -> Path:
    """Redis leases (ttl 2s), mq on NATS, the gRPC room API on a free port; ``outbox_worker`` adds keys
    to that mapping (``k: v, ...``), ``extra`` is appended YAML."""
    path.write_text(
        f"""
logging: {{level: info, json: true}}
database: {{url: "{database_url}", timeout: "1s"}}
lease: {{driver: redis, ttl: "2s", renew_every: "400ms", safety_margin: "500ms"}}
redis: {{url: "{redis_url}", key_prefix: "{prefix}", socket_timeout: "300ms", socket_connect_timeout: "300ms"}}
grpc: {{host: 127.0.0.1, port: 0, shared_secret: "${{ROOMSERVICE_GRPC_SHARED_SECRET}}", forward_timeout: "1s"}}
outbox_worker: {{enabled: true, publish_mode: mq{", " + outbox_worker if outbox_worker else ""}}}
rocketmq: {{namespace: "{stream.namespace}", room_outbox: {{enabled: true}}}}
broker: {{driver: nats, nats: {{url: "{SHARED_NATS}", stream: "{stream.name}"}}}}
gifts:
  - {{id: rose, name: Rose, price: 10}}
{extra}"""
    )
    return path


def owner_address(redis_url: str, prefix: str, room: str, *, app: str = APP) -> str | None:
    """The internal address the room's Redis lease names (None: nobody holds it)."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        raw = client.get(f"{prefix}lease:{app}:{room}")
    finally:
        client.close()
    return None if raw is None else str(json.loads(raw)["address"])
