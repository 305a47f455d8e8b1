"""Typed configuration: the seed's YAML, the sample files, validation, durations, ${ENV}, secrets."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from roomservice import config
from roomservice.config import (
    DIRECT_TOPOLOGY,
    INACTIVE_RULES,
    NOT_YET_AVAILABLE,
    ConfigError,
    Settings,
    format_duration,
    inactive_keys,
    load_settings,
    parse_duration,
    setting,
    setting_keys,
    settings_from_yaml,
)

REPO = Path(__file__).resolve().parents[2]
PACKAGED = REPO / "src" / "roomservice" / "configs"
SAMPLES = ("local", "docker", "tencent-cloud")

# The "配置" block of seed/room-outbox-worker.zh.md, verbatim.
SEED_YAML = """\
rocketmq:
  enabled: false
  name_servers: []
  name_server_domain: ""
  access_key: ""
  secret_key: ""
  namespace: ""
  send_timeout: "3s"
  retry: 2
  room_outbox:
    enabled: false
    topic: "hyapp_room_outbox"
    producer_group: "hyapp-room-outbox-producer"
    tencent_im_consumer_enabled: false
    tencent_im_consumer_group: "hyapp-room-im-bridge"
    consumer_max_reconsume_times: 16
  treasure_open:
    enabled: false
    topic: "hyapp_room_treasure_open"
    producer_group: "hyapp-room-treasure-open-producer"
    consumer_group: "hyapp-room-treasure-open"
    consumer_max_reconsume_times: 16

outbox_worker:
  enabled: true
  publish_mode: "direct"
  poll_interval: "1s"
  batch_size: 100
  publish_timeout: "3s"
  retry_strategy: "exponential_backoff"
  max_retry_count: 10
  initial_backoff: "5s"
  max_backoff: "5m"
"""

DOCKER_ENV = {
    "ROOMSERVICE_ADMIN_TOKEN": "docker-admin-token-123",
    "DB_PASSWORD": "maria@db:pw/1",
    "ROOMSERVICE_GRPC_SHARED_SECRET": "peer-secret-pqr",
    "ROOMSERVICE_TENCENT_IM_SECRET_KEY": "im-secret-vwx",
}
DOCKER_SECRETS = {"ROOMSERVICE_GRPC_SHARED_SECRET": "p", "ROOMSERVICE_TENCENT_IM_SECRET_KEY": "k"}
TENCENT_ENV = {
    "MYSQL_HOST": "10.0.0.3",
    "MYSQL_USER": "room",
    "MYSQL_PASSWORD": "mysql-secret-456",
    "REDIS_URL": "redis://:redis-secret-789@10.0.0.5:6379/0",
    "ROCKETMQ_NAME_SERVERS": "rmq-1.tencenttdmq.com:8081, rmq-2.tencenttdmq.com:8081",
    "ROCKETMQ_ACCESS_KEY": "rmq-access-abc",
    "ROCKETMQ_SECRET_KEY": "rmq-secret-def",
    "TENCENT_IM_SDK_APP_ID": "1400123456",
    "TENCENT_IM_SECRET_KEY": "im-secret-ghi",
    "ACTIVITY_GRPC_TARGET": "activity:9000",
    "WALLET_URL": "https://wallet.internal",
    "WALLET_API_KEY": "wallet-key-jkl",
    "ROOMSERVICE_ADMIN_TOKEN": "admin-token-mno",
    "ROOMSERVICE_GRPC_SHARED_SECRET": "peer-secret-stu",
}
SECRETS = [
    "docker-admin-token-123",
    "maria@db:pw/1",
    "mysql-secret-456",
    "redis-secret-789",
    "rmq-access-abc",
    "rmq-secret-def",
    "im-secret-ghi",
    "wallet-key-jkl",
    "admin-token-mno",
    "peer-secret-pqr",
    "peer-secret-stu",
    "im-secret-vwx",
]


@pytest.fixture
def all_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if every not-yet-available feature were built (the table emptied): what the rest of
    validation says, and what a file means once its choices are available."""
    monkeypatch.setattr(config, "NOT_YET_AVAILABLE", ())


def load(data: dict[str, Any], env: dict[str, str] | None = None) -> Settings:
    return settings_from_yaml(yaml.safe_dump(data), env=env or {})


