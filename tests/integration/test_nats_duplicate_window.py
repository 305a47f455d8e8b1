"""The NATS stream's duplicate window is sized from the outbox worker's retry horizon (issue 8 item 3).

``retry_horizon_ms`` is every claim lease plus every backoff at the jitter's upper
bound; ``open_broker`` gives the stream ``max(broker.nats.duplicate_window,
horizon)``, so a late re-publish of one event_id is still stored once, and a
longer configured window takes effect. Checked on the real stream config of the
shared NATS server (a stream of this test's own, deleted afterwards).
"""

from __future__ import annotations

import secrets
from contextlib import AsyncExitStack, suppress
from pathlib import Path
from typing import Any

import nats
import pytest
from tests.service.conftest import make_settings

from roomservice.bootstrap.broker import open_broker, retry_horizon_ms
from roomservice.brokers.port import BrokerError
from roomservice.config import Settings
from roomservice.store.database import Database

SHARED_URL = "nats://127.0.0.1:4222"
SHORT_RETRIES = {
    "outbox_worker.publish_timeout": "1s",
    "outbox_worker.lock_timeout": "10s",
    "outbox_worker.max_retry_count": 3,
    "outbox_worker.initial_backoff": "1s",
    "outbox_worker.max_backoff": "3s",
    "outbox_worker.jitter": 0.5,
}


def nats_settings(tmp_path: Path, **overrides: Any) -> Settings:
    return make_settings(
        f"sqlite+aiosqlite:///{tmp_path}/room.db",
        tmp_path,
        **{
            "broker.driver": "nats",
            "broker.nats.url": SHARED_URL,
            "broker.nats.stream": f"dupwin_{secrets.token_hex(4)}",
            **overrides,
        },
    )


def test_the_retry_horizon_is_every_lease_plus_every_backoff_at_its_jitter_bound(tmp_path: Path) -> None:
    settings = make_settings(f"sqlite+aiosqlite:///{tmp_path}/room.db", tmp_path, **SHORT_RETRIES)
    # the first claim, then per retry: backoff 1 s, 2 s, 3 s (capped) x 1.5, each with its own claim
    assert retry_horizon_ms(settings) == 10_000 + (1_500 + 10_000) + (3_000 + 10_000) + (4_500 + 10_000)
    no_retries = settings.with_overrides({"outbox_worker.max_retry_count": 0})
    assert retry_horizon_ms(no_retries) == 10_000
    capped = settings.with_overrides({"outbox_worker.max_retry_count": 60})  # 2**59 s is capped, not overflowed
    assert retry_horizon_ms(capped) == 10_000 + 1_500 + 3_000 + 58 * 4_500 + 60 * 10_000


async def stream_duplicate_window_s(settings: Settings) -> float:
    """Open the broker as a process does, make it create its stream, and read the stream's config back."""
    db = Database.from_url(settings.database.connect_url())
    nc = await nats.connect(SHARED_URL)
    js = nc.jetstream()
    stream = settings.broker.nats.stream
    try:
        async with AsyncExitStack() as stack:
            broker = await open_broker(settings, db=db, clock=lambda: 0, stack=stack)
            await broker.declare_group(settings.rocketmq.room_outbox.topic, "dupwin-group", max_deliveries=3)
            info = await js.stream_info(stream)
            return float(info.config.duplicate_window or 0)
    finally:
        for name in (stream, f"{stream}_dlq"):
            with suppress(nats.js.errors.NotFoundError):
                await js.delete_stream(name)
        await nc.close()
        await db.dispose()


@pytest.fixture
def shared_nats(require_service: Any) -> None:
    require_service("NATS", "127.0.0.1", 4222, hint="start-stop-daemon ... /usr/sbin/nats-server -js")


@pytest.mark.usefixtures("shared_nats")
async def test_a_longer_configured_window_takes_effect(tmp_path: Path) -> None:
    settings = nats_settings(tmp_path, **SHORT_RETRIES, **{"broker.nats.duplicate_window": "5m"})
    assert retry_horizon_ms(settings) < 300_000
    assert await stream_duplicate_window_s(settings) == pytest.approx(300)


@pytest.mark.usefixtures("shared_nats")
async def test_a_shorter_configured_window_is_raised_to_the_retry_horizon(tmp_path: Path) -> None:
    settings = nats_settings(tmp_path, **SHORT_RETRIES, **{"broker.nats.duplicate_window": "2s"})
    assert await stream_duplicate_window_s(settings) == pytest.approx(retry_horizon_ms(settings) / 1000)
    # the seed's defaults: ~36 min of retries, inside the 2 h default window
    defaults = nats_settings(tmp_path)
    assert retry_horizon_ms(defaults) < defaults.broker.nats.duplicate_window.total_seconds() * 1000
    assert await stream_duplicate_window_s(defaults) == pytest.approx(7200)


async def test_a_retry_horizon_beyond_the_streams_max_age_refuses_to_open(tmp_path: Path) -> None:
    settings = nats_settings(tmp_path, **{"broker.nats.max_age": "10m", "broker.nats.duplicate_window": "10m"})
    assert retry_horizon_ms(settings) > 600_000
    db = Database.from_url(settings.database.connect_url())
    try:
        async with AsyncExitStack() as stack:
            with pytest.raises(BrokerError, match="duplicate window"):
                await open_broker(settings, db=db, clock=lambda: 0, stack=stack)
    finally:
        await db.dispose()
