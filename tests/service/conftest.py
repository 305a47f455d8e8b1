"""Fixtures for service-level tests: a whole Process on SQLite or MariaDB with a controllable clock."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

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
    url: str = request.getfixturevalue("fresh_mariadb_url")
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