def config_error(data: dict[str, Any], env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load(data, env)
    return str(info.value)


# --------------------------------------------------------------------------- the seed


def test_seed_yaml_loads_verbatim_and_means_what_the_seed_says(tmp_path: Path) -> None:
    path = tmp_path / "seed.yaml"
    path.write_text(SEED_YAML, encoding="utf-8")
    s = load_settings(path, env={})

    mq = s.rocketmq
    assert mq.enabled is False
    assert mq.name_servers == ()
    assert mq.name_server_domain == ""
    assert mq.access_key.get_secret_value() == ""
    assert mq.secret_key.get_secret_value() == ""
    assert mq.namespace == ""
    assert mq.send_timeout == timedelta(seconds=3)
    assert mq.retry == 2
    assert mq.room_outbox.enabled is False
    assert mq.room_outbox.topic == "hyapp_room_outbox"
    assert mq.room_outbox.producer_group == "hyapp-room-outbox-producer"
    assert mq.room_outbox.tencent_im_consumer_enabled is False
    assert mq.room_outbox.tencent_im_consumer_group == "hyapp-room-im-bridge"
    assert mq.room_outbox.consumer_max_reconsume_times == 16
    assert mq.treasure_open.enabled is False
    assert mq.treasure_open.topic == "hyapp_room_treasure_open"
    assert mq.treasure_open.producer_group == "hyapp-room-treasure-open-producer"
    assert mq.treasure_open.consumer_group == "hyapp-room-treasure-open"
    assert mq.treasure_open.consumer_max_reconsume_times == 16

    w = s.outbox_worker
    assert w.enabled is True
    assert w.publish_mode == "direct"
    assert w.poll_interval == timedelta(seconds=1)
    assert w.batch_size == 100
    assert w.publish_timeout == timedelta(seconds=3)
    assert w.retry_strategy == "exponential_backoff"
    assert w.max_retry_count == 10
    assert w.initial_backoff == timedelta(seconds=5)
    assert w.max_backoff == timedelta(minutes=5)
    # our additions keep their defaults
    assert w.lock_timeout == timedelta(seconds=30)
    assert w.publish_concurrency == 16
    assert w.delivered_retention == timedelta(hours=168)
    assert w.retention_batch_size == 1000
    assert w.jitter == pytest.approx(0.2)


def test_the_database_deadline_defaults_to_5s_and_takes_a_duration() -> None:
    assert Settings().database.timeout == timedelta(seconds=5)
    assert load({"database": {"timeout": "750ms"}}).database.timeout == timedelta(milliseconds=750)


def test_seed_blocks_are_the_defaults() -> None:
    s = settings_from_yaml(SEED_YAML, env={})
    assert s.rocketmq == Settings().rocketmq
    assert s.outbox_worker == Settings().outbox_worker


@pytest.mark.parametrize("name", SAMPLES)
def test_every_sample_keeps_the_seed_blocks_with_the_seed_keys(name: str) -> None:
    data = yaml.safe_load((PACKAGED / f"{name}.yaml").read_text(encoding="utf-8"))
    seed = yaml.safe_load(SEED_YAML)
    assert set(data["rocketmq"]) == set(seed["rocketmq"])
    assert set(data["rocketmq"]["room_outbox"]) == set(seed["rocketmq"]["room_outbox"])
    assert set(data["rocketmq"]["treasure_open"]) == set(seed["rocketmq"]["treasure_open"])
    assert set(seed["outbox_worker"]) <= set(data["outbox_worker"])


# --------------------------------------------------------------------------- sample files


def test_local_sample_is_the_embedded_default() -> None:
    s = load_settings(PACKAGED / "local.yaml", env={})
    assert s.database.url == "sqlite+aiosqlite:///{data_dir}/room.db"
    assert s.database.backend == "sqlite"
    assert s.database.auto_migrate is True
    assert s.lease.driver == "inprocess"
    assert s.broker.driver == "embedded"
    assert s.wallet.driver == "embedded"
    assert s.tencent_im.base_url == ""
    # the seed's production topology in one process: mq on the embedded broker, all four groups
    assert s.outbox_worker.publish_mode == "mq"
    assert s.rocketmq.room_outbox.enabled and s.rocketmq.room_outbox.tencent_im_consumer_enabled
    assert s.rocketmq.treasure_open.enabled
    assert s.consumers.activity.enabled and s.consumers.notice.enabled
    assert s.rocketmq.enabled is False
    assert s.http.port == 8080
    assert s.treasure.levels == (1000, 5000, 20000)
    assert s.treasure.countdown_seconds == 60
    prices = {g.id: g.price for g in s.gifts}
    assert len(prices) >= 5
    assert prices["rose"] == 10
    # the embedded wallet's starting balance covers many gifts
    assert s.wallet.starting_balance // max(prices.values()) >= 5
    assert s.wallet.starting_balance // min(prices.values()) >= 1000


def test_local_sample_writes_the_defaults_apart_from_the_gift_catalog_and_the_mq_topology() -> None:
    s = load_settings(PACKAGED / "local.yaml", env={})
    code_defaults = s.with_overrides(DIRECT_TOPOLOGY)  # the code's defaults stay the seed's: direct, switches off
    assert code_defaults.model_copy(update={"gifts": ()}) == Settings()


def test_no_choice_is_left_unbuilt() -> None:
    assert NOT_YET_AVAILABLE == ()


def test_docker_sample_needs_the_peers_shared_secret() -> None:
    env = {k: v for k, v in DOCKER_ENV.items() if k != "ROOMSERVICE_GRPC_SHARED_SECRET"}
    with pytest.raises(ConfigError) as info:
        load_settings(PACKAGED / "docker.yaml", env=env)
    assert info.value.problems == (
        "grpc.shared_secret: environment variable ROOMSERVICE_GRPC_SHARED_SECRET is not set "
        "(use ${ROOMSERVICE_GRPC_SHARED_SECRET:-default} if optional)",
    )
    assert info.value.source == str(PACKAGED / "docker.yaml")


def test_redis_leases_need_a_shared_secret() -> None:
    assert "grpc.shared_secret must be set when lease.driver is redis" in config_error({"lease": {"driver": "redis"}})
    s = load({"lease": {"driver": "redis"}, "grpc": {"shared_secret": "s3"}, "outbox_worker": {"enabled": False}})
    assert s.lease.driver == "redis" and s.grpc.shared_secret.get_secret_value() == "s3"
    assert "s3" not in repr(s)


def test_tencent_cloud_sample_loads_with_its_environment() -> None:
    s = load_settings(PACKAGED / "tencent-cloud.yaml", env=TENCENT_ENV)
    assert s.lease.driver == "redis"
    assert s.broker.driver == "rocketmq"
    assert s.grpc.host == "0.0.0.0" and s.grpc.port == 9090 and s.grpc.advertise_address == ""
    assert s.grpc.shared_secret.get_secret_value() == "peer-secret-stu"


def test_docker_sample_loads_with_its_environment() -> None:
    s = load_settings(PACKAGED / "docker.yaml", env=DOCKER_ENV)
    assert s.database.backend == "mysql"
    assert s.database.url == "mysql+asyncmy://root@mariadb:3306/room"
    assert s.database.password.get_secret_value() == "maria@db:pw/1"
    assert s.database.connect_url() == "mysql+asyncmy://root:maria%40db%3Apw%2F1@mariadb:3306/room"
    assert s.redis.url == "redis://redis:6379/0"
    assert s.lease.driver == "redis"
    assert s.broker.driver == "nats"
    assert s.broker.nats.url == "nats://nats:4222"
    assert s.outbox_worker.publish_mode == "mq"
    assert s.rocketmq.room_outbox.enabled is True
    assert s.grpc.host == "0.0.0.0" and s.grpc.port == 9090 and s.grpc.advertise_address == ""
    assert s.grpc.shared_secret.get_secret_value() == "peer-secret-pqr"
    one_of_n = load_settings(
        PACKAGED / "docker.yaml", env={**DOCKER_ENV, "ROOMSERVICE_GRPC_ADVERTISE_ADDRESS": "room-service-2:9090"}
    )
    assert one_of_n.grpc.advertise_address == "room-service-2:9090"
    assert s.admin.token.get_secret_value() == "docker-admin-token-123"


@pytest.mark.usefixtures("all_built")
def test_docker_sample_db_password_is_optional_but_admin_token_is_not() -> None:
    secret = DOCKER_SECRETS
    s = load_settings(PACKAGED / "docker.yaml", env={"ROOMSERVICE_ADMIN_TOKEN": "t", **secret})
    assert s.database.connect_url() == "mysql+asyncmy://root@mariadb:3306/room"
    with pytest.raises(ConfigError, match=r"admin\.token.*ROOMSERVICE_ADMIN_TOKEN"):
        load_settings(PACKAGED / "docker.yaml", env=secret)


def test_tencent_cloud_sample_loads_with_its_environment_and_means_it() -> None:
    s = load_settings(PACKAGED / "tencent-cloud.yaml", env=TENCENT_ENV)
    assert s.database.url == "mysql+asyncmy://room@10.0.0.3:3306/room"
    assert s.database.connect_url() == "mysql+asyncmy://room:mysql-secret-456@10.0.0.3:3306/room"
    assert s.redis.url == "redis://10.0.0.5:6379/0"
    assert s.redis.connect_url() == "redis://:redis-secret-789@10.0.0.5:6379/0"
    assert s.broker.driver == "rocketmq"
    assert s.rocketmq.enabled is True
    assert s.rocketmq.name_servers == ("rmq-1.tencenttdmq.com:8081", "rmq-2.tencenttdmq.com:8081")
    assert s.rocketmq.access_key.get_secret_value() == "rmq-access-abc"
    assert s.rocketmq.namespace == ""
    assert s.outbox_worker.publish_mode == "mq"
    assert s.tencent_im.base_url == "https://console.tim.qq.com"
    assert s.tencent_im.sdk_app_id == 1400123456
    assert s.tencent_im.admin_identifier == "administrator"
    assert s.tencent_im.secret_key.get_secret_value() == "im-secret-ghi"
    assert s.activity.target == "activity:9000"
    assert s.wallet.driver == "http"
    assert s.wallet.url == "https://wallet.internal"


def test_tencent_cloud_sample_names_every_missing_variable() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(PACKAGED / "tencent-cloud.yaml", env={})
    message = str(info.value)
    for key, var in [
        ("database.password", "MYSQL_PASSWORD"),
        ("rocketmq.name_servers", "ROCKETMQ_NAME_SERVERS"),
        ("tencent_im.sdk_app_id", "TENCENT_IM_SDK_APP_ID"),
        ("tencent_im.secret_key", "TENCENT_IM_SECRET_KEY"),
        ("admin.token", "ROOMSERVICE_ADMIN_TOKEN"),
    ]:
        assert f"{key}: environment variable {var} is not set" in message


@pytest.mark.parametrize("name", SAMPLES)
def test_repo_root_configs_are_the_packaged_files(name: str) -> None:
    root = REPO / "configs" / f"{name}.yaml"
    assert root.is_symlink()
    assert root.resolve() == (PACKAGED / f"{name}.yaml").resolve()


def test_load_settings_without_a_path_uses_the_packaged_local_yaml_from_any_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert load_settings(env={}) == load_settings(PACKAGED / "local.yaml", env={})


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(tmp_path / "nope.yaml", env={})


# --------------------------------------------------------------------------- validation

CASES: list[tuple[dict[str, Any], str]] = [
    # outbox_worker (seed rules)
    ({"outbox_worker": {"poll_interval": "0s"}}, "outbox_worker.poll_interval must be > 0"),
    ({"outbox_worker": {"poll_interval": 1}}, "outbox_worker.poll_interval must be a duration string"),
    ({"outbox_worker": {"poll_interval": "1 sec"}}, "outbox_worker.poll_interval is not a valid duration"),
    ({"outbox_worker": {"batch_size": 0}}, "outbox_worker.batch_size must be > 0"),
    ({"outbox_worker": {"batch_size": "many"}}, "outbox_worker.batch_size must be an integer"),
    ({"outbox_worker": {"batch_size": True}}, "outbox_worker.batch_size must be a number, not true/false"),
    ({"outbox_worker": {"publish_timeout": "0s"}}, "outbox_worker.publish_timeout must be > 0"),
    ({"outbox_worker": {"max_retry_count": -1}}, "outbox_worker.max_retry_count must be >= 0"),
    ({"outbox_worker": {"initial_backoff": "0ms"}}, "outbox_worker.initial_backoff must be > 0"),
    ({"outbox_worker": {"max_backoff": "1s"}}, "outbox_worker.max_backoff must be >= outbox_worker.initial_backoff"),
    ({"consumers": {"max_backoff": "500ms"}}, "consumers.max_backoff must be >= consumers.initial_backoff (1s)"),
    ({"consumers": {"initial_backoff": "0s"}}, "consumers.initial_backoff must be > 0"),
    ({"consumers": {"visibility_timeout": "0s"}}, "consumers.visibility_timeout must be > 0"),
    ({"consumers": {"dedup_retention": "0s"}}, "consumers.dedup_retention must be > 0"),
    (
        {"consumers": {"dedup_retention": "100h"}},
        "consumers.dedup_retention must be >= outbox_worker.delivered_retention (168h)",
    ),
    (  # the embedded broker in use keeps messages longer than the dedup records
        {
            "consumers": {"dedup_retention": "200h"},
            "broker": {"embedded": {"retention": "300h"}},
            "rocketmq": {"treasure_open": {"enabled": True}},
        },
        "consumers.dedup_retention must be >= broker.embedded.retention (300h)",
    ),
    (
        {"outbox_worker": {"retry_strategy": "linear"}},
        "outbox_worker.retry_strategy must be one of exponential_backoff",
    ),
    ({"outbox_worker": {"publish_mode": "kafka"}}, "outbox_worker.publish_mode must be one of direct, mq, dual"),
    ({"outbox_worker": {"lock_timeout": "3s"}}, "outbox_worker.lock_timeout must be > outbox_worker.publish_timeout"),
    ({"outbox_worker": {"publish_concurrency": 0}}, "outbox_worker.publish_concurrency must be > 0"),
    ({"outbox_worker": {"delivered_retention": "0s"}}, "outbox_worker.delivered_retention must be > 0"),
    ({"outbox_worker": {"retention_batch_size": 0}}, "outbox_worker.retention_batch_size must be > 0"),
    ({"outbox_worker": {"jitter": 1.5}}, "outbox_worker.jitter must be <= 1"),
    ({"outbox_worker": {"jitter": -0.1}}, "outbox_worker.jitter must be >= 0"),
    ({"outbox_worker": {"enabled": "maybe"}}, "outbox_worker.enabled must be true or false"),
    ({"outbox_worker": []}, "outbox_worker must be a mapping"),
    # rocketmq
    ({"rocketmq": {"send_timeout": "0s"}}, "rocketmq.send_timeout must be > 0"),
    ({"rocketmq": {"retry": -1}}, "rocketmq.retry must be >= 0"),
    ({"rocketmq": {"room_outbox": {"topic": "bad topic"}}}, "rocketmq.room_outbox.topic must match"),
    ({"rocketmq": {"treasure_open": {"consumer_group": ""}}}, "rocketmq.treasure_open.consumer_group must match"),
    (
        {"rocketmq": {"room_outbox": {"consumer_max_reconsume_times": -1}}},
        "rocketmq.room_outbox.consumer_max_reconsume_times must be >= 0",
    ),
    # database / redis / http
    ({"database": {"url": "postgresql+asyncpg://u@h/db"}}, "database.url must start with one of sqlite+aiosqlite://"),
    ({"database": {"url": "room.db"}}, "database.url must start with one of"),
    ({"database": {"url": "mysql+asyncmy://"}}, "database.url names no database"),
    (
        {"database": {"url": "mysql+asyncmy://u:a@h/db", "password": "b"}},
        "database.password conflicts with the password inside url",
    ),
    ({"database": {"pool_size": 0}}, "database.pool_size must be >= 1"),
    ({"database": {"max_overflow": -1}}, "database.max_overflow must be >= 0"),
    ({"database": {"timeout": "0s"}}, "database.timeout must be > 0"),
    ({"database": {"timeout": 5}}, "database.timeout must be a duration string"),
    ({"redis": {"url": "http://redis:6379"}}, "redis.url must start with redis://"),
    ({"lease": {"driver": "etcd"}}, "lease.driver must be one of inprocess, redis"),
    ({"lease": {"ttl": "0s"}}, "lease.ttl must be > 0"),
    ({"http": {"port": 70000}}, "http.port must be <= 65535"),
    ({"http": {"port": -1}}, "http.port must be >= 0"),
    ({"http": {"host": ""}}, "http.host must not be empty"),
    # room
    ({"room": {"seat_count": 0}}, "room.seat_count must be >= 1"),
    ({"room": {"seat_count": 21}}, "room.seat_count must be <= 20"),
    ({"room": {"snapshot_every_n": 0}}, "room.snapshot_every_n must be >= 1"),
    ({"room": {"idle_evict_after": "0s"}}, "room.idle_evict_after must be > 0"),
    ({"room": {"idempotency_retention": "0h"}}, "room.idempotency_retention must be > 0"),
    ({"room": {"default_ban_seconds": 0}}, "room.default_ban_seconds must be >= 1"),
    ({"room": {"default_ban_seconds": 2_592_001}}, "room.default_ban_seconds must be <= 2592000"),
    # gifts
    (
        {"gifts": [{"id": "a", "name": "A", "price": 1}, {"id": "b", "name": "B", "price": 0}]},
        "gifts[1].price must be > 0",
    ),
    ({"gifts": [{"id": "bad id!", "name": "A", "price": 1}]}, "gifts[0].id must match"),
    ({"gifts": [{"id": "x" * 65, "name": "A", "price": 1}]}, "gifts[0].id must match"),
    ({"gifts": [{"id": "a", "name": "", "price": 1}]}, "gifts[0].name must not be empty"),
    ({"gifts": [{"id": "a", "name": "n" * 65, "price": 1}]}, "gifts[0].name must have at most 64"),
    ({"gifts": [{"id": "a", "name": "A"}]}, "gifts[0].price is required"),
    ({"gifts": [{"id": "a", "name": "A", "price": 1, "colour": "red"}]}, "unknown key: gifts[0].colour"),
    (
        {
            "gifts": [
                {"id": "rose", "name": "Rose", "price": 10},
                {"id": "heart", "name": "Heart", "price": 50},
                {"id": "rose", "name": "Rose again", "price": 20},
            ]
        },
        'gifts[2].id duplicates "rose"',
    ),
    # treasure
    ({"treasure": {"levels": []}}, "treasure.levels must not be empty"),
    ({"treasure": {"levels": [0, 10]}}, "treasure.levels[0] must be > 0"),
    ({"treasure": {"levels": [10, 10]}}, "treasure.levels must be strictly increasing"),
    ({"treasure": {"levels": [100, 50]}}, "treasure.levels must be strictly increasing"),
    ({"treasure": {"countdown_seconds": 0}}, "treasure.countdown_seconds must be >= 1"),
    # wallet / admin
    ({"wallet": {"driver": "paypal"}}, "wallet.driver must be one of embedded, http"),
    ({"wallet": {"driver": "http"}}, "wallet.url must be an http(s) URL when wallet.driver is http"),
    ({"wallet": {"starting_balance": -1}}, "wallet.starting_balance must be >= 0"),
    ({"wallet": {"reconcile_after": "0s"}}, "wallet.reconcile_after must be > 0"),
    ({"wallet": {"reconcile_interval": "0s"}}, "wallet.reconcile_interval must be > 0"),
    ({"wallet": {"timeout": "0s"}}, "wallet.timeout must be > 0"),
    ({"admin": {"tokn": "x"}}, "unknown key: admin.tokn"),
    # broker
    ({"broker": {"driver": "kafka"}}, "broker.driver must be one of embedded, nats, rocketmq"),
    ({"broker": {"nats": {"stream": "a.b"}}}, "broker.nats.stream must match"),
    ({"broker": {"nats": {"connect_timeout": "0s"}}}, "broker.nats.connect_timeout must be > 0"),
    ({"broker": {"embedded": {"poll_interval": "0s"}}}, "broker.embedded.poll_interval must be > 0"),
    # tencent_im
    (
        {"tencent_im": {"base_url": "https://console.tim.qq.com", "secret_key": "k"}},
        "tencent_im.sdk_app_id must be > 0 when tencent_im.base_url is set",
    ),
    (
        {"tencent_im": {"base_url": "https://console.tim.qq.com", "sdk_app_id": 1400000000}},
        "tencent_im.secret_key must be set when tencent_im.base_url is set",
    ),
    ({"tencent_im": {"base_url": "console.tim.qq.com"}}, "tencent_im.base_url must be empty (IM sandbox) or an http"),
    ({"tencent_im": {"group_type": "Channel"}}, "tencent_im.group_type must be one of AVChatRoom, ChatRoom, Public"),
    ({"tencent_im": {"request_timeout": "0s"}}, "tencent_im.request_timeout must be > 0"),
    ({"tencent_im": {"rate_limit_per_second": 0}}, "tencent_im.rate_limit_per_second must be > 0"),
    ({"tencent_im": {"usersig_ttl": "0s"}}, "tencent_im.usersig_ttl must be > 0"),
    ({"tencent_im": {"sdk_app_id": -1}}, "tencent_im.sdk_app_id must be >= 0"),
    # logging and typos anywhere
    ({"logging": {"level": "verbose"}}, "logging.level must be one of debug, info, warning, error, critical"),
    ({"logging": {"json": "sometimes"}}, "logging.json must be true or false"),
    ({"room": {"seat_cuont": 8}}, "unknown key: room.seat_cuont"),
    ({"roomz": {}}, "unknown key: roomz"),
    ({"rocketmq": {"room_outbox": {"topik": "t"}}}, "unknown key: rocketmq.room_outbox.topik"),
]


@pytest.mark.parametrize(("data", "expected"), CASES, ids=[c[1][:60] for c in CASES])
def test_validation_names_the_offending_key(data: dict[str, Any], expected: str) -> None:
    assert expected in config_error(data)


# Checks of combinations of not-yet-available choices: they hold from the day the choices are built.
CASES_ONCE_BUILT: list[tuple[dict[str, Any], str]] = [
    (
        {"outbox_worker": {"publish_mode": "mq"}},
        "rocketmq.room_outbox.enabled must be true when outbox_worker.publish_mode is mq",
    ),
    (
        {"outbox_worker": {"publish_mode": "dual"}},
        "rocketmq.room_outbox.enabled must be true when outbox_worker.publish_mode is dual",
    ),
    (
        {
            "outbox_worker": {"publish_mode": "mq"},
            "rocketmq": {"room_outbox": {"enabled": True}},
            "broker": {"driver": "rocketmq"},
        },
        "outbox_worker.publish_mode mq needs a usable broker: broker.driver is rocketmq but rocketmq.enabled is false",
    ),
    ({"rocketmq": {"enabled": True}}, "rocketmq.name_servers must not be empty when rocketmq.enabled is true"),
    (
        {"rocketmq": {"treasure_open": {"enabled": True}}, "broker": {"driver": "rocketmq"}},
        "rocketmq.treasure_open.enabled needs a usable broker",
    ),
    ({"lease": {"driver": "redis"}, "redis": {"url": ""}}, "redis.url must be set when lease.driver is redis"),
    ({"broker": {"driver": "nats", "nats": {"url": ""}}}, "broker.nats.url must be set when broker.driver is nats"),
    (
        {"broker": {"driver": "rocketmq"}, "consumers": {"visibility_timeout": "5s"}},
        "consumers.visibility_timeout must be between 10s and 12h when broker.driver is rocketmq",
    ),
    (
        {"broker": {"driver": "rocketmq"}, "consumers": {"visibility_timeout": "13h"}},
        "consumers.visibility_timeout must be between 10s and 12h when broker.driver is rocketmq",
    ),
]


@pytest.mark.usefixtures("all_built")
@pytest.mark.parametrize(("data", "expected"), CASES_ONCE_BUILT, ids=[c[1][:60] for c in CASES_ONCE_BUILT])
def test_validation_of_choices_not_built_yet_names_the_offending_key(data: dict[str, Any], expected: str) -> None:
    assert expected in config_error(data)


# Every choice of the samples is built, so the table is empty; the mechanism stays for the next feature
# and is tested with a row of its own.
EXAMPLE_ROW = config.NotYetAvailable("broker.driver", "rocketmq", "an example feature", "use 'embedded'")


@pytest.fixture
def example_row(monkeypatch: pytest.MonkeyPatch) -> config.NotYetAvailable:
    monkeypatch.setattr(config, "NOT_YET_AVAILABLE", (EXAMPLE_ROW,))
    return EXAMPLE_ROW


def test_a_choice_not_built_yet_fails_alone_naming_its_key(example_row: config.NotYetAvailable) -> None:
    with pytest.raises(ConfigError) as info:
        load({"broker": {"driver": "rocketmq"}})
    assert info.value.problems == (
        "broker.driver: 'rocketmq' is not available yet (an example feature); use 'embedded'",
    )


def test_a_choice_not_built_yet_is_reported_instead_of_its_combinations(example_row: config.NotYetAvailable) -> None:
    # rocketmq without rocketmq.enabled would be its own error; the unbuilt choice is reported instead
    data = {"outbox_worker": {"publish_mode": "mq"}, "broker": {"driver": "rocketmq"}}
    with pytest.raises(ConfigError) as info:
        load(data)
    assert info.value.problems == (example_row.problem(),)


def test_the_table_is_empty_now_that_every_sample_choice_is_built() -> None:
    assert NOT_YET_AVAILABLE == ()


def test_not_available_choices_are_real_keys_with_a_different_default() -> None:
    keys = set(setting_keys())
    for row in NOT_YET_AVAILABLE:
        assert row.key in keys
        assert setting(Settings(), row.key) != row.value


def test_with_overrides_takes_redis_leases_with_a_secret() -> None:
    s = load_settings(env={}).with_overrides(
        {
            "lease.driver": "redis",
            "grpc.shared_secret": "x",
            "tencent_im.base_url": "http://im:1",
            "tencent_im.sdk_app_id": 1,
            "tencent_im.secret_key": "k",
            "activity.target": "act:1",
        }
    )
    assert s.lease.driver == "redis"


def test_redis_leases_refuse_in_process_helpers_that_would_multiply() -> None:
    base: dict[str, Any] = {"lease": {"driver": "redis"}, "grpc": {"shared_secret": "s"}}
    problem = config_error({**base, "outbox_worker": {"publish_mode": "direct"}})
    assert "tencent_im.base_url must be set when lease.driver is redis" in problem
    shared_im = {"base_url": "http://im:1", "sdk_app_id": 1, "secret_key": "k"}
    problem = config_error({**base, "tencent_im": shared_im})
    assert "activity.target must be set when lease.driver is redis" in problem
    assert load({**base, "tencent_im": shared_im, "activity": {"target": "act:1"}}).activity.target == "act:1"
    assert load({**base, "tencent_im": {"enabled": False}, "outbox_worker": {"enabled": False}}).lease.driver == "redis"


@pytest.mark.usefixtures("all_built")
def test_mq_mode_with_the_outbox_topic_enabled_is_valid_on_every_usable_broker() -> None:
    base = {"outbox_worker": {"publish_mode": "mq"}, "rocketmq": {"room_outbox": {"enabled": True}}}
    assert load({**base, "broker": {"driver": "embedded"}}).outbox_worker.publish_mode == "mq"
    assert load({**base, "broker": {"driver": "nats"}}).broker.driver == "nats"
    s = load(
        {
            "outbox_worker": {"publish_mode": "dual"},
            "rocketmq": {"enabled": True, "name_server_domain": "ns.example", "room_outbox": {"enabled": True}},
            "broker": {"driver": "rocketmq"},
        }
    )
    assert s.outbox_worker.publish_mode == "dual"


def test_every_problem_is_reported_at_once() -> None:
    message = config_error(
        {"outbox_worker": {"poll_interval": "0s", "batch_size": 0}, "room": {"seat_cuont": 1}, "http": {"port": -5}}
    )
    for part in [
        "outbox_worker.poll_interval must be > 0",
        "outbox_worker.batch_size must be > 0",
        "unknown key: room.seat_cuont",
        "http.port must be >= 0",
    ]:
        assert part in message


def test_config_error_keeps_its_problems_and_source(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("room:\n  seat_count: 99\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={})
    assert info.value.problems == ("room.seat_count must be <= 20",)
    assert info.value.source == str(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("room:\n  seat_count: 8\n  seat_count: 9\n", "duplicate key 'seat_count'"),
        ("room: [unclosed\n", "invalid YAML"),
        ("- a\n- b\n", "the top level must be a mapping"),
    ],
)
def test_yaml_level_errors(text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        settings_from_yaml(text, env={})


def test_empty_yaml_gives_the_defaults() -> None:
    assert settings_from_yaml("", env={}) == Settings()
    assert settings_from_yaml("# nothing\n", env={}) == Settings()


def test_config_values_from_the_environment_may_be_strings() -> None:
    s = settings_from_yaml(
        'room: {seat_count: "${SEATS}"}\nlogging: {json: "${JSON}", level: "${LEVEL}"}\n',
        env={"SEATS": "12", "JSON": "false", "LEVEL": "DEBUG"},
    )
    assert s.room.seat_count == 12
    assert s.logging.json is False
    assert s.logging.level == "debug"


# --------------------------------------------------------------------------- durations


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("500ms", timedelta(milliseconds=500)),
        ("3s", timedelta(seconds=3)),
        ("5m", timedelta(minutes=5)),
        ("1h30m", timedelta(hours=1, minutes=30)),
        ("1.5s", timedelta(seconds=1.5)),
        ("300us", timedelta(microseconds=300)),
        ("300µs", timedelta(microseconds=300)),  # MICRO SIGN
        ("300μs", timedelta(microseconds=300)),  # GREEK SMALL LETTER MU
        ("10ns", timedelta(0)),  # below timedelta's microsecond resolution
        ("1500ns", timedelta(microseconds=2)),
        ("0s", timedelta(0)),
        ("168h", timedelta(days=7)),
        ("2h45m30.5s", timedelta(hours=2, minutes=45, seconds=30.5)),
        (".5s", timedelta(milliseconds=500)),
        ("+2s", timedelta(seconds=2)),
    ],
)
def test_parse_duration(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("5", "missing a unit"),
        ("0", "missing a unit"),
        ("1.5", "missing a unit"),
        ("-1s", "negative"),
        ("-0s", "negative"),
        ("5 min", "unknown unit"),
        ("1d", "unknown unit"),
        ("1w", "unknown unit"),
        ("1S", "unknown unit"),
        ("1e3s", "unknown unit"),
        ("abc", "invalid duration"),
        ("s", "invalid duration"),
        (".", "invalid duration"),
        ("1h-5m", "unknown unit"),
        ("99999999999999h", "too large"),
    ],
)
def test_parse_duration_rejects_bad_input(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_duration(text)


@pytest.mark.parametrize(
    ("td", "text"),
    [
        (timedelta(0), "0s"),
        (timedelta(microseconds=300), "300us"),
        (timedelta(milliseconds=500), "500ms"),
        (timedelta(microseconds=1500), "1.5ms"),
        (timedelta(seconds=3), "3s"),
        (timedelta(seconds=1.5), "1.5s"),
        (timedelta(minutes=5), "5m"),
        (timedelta(hours=1, minutes=30), "1h30m"),
        (timedelta(days=7), "168h"),
        (timedelta(seconds=-3), "-3s"),
    ],
)
def test_format_duration(td: timedelta, text: str) -> None:
    assert format_duration(td) == text


@given(st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=100_000)))
def test_format_then_parse_round_trips(td: timedelta) -> None:
    assert parse_duration(format_duration(td)) == td


