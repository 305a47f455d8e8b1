"""The sample configs, started as production starts them: every role of ``serve`` on each file.

configs/local.yaml runs as is (with a temporary data dir). configs/docker.yaml and
configs/tencent-cloud.yaml do not load until scale-out and the brokers are built
(tests/unit/test_config.py asserts exactly which of their choices are refused);
once they do, they get a test here that starts them with their addresses
overridden from the environment.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from roomservice.bootstrap import Process
from roomservice.config import Settings, load_settings
from roomservice.domain import commands as c
from roomservice.outbox.model import ACTIVITY, IM, PublishMode

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
        # SQLite under the data dir, direct mode to the in-process IM sandbox and activity service
        assert process.db.dialect_name == "sqlite"
        assert (tmp_path / "room.db").is_file()
        assert process.worker is not None
        assert process.worker.options.mode is PublishMode.DIRECT
        assert process.worker.options.batch_size == settings.outbox_worker.batch_size == 100
        assert {IM, ACTIVITY} <= set(process.worker.publishers.names)
        assert process.sandbox is not None and process.activity_service is not None
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
