"""A worker or consumer on Redis leases serves the room API its leases name (issue 10).

Its timers (treasure wake-ups), reconciliation and the treasure-open group take a
room's lease through the forwarder; another process then forwards that room's
commands to the address in the lease, so it must answer there (before, it
answered nothing and the room was ``503`` until the lease expired). Both
processes run in this event loop on configs/docker.yaml with addresses from the
environment: a fresh MariaDB database, a redis-server and a nats-server of the
test's own, the IM sandbox. Stopping right after starting must not hang (a
cancelled maintenance loop once lost its cancel inside a MariaDB read).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from tests.nats_server import OwnNatsServer
from tests.redis_server import OwnRedisServer

from roomservice.bootstrap import API, CONSUME_ROLES, WORKER_ROLES, Process
from roomservice.config import Settings, load_settings
from roomservice.domain import commands as c
from roomservice.integrations.im_sandbox import running_sandbox
from roomservice.leases.redis import RedisLeases

DOCKER_YAML = Path(__file__).resolve().parents[2] / "configs" / "docker.yaml"
APP = "demo"


@pytest.fixture
def own_redis() -> Iterator[OwnRedisServer]:
    server = OwnRedisServer()
    server.start()
    yield server
    server.kill()


@asynccontextmanager
async def docker_settings(
    tmp_path: Path, database_url: str, redis: OwnRedisServer, nats: OwnNatsServer, **overrides: object
) -> AsyncIterator[tuple[Settings, Settings]]:
    """Two processes' settings (their own data dirs) on one database, Redis, NATS and IM sandbox."""
    async with running_sandbox(1400000000, "im-key", rate_limit_per_second=None) as sandbox:
        env = {
            "ROOMSERVICE_ADMIN_TOKEN": "t",
            "ROOMSERVICE_DATABASE_URL": database_url,
            "ROOMSERVICE_REDIS_URL": redis.url,
            "ROOMSERVICE_NATS_URL": nats.url,
            "ROOMSERVICE_TENCENT_IM_BASE_URL": sandbox.base_url,
            "ROOMSERVICE_TENCENT_IM_SECRET_KEY": "im-key",
            "ROOMSERVICE_GRPC_SHARED_SECRET": "peer-secret",
            "ROOMSERVICE_GRPC_HOST": "127.0.0.1",
            "ROOMSERVICE_GRPC_PORT": "0",
        }
        base = load_settings(DOCKER_YAML, env=env)
        if overrides:
            base = base.with_overrides(overrides)
        yield base.with_data_dir(tmp_path / "a"), base.with_data_dir(tmp_path / "b")


async def test_a_room_whose_lease_a_worker_took_is_forwarded_to_the_worker(
    tmp_path: Path, migrated_mariadb_url: str, own_redis: OwnRedisServer, own_server: OwnNatsServer
) -> None:
    async with (
        docker_settings(tmp_path, migrated_mariadb_url, own_redis, own_server) as (worker_settings, api_settings),
        Process.running(worker_settings, roles=WORKER_ROLES) as worker,  # what `room-service worker` runs
        Process.running(api_settings, roles={API}, room_api=True) as api,
    ):
        assert worker.room_api is not None and api.room_api is not None
        assert isinstance(worker.leases, RedisLeases) and worker.leases.address == worker.room_api.target
        # the worker takes the room's lease the way its timers do: through its forwarder, nobody holding the room
        created = await worker.commands.forwarder.execute(APP, "w1", "c1", c.CreateRoom(owner_id="alice", title="t"))
        assert worker.registry.peek(APP, "w1") is not None
        held = await api.commands.forwarder.leases.owner_of(APP, "w1")  # type: ignore[union-attr]
        assert held is not None and held.address == worker.room_api.target
        # a command on another process goes to the worker in one hop and is answered there
        joined = await api.commands.forwarder.execute(APP, "w1", "c2", c.JoinRoom(user_id="bob"))
        assert joined["version"] == created["version"] + 1 and joined["replayed"] is False
        assert api.commands.forwarder.forwarded == 1
        assert api.registry.peek(APP, "w1") is None  # the API process never loaded the room
        view = await api.commands.forwarder.room(APP, "w1")  # the worker's live state
        assert [m["user_id"] for m in view["members"]] == ["alice", "bob"]


async def test_a_consumer_with_the_treasure_open_group_serves_the_room_api(
    tmp_path: Path, migrated_mariadb_url: str, own_redis: OwnRedisServer, own_server: OwnNatsServer
) -> None:
    groups = frozenset({"hyapp-room-treasure-open"})
    async with (
        docker_settings(
            tmp_path, migrated_mariadb_url, own_redis, own_server, **{"rocketmq.treasure_open.enabled": True}
        ) as (settings, _),
        Process.running(settings, roles=CONSUME_ROLES, groups=groups) as consumer,  # `consume --group ...`
    ):
        assert consumer.commands is not None and consumer.room_api is not None
        assert isinstance(consumer.leases, RedisLeases) and consumer.leases.address == consumer.room_api.target
        # it holds rooms (wake-ups) with no maintenance role: it reconciles their debits itself
        assert "wallet-reconcile" in {t.get_name() for t in consumer.core.tasks if not t.done()}


async def test_a_consumer_without_the_command_pipeline_serves_no_room_api(
    tmp_path: Path, migrated_mariadb_url: str, own_redis: OwnRedisServer, own_server: OwnNatsServer
) -> None:
    groups = frozenset({"hyapp-activity-room-outbox"})
    async with (
        docker_settings(
            tmp_path, migrated_mariadb_url, own_redis, own_server, **{"consumers.activity.enabled": True}
        ) as (
            settings,
            _,
        ),
        Process.running(settings, roles=CONSUME_ROLES, groups=groups) as consumer,
    ):
        assert consumer.commands is None and consumer.room_api is None  # it never takes a room's lease


async def test_a_worker_stopped_right_after_it_started_stops(
    tmp_path: Path, migrated_mariadb_url: str, own_redis: OwnRedisServer, own_server: OwnNatsServer
) -> None:
    """The maintenance loops are in their first sweep (MariaDB reads) when the stop cancels them."""
    async with docker_settings(tmp_path, migrated_mariadb_url, own_redis, own_server) as (settings, _):
        for _ in range(3):
            async with Process.running(settings, roles=WORKER_ROLES) as worker:
                assert worker.room_api is not None and worker.room_api.serving
                tasks = list(worker.core.tasks)
                assert {"outbox-retention", "treasure-timer", "lease-renewal"} <= {t.get_name() for t in tasks}
            assert not worker.room_api.serving
            assert all(t.done() for t in tasks)
