"""The sample configs, started as production starts them: every role of ``serve`` on each file.

configs/local.yaml runs as is (with a temporary data dir): the mq topology on
the embedded broker. configs/docker.yaml and configs/tencent-cloud.yaml start
with their addresses overridden from the environment once everything they
choose is built (tests/unit/test_config.py asserts which choices are refused).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from roomservice.bootstrap import Process
from roomservice.brokers.embedded import EmbeddedBroker
from roomservice.config import Settings, load_settings
from roomservice.domain import commands as c
from roomservice.integrations.tencent_im.client import group_id_for
from roomservice.outbox.model import BROKER, TREASURE_WAKEUP, PublishMode

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


@pytest.mark.parametrize("name", ["docker.yaml", "tencent-cloud.yaml"])
def test_the_scale_out_samples_do_not_start_yet(name: str) -> None:
    from roomservice.config import ConfigError

    with pytest.raises(ConfigError, match="is not available yet"):
        load_settings(LOCAL.with_name(name), env={"ROOMSERVICE_ADMIN_TOKEN": "t"} | _TENCENT_ENV)


_TENCENT_ENV = {
    "MYSQL_HOST": "127.0.0.1",
    "MYSQL_USER": "root",
    "MYSQL_PASSWORD": "",
    "REDIS_URL": "redis://127.0.0.1:6379/0",
    "ROCKETMQ_NAME_SERVERS": "127.0.0.1:8081",
    "ROCKETMQ_ACCESS_KEY": "a",
    "ROCKETMQ_SECRET_KEY": "s",
    "TENCENT_IM_SDK_APP_ID": "1400000001",
    "TENCENT_IM_SECRET_KEY": "k",
    "ACTIVITY_GRPC_TARGET": "127.0.0.1:9000",
    "WALLET_URL": "http://127.0.0.1:9",
    "WALLET_API_KEY": "k",
}