def test_duration_fields_accept_timedelta_in_code_and_dump_as_strings() -> None:
    s = Settings.model_validate({"outbox_worker": {"poll_interval": timedelta(milliseconds=250)}})
    assert s.outbox_worker.poll_interval == timedelta(milliseconds=250)
    dumped = s.model_dump(mode="json")
    assert dumped["outbox_worker"]["poll_interval"] == "250ms"
    assert dumped["outbox_worker"]["max_backoff"] == "5m"


def test_a_json_dump_loads_back_to_the_same_settings() -> None:
    s = load_settings(env={})
    text = yaml.safe_dump(s.model_dump(mode="json"))
    assert settings_from_yaml(text, env={}) == s


# --------------------------------------------------------------------------- ${ENV}


def test_env_expansion() -> None:
    text = """
rocketmq:
  namespace: "${NS}"
  name_server_domain: "${DOMAIN:-ns.default}"
  name_servers: ["${NS1}", "static:8081"]
tencent_im:
  admin_identifier: "${ADMIN:-administrator}"
wallet:
  url: "http://${WALLET_HOST}:${WALLET_PORT:-80}/api"
activity:
  target: "$${NOT_EXPANDED}"
"""
    s = settings_from_yaml(text, env={"NS": "prod", "NS1": "rmq:8081", "ADMIN": "", "WALLET_HOST": "w"})
    assert s.rocketmq.namespace == "prod"
    assert s.rocketmq.name_server_domain == "ns.default"
    assert s.rocketmq.name_servers == ("rmq:8081", "static:8081")
    assert s.tencent_im.admin_identifier == "administrator"  # ":-" also covers set-but-empty
    assert s.wallet.url == "http://w:80/api"
    assert s.activity.target == "${NOT_EXPANDED}"


