"""A broker outage keeps the process ready and says so (issue 8 item 6, seed row 3).

The test's own ``nats-server -js`` is killed under a process publishing mq mode to it:
/readyz stays 200 with the broker ``degraded: …`` in its body, /metrics says
``room_broker_up 0``; after a restart on the same port both say the broker is back.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families
from tests.nats_server import OwnNatsServer
from tests.service.conftest import make_settings
from tests.service.test_mq_mode import eventually

from roomservice.api.app import ApiContext, create_app
from roomservice.bootstrap import API, OUTBOX, Process


@pytest_asyncio.fixture
async def client(tmp_path: Path, own_server: OwnNatsServer) -> AsyncIterator[httpx.AsyncClient]:
    settings = make_settings(
        f"sqlite+aiosqlite:///{tmp_path}/room.db",
        tmp_path,
        **{
            "outbox_worker.publish_mode": "mq",
            "rocketmq.room_outbox.enabled": True,
            "broker.driver": "nats",
            "broker.nats.url": own_server.url,
            "broker.nats.stream": f"outage_{secrets.token_hex(4)}",
            "broker.nats.connect_timeout": "1s",
            "metrics.enabled": True,
        },
    )
    async with Process.running(settings, roles=(API, OUTBOX)) as rt:
        app = create_app(ApiContext(service=rt.service, health=rt.health, admin_token="t" * 32, metrics=True))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            yield c


async def readiness(client: httpx.AsyncClient) -> tuple[int, dict[str, Any]]:
    response = await client.get("/readyz")
    return response.status_code, response.json()


async def broker_up(client: httpx.AsyncClient) -> float:
    response = await client.get("/metrics")
    assert response.status_code == 200
    values = [
        s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
        if s.name == "room_broker_up"
    ]
    assert len(values) == 1, values
    return values[0]


async def test_a_broker_outage_is_degraded_readiness_and_broker_up_zero_then_one_again(
    client: httpx.AsyncClient, own_server: OwnNatsServer
) -> None:
    status, body = await readiness(client)
    assert status == 200 and body["checks"]["broker"] == "ok", body
    assert await broker_up(client) == 1

    own_server.kill()

    async def degraded() -> bool:
        status, body = await readiness(client)
        assert status == 200 and body["ready"] is True, body  # commands still succeed: still ready
        assert body["checks"]["database"] == "ok"
        return str(body["checks"]["broker"]).startswith("degraded")

    await eventually(degraded, deadline_s=30, what="/readyz shows the broker degraded")
    assert await broker_up(client) == 0

    own_server.start()

    async def recovered() -> bool:
        status, body = await readiness(client)
        assert status == 200, body
        return bool(body["checks"]["broker"] == "ok")

    await eventually(recovered, deadline_s=30, what="/readyz shows the broker back")
    assert await broker_up(client) == 1
