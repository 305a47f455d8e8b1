"""Fixtures for service-level tests: a whole Process on SQLite or MariaDB with a controllable clock, and
the seed's production topology (mq mode, every consumer group) on the embedded broker and on real NATS."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from tests.nats_server import drop_streams
from tests.service.helpers import TOPOLOGY

from roomservice.bootstrap import API, MAINTENANCE, Process
from roomservice.config import DIRECT_TOPOLOGY, Settings, load_settings
from roomservice.wallet.fake import FakeWallet

T0 = 1_780_000_000_000  # 2026-05-28T20:26:40Z, far from a UTC midnight


class Clock:
    def __init__(self, now_ms: int = T0) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, ms: int) -> None:
        self.now_ms += ms


# direct mode, as the seed's code defaults have it (configs/local.yaml, which make_settings starts from,
# runs the mq topology with its four consumer groups)
DIRECT: dict[str, Any] = dict(DIRECT_TOPOLOGY)


def make_settings(database_url: str, data_dir: Path, **overrides: Any) -> Settings:
    base = load_settings().with_data_dir(data_dir)
    return base.with_overrides({"database.url": database_url, **overrides})


RuntimeFactory = Callable[..., AbstractAsyncContextManager[Process]]


@pytest.fixture(params=["sqlite", "mariadb"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path}/room.db"
    url: str = request.getfixturevalue("migrated_mariadb_url")
    return url


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def wallet() -> FakeWallet:
    return FakeWallet(starting_balance=10_000)


@pytest.fixture
def runtime_factory(database_url: str, tmp_path: Path, clock: Clock, wallet: FakeWallet) -> RuntimeFactory:
    def factory(**overrides: Any) -> AbstractAsyncContextManager[Process]:
        settings = make_settings(database_url, tmp_path, **overrides)
        return Process.running(settings, clock=clock, wallet=wallet, roles=(API, MAINTENANCE), loops=False)

    return factory


@pytest_asyncio.fixture
async def runtime(runtime_factory: RuntimeFactory) -> AsyncIterator[Process]:
    async with runtime_factory() as rt:
        yield rt


@pytest.fixture(params=["embedded", "nats"])
def broker_overrides(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """The embedded broker, or the shared NATS under a stream and subject namespace of this test alone."""
    if request.param == "embedded":
        yield {"broker.driver": "embedded"}
        return
    request.getfixturevalue("require_service")("NATS", "127.0.0.1", 4222)
    tag = secrets.token_hex(4)
    stream = f"cg_{tag}"
    yield {"broker.driver": "nats", "broker.nats.stream": stream, "rocketmq.namespace": f"cg{tag}"}
    drop_streams(stream)


@pytest.fixture
def topology(database_url: str, tmp_path: Path, broker_overrides: dict[str, Any]) -> Callable[..., Any]:
    """``topology(**overrides)``: a Process running the seed's production topology (every role, the four
    consumer groups) on each database and each broker; the overrides go on top."""

    def start(**overrides: Any) -> Any:
        settings = make_settings(database_url, tmp_path, **{**TOPOLOGY, **broker_overrides, **overrides})
        return Process.running(settings)

    return start
