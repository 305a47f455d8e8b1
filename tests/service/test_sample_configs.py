"""The sample configs, started as production starts them: every role of ``serve`` on each file.

configs/local.yaml runs as is (with a temporary data dir): the mq topology on
the embedded broker. configs/docker.yaml and configs/tencent-cloud.yaml run with
their addresses from the environment: a fresh MariaDB database, a redis-server
and (docker) a nats-server of the test's own, (tencent) the fake RocketMQ 5
proxy, the IM sandbox as Tencent IM and a wallet server.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy.engine import make_url
from structlog.testing import capture_logs
from tests.fakes.rocketmq_proxy import FakeRocketMQProxy
from tests.nats_server import OwnNatsServer
from tests.redis_server import OwnRedisServer
from tests.wallet_server import running_wallet_server

from roomservice.bootstrap import API, Process
from roomservice.brokers.embedded import EmbeddedBroker
from roomservice.brokers.nats import NatsBroker
from roomservice.brokers.rocketmq import RocketMQBroker
from roomservice.config import Settings, load_settings
from roomservice.domain import commands as c
from roomservice.integrations.im_sandbox import running_sandbox
from roomservice.integrations.tencent_im.client import group_id_for
from roomservice.leases.leader import RedisMaintenanceLock
from roomservice.leases.redis import RedisLeases
from roomservice.outbox.model import BROKER, TREASURE_WAKEUP, PublishMode
from roomservice.projections.redis import RedisProjections
from roomservice.store.migrate import upgrade_url
from roomservice.wallet.http import HttpWallet

LOCAL = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"


def local_settings(data_dir: Path, **overrides: object) -> Settings:
    settings = load_settings(LOCAL, env={}).with_data_dir(data_dir)
    return settings.with_overrides(overrides) if overrides else settings


def task_names(process: Process) -> set[str]:
    return {task.get_name() for task in process.core.tasks if not task.done()}


async def test_local_sample_runs_with_its_settings_in_effect(tmp_path: Path) -> None:
    settings = local_settings(tmp_path)
    async with Process.running(settings) as process:
        # the catalog and room rules come from the file
        catalog = {g["id"]: g["price"] for g in process.service.gifts()}
        assert catalog == {g.id: g.price for g in settings.gifts}
        assert catalog["rose"] == 10 and len(catalog) == 5
        # SQLite under the data dir; the seed's production topology: mq to the embedded broker, four groups
        assert process.db.dialect_name == "sqlite"
        assert (tmp_path / "room.db").is_file()
        assert process.worker is not None
        assert process.worker.options.mode is PublishMode.MQ
        assert process.worker.options.batch_size == settings.outbox_worker.batch_size == 100
        assert set(process.worker.publishers.names) == {BROKER, TREASURE_WAKEUP}
        assert isinstance(process.broker, EmbeddedBroker)
        assert process.consumers is not None
        assert {r.group for r in process.consumers.runners} == {
            "hyapp-activity-room-outbox",
            "hyapp-notice-room-outbox",
            "hyapp-room-im-bridge",
            "hyapp-room-treasure-open",
        }
        assert process.sandbox is not None  # the IM bridge and the notice group talk to the in-process sandbox
        assert "outbox-backlog-metrics" in task_names(process)  # metrics.enabled: true

        body = await process.service.execute("demo", "r1", "c1", c.CreateRoom(owner_id="alice", title="Hi"))
        assert len(body["room"]["seats"]) == settings.room.seat_count == 8
        admin = process.outbox_admin
        assert admin is not None
        deadline = time.monotonic() + 30
        while (stats := await admin.stats()).counts["delivered"] < 1:
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.05)
        assert stats.counts["failed"] == 0
        group = group_id_for("demo", "r1", group_type=settings.tencent_im.group_type)
        assert process.sandbox.state.group(group) is not None  # created synchronously and by the IM bridge


async def test_metrics_disabled_samples_no_backlog(tmp_path: Path) -> None:
    settings = local_settings(tmp_path, **{"metrics.enabled": False})
    async with Process.running(settings) as process:
        names = task_names(process)
        assert "outbox-retention" in names  # the maintenance role runs ...
        assert "outbox-backlog-metrics" not in names  # ... without the metrics sampler


@pytest.fixture
def own_redis() -> Iterator[OwnRedisServer]:
    server = OwnRedisServer()
    server.start()
    yield server
    server.kill()


def lease_value(redis_url: str, prefix: str, app: str, room: str) -> dict[str, str]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        raw = client.get(f"{prefix}lease:{app}:{room}")
    finally:
        client.close()
    assert raw is not None
    value: dict[str, str] = json.loads(raw)
    return value


async def check_scale_out_parts(process: Process, redis_url: str) -> None:
    """Redis leases advertising the room API, Redis projections and maintenance leader, and a forwarded pipeline."""
    settings = process.settings
    assert process.room_api is not None and process.commands is not None
    leases = process.leases
    assert isinstance(leases, RedisLeases)
    assert leases.address == process.room_api.target
    assert leases.ttl_s == settings.lease.ttl.total_seconds() == 10
    assert isinstance(process.service.projections, RedisProjections)
    assert process.maintenance is not None
    assert isinstance(process.maintenance.retention.lock, RedisMaintenanceLock)
    assert "lease-renewal" in task_names(process)
    body = await process.commands.forwarder.execute("demo", "r1", "c1", c.CreateRoom(owner_id="alice", title="Hi"))
    assert body["version"] >= 1
    held = lease_value(redis_url, settings.redis.key_prefix, "demo", "r1")
    assert held["address"] == process.room_api.target and held["owner"] == leases.owner
    assert [r["room_id"] for r in await process.service.rooms("demo")] == ["r1"]


async def test_docker_sample_runs_with_addresses_from_the_environment(
    tmp_path: Path, fresh_mariadb_url: str, own_redis: OwnRedisServer, own_server: OwnNatsServer
) -> None:
    async with running_sandbox(1400000000, "im-key", rate_limit_per_second=None) as sandbox:
        env = {
            "ROOMSERVICE_ADMIN_TOKEN": "t",
            "ROOMSERVICE_DATABASE_URL": fresh_mariadb_url,
            "ROOMSERVICE_REDIS_URL": own_redis.url,
            "ROOMSERVICE_NATS_URL": own_server.url,
            "ROOMSERVICE_TENCENT_IM_BASE_URL": sandbox.base_url,  # the one IM every process shares
            "ROOMSERVICE_TENCENT_IM_SECRET_KEY": "im-key",
            "ROOMSERVICE_GRPC_SHARED_SECRET": "peer-secret",
            "ROOMSERVICE_GRPC_HOST": "127.0.0.1",
            "ROOMSERVICE_GRPC_PORT": "0",
        }
        settings = load_settings(LOCAL.with_name("docker.yaml"), env=env).with_data_dir(tmp_path)
        async with Process.running(settings, room_api=True) as process:
            assert process.db.dialect_name == "mysql"
            assert isinstance(process.broker, NatsBroker)
            assert process.worker is not None and process.worker.options.mode is PublishMode.MQ
            assert process.sandbox is None and process.activity_service is None  # no in-process helper multiplies
            await check_scale_out_parts(process, own_redis.url)
            group = group_id_for("demo", "r1", group_type=settings.tencent_im.group_type)
            assert sandbox.state.group(group) is not None


async def test_tencent_cloud_sample_runs_with_addresses_from_the_environment(
    tmp_path: Path, fresh_mariadb_url: str, own_redis: OwnRedisServer
) -> None:
    url = make_url(fresh_mariadb_url)
    await asyncio.to_thread(upgrade_url, fresh_mariadb_url)  # auto_migrate: false, as in a release step
    proxy = FakeRocketMQProxy(min_invisible_for_recv_s=1)
    proxy.credentials = {"rmq-ak": "rmq-sk"}
    proxy.start()
    try:
        async with (
            running_sandbox(1400000001, "im-key", rate_limit_per_second=None) as sandbox,
            running_wallet_server(starting_balance=1_000, api_key="wallet-key") as wallet,
        ):
            env = {
                "MYSQL_HOST": url.host or "127.0.0.1",
                "MYSQL_PORT": str(url.port or 3306),
                "MYSQL_USER": url.username or "root",
                "MYSQL_PASSWORD": url.password or "",
                "MYSQL_DATABASE": url.database or "",
                "REDIS_URL": own_redis.url,
                "ROCKETMQ_NAME_SERVERS": proxy.endpoint,
                "ROCKETMQ_ACCESS_KEY": "rmq-ak",
                "ROCKETMQ_SECRET_KEY": "rmq-sk",
                "TENCENT_IM_BASE_URL": sandbox.base_url,
                "TENCENT_IM_SDK_APP_ID": "1400000001",
                "TENCENT_IM_SECRET_KEY": "im-key",
                "ACTIVITY_GRPC_TARGET": "127.0.0.1:9",
                "WALLET_URL": wallet.base_url,
                "WALLET_API_KEY": "wallet-key",
                "ROOMSERVICE_ADMIN_TOKEN": "t",
                "ROOMSERVICE_GRPC_SHARED_SECRET": "peer-secret",
                "ROOMSERVICE_GRPC_HOST": "127.0.0.1",
                "ROOMSERVICE_GRPC_PORT": "0",
            }
            settings = load_settings(LOCAL.with_name("tencent-cloud.yaml"), env=env).with_data_dir(tmp_path)
            async with Process.running(settings, room_api=True) as process:
                assert isinstance(process.broker, RocketMQBroker)
                assert isinstance(process.wallet, HttpWallet)
                # issue 9: here the room service runs the IM bridge and the treasure-open groups only
                assert process.consumers is not None
                assert sorted(r.group for r in process.consumers.runners) == [
                    "hyapp-room-im-bridge",
                    "hyapp-room-treasure-open",
                ]
                await check_scale_out_parts(process, own_redis.url)
                group = group_id_for("demo", "r1", group_type=settings.tencent_im.group_type)
                assert sandbox.state.group(group) is not None  # created at CreateRoom through the configured IM
                deadline = time.monotonic() + 20
                while not any(call.method == "SendMessage" for call in proxy.calls):  # the outbox row, over RocketMQ
                    assert time.monotonic() < deadline, "nothing was published to RocketMQ"
                    await asyncio.sleep(0.05)
                assert all(call.auth.valid for call in proxy.calls if call.method == "SendMessage")
    finally:
        proxy.stop()


async def test_inprocess_leases_on_a_shared_database_warn_at_start(tmp_path: Path, fresh_mariadb_url: str) -> None:
    settings = local_settings(tmp_path, **{"database.url": fresh_mariadb_url})
    with capture_logs() as logs:
        async with Process.running(settings, roles=(API,), loops=False):
            pass
    warned = [line for line in logs if line["event"] == "single_process_leases"]
    assert len(warned) == 1 and warned[0]["log_level"] == "warning"
    assert "lease.driver: redis" in warned[0]["message"]
    with capture_logs() as sqlite_logs:
        async with Process.running(local_settings(tmp_path / "lite"), roles=(API,), loops=False):
            pass
    assert not [line for line in sqlite_logs if line["event"] == "single_process_leases"]