def test_a_set_but_empty_variable_without_default_is_empty() -> None:
    s = settings_from_yaml('rocketmq: {namespace: "${NS}"}', env={"NS": ""})
    assert s.rocketmq.namespace == ""


def test_missing_variable_names_the_key_and_the_variable() -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_yaml('rocketmq:\n  name_servers: ["a:1", "${NAME_SERVER_2}"]\n', env={})
    assert "rocketmq.name_servers[1]: environment variable NAME_SERVER_2 is not set" in str(info.value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("${UNTERMINATED", "activity.target: unterminated ${"),
        ("${1BAD}", "activity.target: invalid variable reference ${1BAD}"),
        ("${}", "activity.target: invalid variable reference ${}"),
    ],
)
def test_malformed_references_are_errors(value: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_yaml(yaml.safe_dump({"activity": {"target": value}}), env={})
    assert expected in str(info.value)


def test_env_argument_is_the_only_environment_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RS_TEST_NS", "from-os")
    text = 'rocketmq: {namespace: "${RS_TEST_NS}"}'
    with pytest.raises(ConfigError, match="RS_TEST_NS"):
        settings_from_yaml(text, env={})
    assert settings_from_yaml(text, env={"RS_TEST_NS": "given"}).rocketmq.namespace == "given"
    assert settings_from_yaml(text).rocketmq.namespace == "from-os"  # env=None means os.environ


def test_expanded_values_are_not_expanded_again() -> None:
    s = settings_from_yaml('rocketmq: {namespace: "${A}"}', env={"A": "${B}", "B": "no"})
    assert s.rocketmq.namespace == "${B}"


def test_keys_and_non_string_values_are_not_expanded() -> None:
    s = settings_from_yaml("room: {seat_count: 4}\n", env={})
    assert s.room.seat_count == 4


# --------------------------------------------------------------------------- secrets


@pytest.mark.usefixtures("all_built")
@pytest.mark.parametrize(("name", "env"), [("docker", DOCKER_ENV), ("tencent-cloud", TENCENT_ENV)])
def test_secrets_never_print(name: str, env: dict[str, str]) -> None:
    s = load_settings(PACKAGED / f"{name}.yaml", env=env)
    shown = [repr(s), str(s), s.model_dump_json(), repr(s.database), str(s.redis)]
    for text in shown:
        for secret in SECRETS:
            assert secret not in text


@pytest.mark.usefixtures("all_built")
def test_secret_fields_are_secret_str() -> None:
    s = load_settings(PACKAGED / "tencent-cloud.yaml", env=TENCENT_ENV)
    assert s.wallet.api_key.get_secret_value() == "wallet-key-jkl"
    assert s.admin.token.get_secret_value() == "admin-token-mno"
    assert s.rocketmq.secret_key.get_secret_value() == "rmq-secret-def"
    assert "**********" in repr(s.tencent_im)


def test_invalid_values_are_not_echoed_in_errors() -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_yaml('admin: {token: ["top-secret-value"]}', env={})
    assert "admin.token" in str(info.value)
    assert "top-secret-value" not in str(info.value)


@pytest.mark.parametrize(
    ("url", "safe", "password"),
    [
        ("mysql+asyncmy://root:pw@db:3306/room", "mysql+asyncmy://root@db:3306/room", "pw"),
        ("mysql+asyncmy://root:p%40ss@db/room?charset=utf8mb4", "mysql+asyncmy://root@db/room?charset=utf8mb4", "p@ss"),
        ("mariadb+asyncmy://root:a@b:c/d?e#f@db/room", "mariadb+asyncmy://root@db/room", "a@b:c/d?e#f"),
        ("mysql+asyncmy://root:@db/room", "mysql+asyncmy://root@db/room", ""),
        ("mysql+asyncmy://root@db/room", "mysql+asyncmy://root@db/room", ""),
    ],
)
def test_database_url_password_moves_to_the_password_field(url: str, safe: str, password: str) -> None:
    s = load({"database": {"url": url}})
    assert s.database.url == safe
    assert s.database.password.get_secret_value() == password
    if password:
        assert password not in repr(s)
        from sqlalchemy.engine import make_url

        assert make_url(s.database.connect_url()).password == password


def test_redis_url_password_moves_to_the_password_field() -> None:
    s = load({"redis": {"url": "redis://:s3cret@cache:6379/1"}})
    assert s.redis.url == "redis://cache:6379/1"
    assert "s3cret" not in repr(s)
    assert s.redis.connect_url() == "redis://:s3cret@cache:6379/1"
    assert load({}).redis.connect_url() == "redis://127.0.0.1:6379/0"


# --------------------------------------------------------------------------- helpers


def test_with_data_dir_substitutes_the_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = load_settings(env={})
    with pytest.raises(ConfigError, match="with_data_dir"):
        s.database.connect_url()
    resolved = s.with_data_dir(tmp_path / "data")
    assert resolved.database.url == f"sqlite+aiosqlite:///{(tmp_path / 'data').resolve().as_posix()}/room.db"
    assert resolved.database.connect_url() == resolved.database.url
    assert s.database.url == "sqlite+aiosqlite:///{data_dir}/room.db"  # the original is untouched

    monkeypatch.chdir(tmp_path)
    relative = s.with_data_dir(Path("var"))
    assert relative.database.url == f"sqlite+aiosqlite:///{(tmp_path / 'var').resolve().as_posix()}/room.db"


@pytest.mark.usefixtures("all_built")
def test_with_data_dir_leaves_urls_without_the_placeholder_alone(tmp_path: Path) -> None:
    s = load_settings(PACKAGED / "docker.yaml", env=DOCKER_ENV)
    resolved = s.with_data_dir(tmp_path)
    assert resolved.model_dump() == s.model_dump()
    assert (s.data_dir, resolved.data_dir) == (None, tmp_path.resolve())
    assert resolved.with_overrides({"http.port": 9}).data_dir == tmp_path.resolve()  # kept by a re-validation


def test_with_overrides_revalidates_dotted_keys() -> None:
    s = load_settings(env={})
    t = s.with_overrides(
        {
            "outbox_worker.poll_interval": "250ms",
            "rocketmq.room_outbox.enabled": True,
            "outbox_worker.publish_concurrency": "4",
            "logging.json": False,
        }
    )
    assert t.outbox_worker.poll_interval == timedelta(milliseconds=250)
    assert t.rocketmq.room_outbox.enabled is True
    assert t.outbox_worker.publish_concurrency == 4
    assert t.logging.json is False
    assert t.gifts == s.gifts
    with pytest.raises(ConfigError, match=re.escape("outbox_worker.batch_size must be > 0")):
        s.with_overrides({"outbox_worker.batch_size": 0})
    with pytest.raises(ConfigError, match=re.escape("unknown key: room.seat_cuont")):
        s.with_overrides({"room.seat_cuont": 3})
    with pytest.raises(ConfigError, match=re.escape("unknown key: nope.x")):
        s.with_overrides({"nope.x": 3})


@pytest.mark.usefixtures("all_built")
def test_with_overrides_keeps_secrets(tmp_path: Path) -> None:
    s = load_settings(PACKAGED / "docker.yaml", env=DOCKER_ENV)
    t = s.with_overrides({"http.port": 0})
    assert t.http.port == 0
    assert t.admin.token.get_secret_value() == "docker-admin-token-123"
    assert t.database.connect_url() == s.database.connect_url()


def test_model_copy_derives_variants() -> None:
    s = load_settings(env={})
    t = s.model_copy(update={"http": s.http.model_copy(update={"port": 0})})
    assert (s.http.port, t.http.port) == (8080, 0)


def test_room_rules_come_from_the_catalog_and_room_blocks() -> None:
    s = load({"gifts": [{"id": "rose", "name": "Rose", "price": 10}], "room": {"seat_count": 10}})
    rules = s.room_rules()
    assert rules.gifts["rose"].price == 10
    assert rules.default_seat_count == 10
    assert rules.default_ban_seconds == 600
    assert rules.treasure_levels == (1000, 5000, 20000)
    assert rules.treasure_countdown_ms == 60_000


# --------------------------------------------------------------------------- addresses from the environment

# Keys that hold an address; every sample writes each non-empty one as ${NAME:-default}.
ADDRESS_KEYS = (
    "database.url",
    "redis.url",
    "broker.nats.url",
    "rocketmq.name_servers",
    "http.host",
    "http.port",
    "tencent_im.base_url",
    "activity.target",
    "wallet.url",
)


def _raw(data: dict[str, Any], key: str) -> object:
    node: object = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


@pytest.mark.parametrize("name", SAMPLES)
def test_every_address_in_a_sample_comes_from_the_environment(name: str) -> None:
    data = yaml.safe_load((PACKAGED / f"{name}.yaml").read_text(encoding="utf-8"))
    written = {key: _raw(data, key) for key in ADDRESS_KEYS if _raw(data, key) not in (None, [], "")}
    assert "database.url" in written and "http.host" in written
    for key, value in written.items():
        assert isinstance(value, str) and "${" in value, f"{name}.yaml {key} = {value!r}"


def test_local_sample_addresses_are_overridden_from_the_environment() -> None:
    env = {
        "ROOMSERVICE_DATABASE_URL": "mysql+asyncmy://room:pw@db.internal:3307/rooms",
        "ROOMSERVICE_HTTP_HOST": "0.0.0.0",
        "ROOMSERVICE_HTTP_PORT": "9090",
        "ROOMSERVICE_TENCENT_IM_BASE_URL": "https://im.example",
        "ROOMSERVICE_TENCENT_IM_SDK_APP_ID": "1400000001",
        "ROOMSERVICE_TENCENT_IM_SECRET_KEY": "k",
        "ROOMSERVICE_ACTIVITY_TARGET": "activity.internal:9000",
        "ROOMSERVICE_REDIS_URL": "redis://cache:6380/2",
        "ROOMSERVICE_NATS_URL": "nats://nats.internal:4222",
    }
    s = load_settings(PACKAGED / "local.yaml", env=env)
    assert s.database.url == "mysql+asyncmy://room@db.internal:3307/rooms"
    assert s.database.password.get_secret_value() == "pw"
    assert (s.http.host, s.http.port) == ("0.0.0.0", 9090)
    assert (s.tencent_im.base_url, s.tencent_im.sdk_app_id) == ("https://im.example", 1400000001)
    assert s.activity.target == "activity.internal:9000"
    assert s.redis.url == "redis://cache:6380/2"
    assert s.broker.nats.url == "nats://nats.internal:4222"


@pytest.mark.usefixtures("all_built")
def test_docker_sample_addresses_default_to_compose_service_names_and_are_overridden() -> None:
    s = load_settings(PACKAGED / "docker.yaml", env={"ROOMSERVICE_ADMIN_TOKEN": "t", **DOCKER_SECRETS})
    assert s.database.url == "mysql+asyncmy://root@mariadb:3306/room"
    assert s.redis.url == "redis://redis:6379/0"
    assert s.broker.nats.url == "nats://nats:4222"
    assert (s.http.host, s.http.port) == ("0.0.0.0", 8080)
    assert (s.tencent_im.base_url, s.activity.target) == ("http://im-sandbox:8090", "")
    env = {
        "ROOMSERVICE_ADMIN_TOKEN": "t",
        "ROOMSERVICE_DATABASE_URL": "mysql+asyncmy://root@127.0.0.1:3306/room",
        "ROOMSERVICE_REDIS_URL": "redis://127.0.0.1:6379/3",
        "ROOMSERVICE_NATS_URL": "nats://127.0.0.1:4222",
        "ROOMSERVICE_HTTP_PORT": "0",
        "ROOMSERVICE_ACTIVITY_TARGET": "127.0.0.1:9000",
        **DOCKER_SECRETS,
        "ROOMSERVICE_GRPC_HOST": "127.0.0.1",
        "ROOMSERVICE_GRPC_PORT": "0",
    }
    s = load_settings(PACKAGED / "docker.yaml", env=env)
    assert (s.grpc.host, s.grpc.port) == ("127.0.0.1", 0)
    assert s.database.url == "mysql+asyncmy://root@127.0.0.1:3306/room"
    assert s.redis.url == "redis://127.0.0.1:6379/3"
    assert s.broker.nats.url == "nats://127.0.0.1:4222"
    assert s.http.port == 0
    assert s.activity.target == "127.0.0.1:9000"


@pytest.mark.usefixtures("all_built")
def test_tencent_cloud_sample_im_base_url_is_overridden() -> None:
    s = load_settings(
        PACKAGED / "tencent-cloud.yaml", env={**TENCENT_ENV, "TENCENT_IM_BASE_URL": "https://adminapisgp.im.qcloud.com"}
    )
    assert s.tencent_im.base_url == "https://adminapisgp.im.qcloud.com"


def test_a_default_may_hold_braces_and_nested_references() -> None:
    text = (
        'database: {url: "${DB:-sqlite+aiosqlite:///{data_dir}/room.db}"}\nactivity: {target: "${A:-${H:-act}:9000}"}\n'
    )
    s = settings_from_yaml(text, env={})
    assert s.database.url == "sqlite+aiosqlite:///{data_dir}/room.db"
    assert s.activity.target == "act:9000"
    assert settings_from_yaml(text, env={"H": "h"}).activity.target == "h:9000"
    assert settings_from_yaml(text, env={"A": "${H}:1", "H": "h"}).activity.target == "${H}:1"  # values stay as given
    assert settings_from_yaml('activity: {target: "${A:-$${x}}"}', env={}).activity.target == "${x}"
    with pytest.raises(ConfigError, match=r"activity\.target: environment variable H is not set"):
        settings_from_yaml('activity: {target: "${A:-${H}}"}', env={})


# --------------------------------------------------------------------------- inactive keys


def test_every_inactive_rule_names_real_keys() -> None:
    keys = list(setting_keys())
    for rule in INACTIVE_RULES:
        for pattern in rule.keys:
            assert any(rule.covers(k) for k in keys if k.startswith(pattern.rstrip("*"))), pattern
        assert set(rule.exclude) <= set(keys)


def test_inactive_keys_of_the_embedded_default() -> None:
    inactive = dict(inactive_keys(load_settings(env={})))
    for key in [
        "broker.nats.url",
        "rocketmq.name_servers",
        "rocketmq.secret_key",
        "rocketmq.namespace",
        "activity.target",
        "redis.url",
        "redis.password",
        "lease.ttl",
        "grpc.shared_secret",
        "grpc.forward_timeout",
        "wallet.url",
        "wallet.api_key",
    ]:
        assert key in inactive, key
    assert inactive["lease.ttl"] == "lease.driver is inprocess: in-process leases never expire"
    assert inactive["redis.url"] == "lease.driver is not redis: only Redis leases use it"
    for key in [
        "rocketmq.enabled",
        "rocketmq.treasure_open.enabled",
        "rocketmq.treasure_open.topic",
        "rocketmq.room_outbox.topic",
        "rocketmq.room_outbox.consumer_max_reconsume_times",
        "broker.driver",
        "broker.embedded.poll_interval",
        "consumers.activity.group",
        "outbox_worker.batch_size",
        "tencent_im.base_url",
        "wallet.starting_balance",
        "lease.driver",
        "database.url",
        "metrics.enabled",
        "gifts",
    ]:
        assert key not in inactive, key


def test_inactive_keys_follow_the_choices() -> None:
    s = load({"outbox_worker": {"enabled": False}, "wallet": {"driver": "http", "url": "http://w"}})
    inactive = dict(inactive_keys(s))
    assert "tencent_im.base_url" in inactive and "activity.target" in inactive
    assert "outbox_worker.batch_size" in inactive and "outbox_worker.publish_mode" in inactive
    # the treasure timer and retention still run without the worker
    assert "outbox_worker.poll_interval" not in inactive
    assert "outbox_worker.delivered_retention" not in inactive
    assert "wallet.starting_balance" in inactive and "wallet.url" not in inactive
    assert "wallet.timeout" not in inactive  # the http wallet's debit goes out before the commit
    assert "wallet.timeout" in dict(inactive_keys(load({})))  # the embedded one is a write of the commit
    # the consumers' back-off: only where a group runs (the code's defaults run none)
    assert "consumers.max_backoff" in dict(inactive_keys(load({})))
    assert "consumers.max_backoff" not in dict(inactive_keys(load({"consumers": {"notice": {"enabled": True}}})))
    assert "consumers.max_backoff" not in dict(inactive_keys(load({"rocketmq": {"treasure_open": {"enabled": True}}})))
    assert "consumers.visibility_timeout" in dict(inactive_keys(load({})))
    assert "consumers.visibility_timeout" not in dict(inactive_keys(load({"consumers": {"notice": {"enabled": True}}})))
    no_im = dict(inactive_keys(load({"tencent_im": {"enabled": False}})))
    assert no_im["tencent_im.group_type"] == "tencent_im.enabled is false"
    assert "tencent_im.enabled" not in no_im and "activity.target" not in no_im


@pytest.mark.usefixtures("all_built")
def test_keys_become_active_when_their_driver_is_chosen() -> None:
    s = load(
        {
            "outbox_worker": {"publish_mode": "mq"},
            "rocketmq": {"enabled": True, "name_server_domain": "ns", "room_outbox": {"enabled": True}},
            "broker": {"driver": "rocketmq"},
            "lease": {"driver": "redis"},
            "grpc": {"shared_secret": "p"},
        }
    )
    inactive = dict(inactive_keys(s))
    for key in [
        "broker.driver",
        "rocketmq.name_servers",
        "rocketmq.room_outbox.topic",
        "redis.url",
        "lease.ttl",
        "grpc.shared_secret",
        "grpc.forward_timeout",
    ]:
        assert key not in inactive, key
    assert inactive["broker.nats.url"] == "broker.driver is not nats"
    assert "tencent_im.base_url" in inactive  # mq: the broker carries IM work, not the worker


def test_docs_describe_every_key_and_every_choice_not_built_yet() -> None:
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    for key in setting_keys():
        assert f"`{key}`" in text, key
    for row in NOT_YET_AVAILABLE:
        assert f"`{row.key}: {row.value if not isinstance(row.value, bool) else str(row.value).lower()}`" in text, row


def test_the_visibility_timeout_is_the_key_or_twice_the_publish_timeout_at_least_5s() -> None:
    assert load({}).consumers.visibility(timedelta(seconds=3)) == timedelta(seconds=6)
    assert load({}).consumers.visibility(timedelta(seconds=1)) == timedelta(seconds=5)
    keyed = load({"consumers": {"visibility_timeout": "750ms"}}).consumers
    assert keyed.visibility(timedelta(seconds=3)) == timedelta(milliseconds=750)
    # on RocketMQ within the proxy's bounds it loads
    ok = {"broker": {"driver": "rocketmq"}, "consumers": {"visibility_timeout": "10s"}}
    assert load(ok).consumers.visibility_timeout == timedelta(seconds=10)
