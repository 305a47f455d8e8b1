"""Typed configuration of room-service: a YAML file, ``${ENV}`` expansion, validated :class:`Settings`.

Pipeline of :func:`load_settings`:

1. read the YAML (the packaged ``configs/local.yaml`` when no path is given);
   duplicate keys are an error;
2. expand ``${NAME}`` / ``${NAME:-default}`` in every string value from ``env``
   (the only place the environment is read; ``$${`` writes a literal ``${``);
3. validate with pydantic models that forbid unknown keys; every failure
   becomes one :class:`ConfigError` naming each offending dotted key
   (``outbox_worker.poll_interval must be > 0``, ``gifts[1].price must be > 0``,
   ``unknown key: room.seat_cuont``);
4. refuse a choice whose feature is not built yet (one row each in
   :data:`NOT_YET_AVAILABLE`, empty today: every choice of the samples is built),
   naming the key, before any check that combines those choices.

No key is validated and then ignored: it takes effect, fails at step 4, or is
*inactive* under the chosen drivers (:data:`INACTIVE_RULES`, :func:`inactive_keys`;
``room-service config check`` lists them; docs/configuration.md documents every key).

The ``rocketmq`` and ``outbox_worker`` blocks have exactly the seed's keys and
defaults (plus our documented ``outbox_worker`` additions), so the seed's YAML
loads as is. Durations are Go-style strings (see :mod:`roomservice.durations`).
Secrets are :class:`pydantic.SecretStr` (empty = unset) and never appear in a
repr; a password written inside ``database.url`` / ``redis.url`` is moved into
the block's ``password`` field, and ``connect_url()`` puts it back.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from fnmatch import fnmatchcase
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn
from urllib.parse import quote, unquote

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from roomservice.domain.limits import ID_PATTERN
from roomservice.domain.rules import Gift, RoomRules
from roomservice.durations import format_duration, parse_duration

__all__ = [
    "ConfigError",
    "Settings",
    "format_duration",
    "load_settings",
    "parse_duration",
    "settings_from_yaml",
]

DATA_DIR_PLACEHOLDER = "{data_dir}"
DATABASE_SCHEMES = ("sqlite+aiosqlite", "mysql+asyncmy", "mariadb+asyncmy")
# A RocketMQ 5 proxy's bounds on how long a received message stays invisible (minInvisibleTimeMillsForRecv
# by default; the most it accepts): consumers.visibility_timeout must lie within them on RocketMQ.
ROCKETMQ_MIN_INVISIBLE = timedelta(seconds=10)
ROCKETMQ_MAX_INVISIBLE = timedelta(hours=12)


class ConfigError(Exception):
    """Invalid configuration; the message names every offending dotted key."""

    def __init__(self, problems: str | Sequence[str], *, source: str | None = None) -> None:
        self.problems: tuple[str, ...] = (problems,) if isinstance(problems, str) else tuple(problems)
        self.source = source
        message = "; ".join(self.problems)
        super().__init__(f"{message} (in {source})" if source else message)


# --------------------------------------------------------------------------- field types


def _fail(message: str, field: str = "") -> NoReturn:
    """Raise a validation error; ``field`` is a path relative to the validating model."""
    raise PydanticCustomError("config", "{message}", {"message": message, "field": field})


def _to_duration(value: object) -> object:
    if isinstance(value, timedelta):
        return value
    if not isinstance(value, str):
        _fail(f'must be a duration string such as "500ms", "3s" or "5m", not {type(value).__name__} {value!r}')
    try:
        return parse_duration(value)
    except ValueError as exc:
        _fail(f"is not a valid duration: {exc}")


def _positive(value: timedelta) -> timedelta:
    if value <= timedelta(0):
        _fail("must be > 0")
    return value


def _not_bool(value: object) -> object:
    if isinstance(value, bool):
        _fail("must be a number, not true/false")
    return value


def _split_list(value: object) -> object:
    """A comma-separated string (typically one ``${VAR}``) is accepted for a list of strings."""
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    return value


Duration = Annotated[timedelta, BeforeValidator(_to_duration), PlainSerializer(format_duration, when_used="json")]
PositiveDuration = Annotated[Duration, AfterValidator(_positive)]
Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool)]
# RocketMQ topic / group names (NATS subjects accept the same characters).
MQName = Annotated[str, Field(pattern=r"^[%|A-Za-z0-9_-]{1,127}$")]
NameList = Annotated[tuple[str, ...], BeforeValidator(_split_list)]


def _d(text: str) -> timedelta:
    return parse_duration(text)


class _Block(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        coerce_numbers_to_str=True,
        hide_input_in_errors=True,
    )


def _split_password(url: str) -> tuple[str, str | None]:
    """``scheme://user:pw@host/...`` -> (``scheme://user@host/...``, ``pw``); (url, None) without one.

    The password may hold raw ``@ : / ? #`` (e.g. pasted from ``${DB_PASSWORD}``):
    the host part starts after the *last* ``@``. Percent-escapes are decoded.
    """
    scheme, sep, rest = url.partition("://")
    at = rest.rfind("@")
    if not sep or rest.startswith("/") or at < 0 or ":" not in rest[:at]:
        return url, None
    user, _, password = rest[:at].partition(":")
    return f"{scheme}://{user + '@' if user else ''}{rest[at + 1 :]}", unquote(password)


def _join_password(url: str, password: str) -> str:
    if not password:
        return url
    scheme, _, rest = url.partition("://")
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    user, at, _ = authority.partition("@")
    if not at:
        user, rest = "", "@" + rest
    else:
        rest = rest[len(user) :]
    return f"{scheme}://{user}:{quote(password, safe='')}{rest}"


class _UrlWithPassword(_Block):
    """Mixin for blocks with ``url`` + ``password``: an inline URL password moves to ``password``."""

    @model_validator(mode="before")
    @classmethod
    def _extract_password(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("url"), str):
            return data
        url, password = _split_password(data["url"])
        if password is None:
            return data
        if not password:
            return {**data, "url": url}
        if data.get("password"):
            _fail("conflicts with the password inside url; set only one of them", "password")
        return {**data, "url": url, "password": password}

    def _connect_url(self, url: str, password: SecretStr) -> str:
        return _join_password(url, password.get_secret_value())


# --------------------------------------------------------------------------- seed blocks


class RoomOutboxMQConfig(_Block):
    enabled: bool = False
    topic: MQName = "hyapp_room_outbox"
    producer_group: MQName = "hyapp-room-outbox-producer"
    tencent_im_consumer_enabled: bool = False
    tencent_im_consumer_group: MQName = "hyapp-room-im-bridge"
    consumer_max_reconsume_times: Int = Field(default=16, ge=0)


class TreasureOpenMQConfig(_Block):
    enabled: bool = False
    topic: MQName = "hyapp_room_treasure_open"
    producer_group: MQName = "hyapp-room-treasure-open-producer"
    consumer_group: MQName = "hyapp-room-treasure-open"
    consumer_max_reconsume_times: Int = Field(default=16, ge=0)


class RocketMQConfig(_Block):
    """The seed's ``rocketmq`` block: switches, topics and groups for whichever broker driver runs."""

    enabled: bool = False
    name_servers: NameList = ()
    name_server_domain: str = ""
    access_key: SecretStr = SecretStr("")
    secret_key: SecretStr = SecretStr("")
    namespace: str = ""
    send_timeout: PositiveDuration = _d("3s")
    retry: Int = Field(default=2, ge=0)
    room_outbox: RoomOutboxMQConfig = RoomOutboxMQConfig()
    treasure_open: TreasureOpenMQConfig = TreasureOpenMQConfig()
    # The check that name_servers is set when enabled lives in Settings._check, after
    # the not-yet-available choices: ``enabled: true`` is one of them today.


class OutboxWorkerConfig(_Block):
    """The seed's ``outbox_worker`` block, plus lock_timeout .. jitter (ours)."""

    enabled: bool = True
    publish_mode: Literal["direct", "mq", "dual"] = "direct"
    poll_interval: PositiveDuration = _d("1s")
    batch_size: Int = Field(default=100, gt=0)
    publish_timeout: PositiveDuration = _d("3s")
    retry_strategy: Literal["exponential_backoff"] = "exponential_backoff"
    max_retry_count: Int = Field(default=10, ge=0)
    initial_backoff: PositiveDuration = _d("5s")
    max_backoff: PositiveDuration = _d("5m")
    # Ours: the claim lease, parallel publishes per batch, cleanup of delivered rows, backoff jitter.
    # lock_timeout is the lease as configured: a worker whose batch runs longer extends
    # its own claims every lock_timeout/3, and a dead worker's rows come back after it.
    lock_timeout: PositiveDuration = _d("30s")
    publish_concurrency: Int = Field(default=16, gt=0)
    delivered_retention: PositiveDuration = _d("168h")
    retention_batch_size: Int = Field(default=1000, gt=0)
    jitter: Float = Field(default=0.2, ge=0, le=1)

    @model_validator(mode="after")
    def _check(self) -> OutboxWorkerConfig:
        if self.max_backoff < self.initial_backoff:
            _fail(f"must be >= outbox_worker.initial_backoff ({format_duration(self.initial_backoff)})", "max_backoff")
        if self.lock_timeout <= self.publish_timeout:
            _fail(f"must be > outbox_worker.publish_timeout ({format_duration(self.publish_timeout)})", "lock_timeout")
        return self


# --------------------------------------------------------------------------- our blocks


class DatabaseConfig(_UrlWithPassword):
    url: str = f"sqlite+aiosqlite:///{DATA_DIR_PLACEHOLDER}/room.db"
    password: SecretStr = SecretStr("")
    auto_migrate: bool = True
    pool_size: Int = Field(default=20, ge=1)
    max_overflow: Int = Field(default=20, ge=0)
    echo: bool = False
    # The deadline D of one database call (a read, or a whole write transaction, its
    # connect and pool wait included): a call that misses it fails its command with
    # 503 unavailable and its connection is discarded. The server-side session limits
    # (MariaDB) and every other database bound are multiples of it; see
    # roomservice.store.database.
    timeout: PositiveDuration = _d("5s")

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        scheme, sep, rest = url.partition("://")
        if not sep or scheme not in DATABASE_SCHEMES:
            _fail(f"must start with one of {', '.join(s + '://' for s in DATABASE_SCHEMES)}")
        if not rest.strip("/"):
            _fail("names no database")
        return url

    @property
    def backend(self) -> Literal["sqlite", "mysql"]:
        return "sqlite" if self.url.startswith("sqlite") else "mysql"

    def connect_url(self) -> str:
        """The SQLAlchemy URL including the password (never log it)."""
        if DATA_DIR_PLACEHOLDER in self.url:
            raise ConfigError(f"database.url still contains {DATA_DIR_PLACEHOLDER}; call Settings.with_data_dir first")
        return self._connect_url(self.url, self.password)


class RedisConfig(_UrlWithPassword):
    url: str = "redis://127.0.0.1:6379/0"
    password: SecretStr = SecretStr("")
    # bounds of one Redis call: reading a reply, and connecting; a call fails by their sum
    socket_timeout: PositiveDuration = _d("1s")
    socket_connect_timeout: PositiveDuration = _d("1s")
    # every key this service writes starts with it (projections); processes sharing one
    # deployment use the same prefix, two deployments on one Redis different ones
    key_prefix: str = Field(default="roomservice:", pattern=r"^[A-Za-z0-9_.:-]{0,64}$")

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        if url and not url.startswith(("redis://", "rediss://", "unix://")):
            _fail("must start with redis://, rediss:// or unix://")
        return url

    def connect_url(self) -> str:
        """The redis URL including the password (never log it)."""
        return self._connect_url(self.url, self.password)


class HttpConfig(_Block):
    host: str = Field(default="127.0.0.1", min_length=1)
    port: Int = Field(default=8080, ge=0, le=65535)  # 0 = pick a free port
    # a request body must have fully arrived this long after the route starts reading it (else 400, closed)
    body_read_timeout: PositiveDuration = _d("10s")


class GrpcConfig(_Block):
    """The internal gRPC room API every ``serve`` process runs (gateways and forwarding between processes)."""

    host: str = Field(default="127.0.0.1", min_length=1)
    port: Int = Field(default=0, ge=0, le=65535)  # 0 = a free port (N processes on one machine, one file)
    # where other processes reach this one ("host:port"); empty: host and the bound port
    advertise_address: str = ""
    # authenticates calls between processes (x-roomservice-peer-secret); required with lease.driver redis
    shared_secret: SecretStr = SecretStr("")
    # the deadline of one forwarded call (the hop to the room's owner)
    forward_timeout: PositiveDuration = _d("3s")


class RoomConfig(_Block):
    seat_count: Int = Field(default=8, ge=1, le=20)
    snapshot_every_n: Int = Field(default=50, ge=1)
    idle_evict_after: PositiveDuration = _d("10m")
    idempotency_retention: PositiveDuration = _d("168h")
    default_ban_seconds: Int = Field(default=600, ge=1, le=2_592_000)


class GiftConfig(_Block):
    id: str = Field(pattern=ID_PATTERN)
    name: str = Field(min_length=1, max_length=64)
    price: Int = Field(gt=0, le=1_000_000_000)  # bounded so count x price x heat stays far below 2^63


def _strictly_increasing(levels: tuple[int, ...]) -> tuple[int, ...]:
    for i in range(1, len(levels)):
        if levels[i] <= levels[i - 1]:
            _fail(f"must be strictly increasing (levels[{i}] = {levels[i]} <= levels[{i - 1}] = {levels[i - 1]})")
    return levels


class TreasureConfig(_Block):
    levels: Annotated[tuple[Annotated[Int, Field(gt=0)], ...], AfterValidator(_strictly_increasing)] = Field(
        default=(1000, 5000, 20000), min_length=1
    )
    # A countdown longer than a day could never open before the UTC reset.
    countdown_seconds: Int = Field(default=60, ge=1, le=86_400)


class WalletConfig(_Block):
    driver: Literal["embedded", "http"] = "embedded"
    starting_balance: Int = Field(default=100_000, ge=0)
    reconcile_after: PositiveDuration = _d("10m")
    reconcile_interval: PositiveDuration = _d("1m")
    timeout: PositiveDuration = _d("2s")
    url: str = ""
    api_key: SecretStr = SecretStr("")

    @model_validator(mode="after")
    def _check(self) -> WalletConfig:
        if self.driver == "http" and not self.url.startswith(("http://", "https://")):
            _fail("must be an http(s) URL when wallet.driver is http", "url")
        return self


class AdminConfig(_Block):
    token: SecretStr = SecretStr("")  # empty: the embedded default generates one


class ConsoleConfig(_Block):
    """The operators' web console under ``/console/`` (docs/console.md), behind ``admin.token``."""

    enabled: bool = True
    session_ttl: PositiveDuration = _d("8h")  # a login lasts this long; then the operator logs in again


class LeaseConfig(_Block):
    driver: Literal["inprocess", "redis"] = "inprocess"
    ttl: PositiveDuration = _d("10s")
    # a held lease is renewed this long after its last confirmed renewal (well before expiry)
    renew_every: PositiveDuration = _d("3s")
    # a lease stops serving this long before it could have expired in Redis
    safety_margin: PositiveDuration = _d("2s")

    @model_validator(mode="after")
    def _check(self) -> LeaseConfig:
        if self.safety_margin >= self.ttl:
            _fail(f"must be < lease.ttl ({format_duration(self.ttl)})", "safety_margin")
        if self.renew_every >= self.ttl - self.safety_margin:
            _fail(
                f"must be < lease.ttl - lease.safety_margin ({format_duration(self.ttl - self.safety_margin)})",
                "renew_every",
            )
        return self


class NatsConfig(_Block):
    url: str = "nats://127.0.0.1:4222"
    # The topics' stream; dead letters go to "<stream>_dlq".
    stream: str = Field(default="hyapp_room", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    connect_timeout: PositiveDuration = _d("2s")
    # Ours: how long both streams keep messages (a stopped group's backlog, dead letters),
    # the Nats-Msg-Id duplicate window (a re-publish of one event_id inside it is stored
    # once; it must cover the outbox worker's retry horizon), and replicas per stream.
    max_age: PositiveDuration = _d("168h")
    duplicate_window: PositiveDuration = _d("2h")
    replicas: Int = Field(default=1, ge=1, le=5)

    @model_validator(mode="after")
    def _check(self) -> NatsConfig:
        if self.duplicate_window > self.max_age:
            _fail(f"must be <= broker.nats.max_age ({format_duration(self.max_age)})", "duplicate_window")
        return self


class EmbeddedBrokerConfig(_Block):
    poll_interval: PositiveDuration = _d("200ms")
    # What the maintenance role purges, oldest first, at most cleanup_batch_size rows a pass:
    # messages every group acknowledged, dead letters and a stopped group's backlog once
    # older than retention (a duplicate publish of a retained message is stored once).
    retention: PositiveDuration = _d("168h")
    cleanup_batch_size: Int = Field(default=1000, gt=0)


class BrokerConfig(_Block):
    driver: Literal["embedded", "nats", "rocketmq"] = "embedded"
    nats: NatsConfig = NatsConfig()
    embedded: EmbeddedBrokerConfig = EmbeddedBrokerConfig()


class TencentIMConfig(_Block):
    enabled: bool = True
    base_url: str = ""  # empty: the in-process IM sandbox
    sdk_app_id: Int = Field(default=0, ge=0)
    admin_identifier: str = Field(default="administrator", min_length=1)
    secret_key: SecretStr = SecretStr("")
    group_type: Literal["AVChatRoom", "ChatRoom", "Public", "Work", "Meeting", "Community"] = "AVChatRoom"
    request_timeout: PositiveDuration = _d("3s")
    rate_limit_per_second: Int = Field(default=200, gt=0)
    usersig_ttl: PositiveDuration = _d("24h")

    @field_validator("base_url")
    @classmethod
    def _check_base_url(cls, url: str) -> str:
        if url and not url.startswith(("http://", "https://")):
            _fail("must be empty (IM sandbox) or an http(s) URL")
        return url.rstrip("/")

    @model_validator(mode="after")
    def _check(self) -> TencentIMConfig:
        if self.enabled and self.base_url:
            if self.sdk_app_id <= 0:
                _fail("must be > 0 when tencent_im.base_url is set", "sdk_app_id")
            if not self.secret_key.get_secret_value():
                _fail("must be set when tencent_im.base_url is set", "secret_key")
        return self


class ActivityConfig(_Block):
    target: str = ""  # empty: the in-process reference activity service; else host:port


def _lower(value: object) -> object:
    return value.lower() if isinstance(value, str) else value


with warnings.catch_warnings():  # the YAML key `json` shadows the deprecated BaseModel.json(); intended
    warnings.filterwarnings("ignore", message='Field name "json"', category=UserWarning)

    class LoggingConfig(_Block):
        level: Annotated[Literal["debug", "info", "warning", "error", "critical"], BeforeValidator(_lower)] = "info"
        json: bool = True  # type: ignore[assignment]  # one JSON object per line


class MetricsConfig(_Block):
    enabled: bool = True


class OtlpExporterConfig(_Block):
    """Where ``tracing.exporter: otlp`` sends spans (OTLP over HTTP with protobuf bodies, or gRPC)."""

    # http/protobuf: the traces URL, e.g. http://collector:4318/v1/traces; grpc: host:port or http(s)://host:port
    endpoint: str = ""
    protocol: Literal["http/protobuf", "grpc"] = "http/protobuf"
    timeout: PositiveDuration = _d("10s")  # one export call


class TracingFileConfig(_Block):
    """``tracing.exporter: file``: one JSON object per span, appended (several processes may share the file)."""

    path: str = Field(default=DATA_DIR_PLACEHOLDER + "/traces.jsonl", min_length=1)


class TracingConfig(_Block):
    """OpenTelemetry tracing (docs/tracing.md). ``none``: no tracer at all, nothing recorded or stored."""

    exporter: Literal["none", "otlp", "file"] = "none"
    service_name: str = Field(default="room-service", min_length=1, max_length=128)
    # the share of new traces recorded; a request that arrives with a traceparent follows its sampled flag
    sample_ratio: Float = Field(default=1.0, ge=0.0, le=1.0)
    otlp: OtlpExporterConfig = OtlpExporterConfig()
    file: TracingFileConfig = TracingFileConfig()

    @model_validator(mode="after")
    def _check(self) -> TracingConfig:
        if self.exporter == "otlp":
            endpoint = self.otlp.endpoint
            if not endpoint:
                _fail("must be set when tracing.exporter is otlp", "otlp.endpoint")
            if self.otlp.protocol == "http/protobuf" and not endpoint.startswith(("http://", "https://")):
                _fail("must be an http(s) URL with tracing.otlp.protocol http/protobuf", "otlp.endpoint")
        return self


class ActivityConsumerConfig(_Block):
    enabled: bool = False  # in production the activity service owns this group
    group: MQName = "hyapp-activity-room-outbox"


class NoticeConsumerConfig(_Block):
    enabled: bool = False  # in production the notice service owns this group
    group: MQName = "hyapp-notice-room-outbox"


class ConsumersConfig(_Block):
    """Our reference consumers of the room_outbox topic (the IM bridge's switch is the seed's
    ``rocketmq.room_outbox.tencent_im_consumer_enabled``; treasure-open's is ``rocketmq.treasure_open.enabled``)."""

    activity: ActivityConsumerConfig = ActivityConsumerConfig()
    notice: NoticeConsumerConfig = NoticeConsumerConfig()
    # Ours: every group's negative-ack back-off. After its n-th failed delivery a message comes back after
    # min(max_backoff, initial_backoff * 2**(n-1)), ± 20 % jitter (the broker dead-letters it after
    # rocketmq.*.consumer_max_reconsume_times redeliveries, whatever the back-off).
    initial_backoff: PositiveDuration = _d("1s")
    max_backoff: PositiveDuration = _d("1m")
    # Ours: how long a delivery may go unacknowledged (a consumer that died) before the broker hands it
    # out again, in every group; a delivery held by a live consumer is touched every third of it (a handler
    # running past ten of it is cancelled as hung). Unset: max(5s, 2 × outbox_worker.publish_timeout).
    visibility_timeout: PositiveDuration | None = None
    # Ours: how long an applied event's id is remembered by what deduplicates on it — the IM
    # publisher and bridge (im_sent_event), the activity service (activity_processed_event), the notice
    # group (notice_delivery_events once sent or failed) — once its outbox row is gone. The maintenance
    # role (and `room-service activity serve`) forgets older ids in bounded batches; the same event
    # delivered again after that is applied again.
    dedup_retention: PositiveDuration = _d("720h")

    def visibility(self, publish_timeout: timedelta) -> timedelta:
        """The visibility timeout in force: the key, or the default derived from ``publish_timeout``."""
        if self.visibility_timeout is not None:
            return self.visibility_timeout
        return max(timedelta(seconds=5), 2 * publish_timeout)

    @model_validator(mode="after")
    def _check(self) -> ConsumersConfig:
        if self.max_backoff < self.initial_backoff:
            _fail(f"must be >= consumers.initial_backoff ({format_duration(self.initial_backoff)})", "max_backoff")
        return self


# --------------------------------------------------------------------------- settings


class Settings(_Block):
    """The whole configuration. Immutable; derive variants with ``model_copy``/``with_overrides``."""

    rocketmq: RocketMQConfig = RocketMQConfig()
    outbox_worker: OutboxWorkerConfig = OutboxWorkerConfig()
    database: DatabaseConfig = DatabaseConfig()
    redis: RedisConfig = RedisConfig()
    http: HttpConfig = HttpConfig()
    grpc: GrpcConfig = GrpcConfig()
    room: RoomConfig = RoomConfig()
    gifts: tuple[GiftConfig, ...] = ()
    treasure: TreasureConfig = TreasureConfig()
    wallet: WalletConfig = WalletConfig()
    admin: AdminConfig = AdminConfig()
    console: ConsoleConfig = ConsoleConfig()
    lease: LeaseConfig = LeaseConfig()
    broker: BrokerConfig = BrokerConfig()
    tencent_im: TencentIMConfig = TencentIMConfig()
    activity: ActivityConfig = ActivityConfig()
    logging: LoggingConfig = LoggingConfig()
    metrics: MetricsConfig = MetricsConfig()
    tracing: TracingConfig = TracingConfig()
    consumers: ConsumersConfig = ConsumersConfig()
    _data_dir: Path | None = PrivateAttr(default=None)  # set by with_data_dir, never read from a file

    @property
    def data_dir(self) -> Path | None:
        """The absolute data dir given to :meth:`with_data_dir` (``None``: never given one)."""
        return self._data_dir

    @model_validator(mode="after")
    def _check(self) -> Settings:
        seen: dict[str, int] = {}
        for i, gift in enumerate(self.gifts):
            if gift.id in seen:
                _fail(f'duplicates "{gift.id}" (gifts[{seen[gift.id]}])', f"gifts[{i}].id")
            seen[gift.id] = i
        unavailable = [row.problem() for row in NOT_YET_AVAILABLE if row.chosen_in(self)]
        if unavailable:  # decisive: the checks below are about combinations of these choices
            raise PydanticCustomError("config_unavailable", "{problems}", {"problems": tuple(unavailable)})
        if self.rocketmq.enabled and not self.rocketmq.name_servers and not self.rocketmq.name_server_domain:
            _fail(
                "must not be empty when rocketmq.enabled is true (or set name_server_domain)", "rocketmq.name_servers"
            )
        if self.broker.driver == "nats" and not self.broker.nats.url:
            _fail("must be set when broker.driver is nats", "broker.nats.url")
        broker_problem = self._broker_problem()
        if self.outbox_worker.publish_mode in ("mq", "dual"):
            mode = self.outbox_worker.publish_mode
            if not self.rocketmq.room_outbox.enabled:
                _fail(f"must be true when outbox_worker.publish_mode is {mode}", "rocketmq.room_outbox.enabled")
            if broker_problem:
                _fail(f"{mode} needs a usable broker: {broker_problem}", "outbox_worker.publish_mode")
        if self.rocketmq.treasure_open.enabled and broker_problem:
            _fail(f"needs a usable broker: {broker_problem}", "rocketmq.treasure_open.enabled")
        visibility = self.consumers.visibility_timeout
        if self.broker.driver == "rocketmq" and visibility is not None and not (
            ROCKETMQ_MIN_INVISIBLE <= visibility <= ROCKETMQ_MAX_INVISIBLE
        ):
            _fail(
                f"must be between {format_duration(ROCKETMQ_MIN_INVISIBLE)} and "
                f"{format_duration(ROCKETMQ_MAX_INVISIBLE)} when broker.driver is rocketmq (a RocketMQ 5 proxy "
                "keeps a received message invisible for at least minInvisibleTimeMillsForRecv, 10s by default, "
                "and at most 12h)",
                "consumers.visibility_timeout",
            )
        dedup, delivered = self.consumers.dedup_retention, self.outbox_worker.delivered_retention
        if dedup < delivered:
            _fail(
                f"must be >= outbox_worker.delivered_retention ({format_duration(delivered)}): the IM bridge "
                "reads a room's outbox rows against their sent records",
                "consumers.dedup_retention",
            )
        if self.broker.driver == "embedded" and _broker_in_use(self) and dedup < self.broker.embedded.retention:
            _fail(
                f"must be >= broker.embedded.retention ({format_duration(self.broker.embedded.retention)}): "
                "a message the broker keeps may be delivered again",
                "consumers.dedup_retention",
            )
        if self.lease.driver == "redis" and not self.redis.url:
            _fail("must be set when lease.driver is redis", "redis.url")
        if self.lease.driver == "redis" and not self.grpc.shared_secret.get_secret_value():
            _fail("must be set when lease.driver is redis (it authenticates forwarded calls)", "grpc.shared_secret")
        if self.lease.driver == "redis":  # N processes: the in-process helpers must not multiply
            if self.tencent_im.enabled and not self.tencent_im.base_url and _talks_to_im(self):
                _fail(
                    "must be set when lease.driver is redis: the processes share one IM (Tencent IM, or one "
                    "`room-service im-sandbox`), not an in-process sandbox each",
                    "tencent_im.base_url",
                )
            if _publishes_direct(self) and not self.activity.target:
                _fail(
                    "must be set when lease.driver is redis: the processes share one activity service "
                    "(`room-service activity serve`), not an in-process one each",
                    "activity.target",
                )
        return self

    def _broker_problem(self) -> str | None:
        if self.broker.driver == "rocketmq" and not self.rocketmq.enabled:
            return "broker.driver is rocketmq but rocketmq.enabled is false"
        return None

    def with_data_dir(self, data_dir: Path) -> Settings:
        """Resolve ``{data_dir}`` in ``database.url`` to the absolute ``data_dir`` and remember
        it as :attr:`data_dir` (where the embedded parts keep their files)."""
        path = Path(data_dir).expanduser().resolve()
        settings = self.model_copy()
        if DATA_DIR_PLACEHOLDER in self.database.url:
            url = self.database.url.replace(DATA_DIR_PLACEHOLDER, path.as_posix())
            settings = self.model_copy(update={"database": self.database.model_copy(update={"url": url})})
        settings._data_dir = path
        return settings

    def with_overrides(self, overrides: Mapping[str, object]) -> Settings:
        """A re-validated copy with dotted keys replaced, e.g. ``{"outbox_worker.publish_mode": "mq"}``.

        Values go through the same validation as YAML values (strings such as
        ``"5s"`` or ``"8"`` are fine). Raises :class:`ConfigError`.
        """
        data: dict[str, Any] = self.model_dump(by_alias=True)
        for dotted, value in overrides.items():
            node = data
            *parents, leaf = dotted.split(".")
            for part in parents:
                child = node.get(part)
                if not isinstance(child, dict):
                    raise ConfigError(f"unknown key: {dotted}")
                node = child
            if leaf not in node:
                raise ConfigError(f"unknown key: {dotted}")
            node[leaf] = value
        settings = _validate(data, source=None)
        settings._data_dir = self._data_dir
        return settings

    def room_rules(self) -> RoomRules:
        """The configurable room rules handed to the domain's ``decide``."""
        return RoomRules(
            gifts={g.id: Gift(id=g.id, name=g.name, price=g.price) for g in self.gifts},
            default_seat_count=self.room.seat_count,
            default_ban_seconds=self.room.default_ban_seconds,
            treasure_levels=tuple(self.treasure.levels),
            treasure_countdown_ms=self.treasure.countdown_seconds * 1000,
        )


# --------------------------------------------------------------------------- choices not built yet


@dataclass(frozen=True, slots=True)
class NotYetAvailable:
    """A valid choice whose feature is not built yet: loading fails naming ``key``.

    Delete the row in the change that builds the feature (and make its keys take effect)."""

    key: str  # dotted key
    value: object  # the choice that needs the missing feature
    missing: str  # what is not built
    instead: str  # what to write instead

    def chosen_in(self, settings: Settings) -> bool:
        return bool(setting(settings, self.key) == self.value)

    def problem(self) -> str:
        return f"{self.key}: {_show(self.value)} is not available yet ({self.missing}); {self.instead}"


NOT_YET_AVAILABLE: tuple[NotYetAvailable, ...] = ()


def _show(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"'{value}'" if isinstance(value, str) else repr(value)


def setting(settings: Settings, key: str) -> object:
    """The value of a dotted key, e.g. ``setting(s, "broker.nats.url")``."""
    value: object = settings
    for part in key.split("."):
        value = getattr(value, part)
    return value


def setting_keys(model: type[BaseModel] = Settings, prefix: str = "") -> Iterator[str]:
    """Every dotted key of the configuration, in declaration order (``gifts`` is one key)."""
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from setting_keys(field.annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


# --------------------------------------------------------------------------- inactive keys


def _consumes_room_outbox(s: Settings) -> bool:
    return (
        s.rocketmq.room_outbox.tencent_im_consumer_enabled or s.consumers.activity.enabled or s.consumers.notice.enabled
    )


def _broker_in_use(s: Settings) -> bool:
    return (
        s.outbox_worker.publish_mode in ("mq", "dual") or s.rocketmq.treasure_open.enabled or _consumes_room_outbox(s)
    )


def _publishes_outbox_to_broker(s: Settings) -> bool:
    return s.outbox_worker.enabled and s.outbox_worker.publish_mode in ("mq", "dual")


def _talks_to_im(s: Settings) -> bool:
    return (
        _publishes_direct(s) or s.rocketmq.room_outbox.tencent_im_consumer_enabled or s.consumers.notice.enabled
    )


def _publishes_direct(s: Settings) -> bool:
    return s.outbox_worker.enabled and s.outbox_worker.publish_mode in ("direct", "dual")


@dataclass(frozen=True, slots=True)
class InactiveRule:
    """``keys`` (``fnmatch`` patterns of dotted keys, minus ``exclude``) do nothing when ``applies``."""

    keys: tuple[str, ...]
    applies: Callable[[Settings], bool]
    reason: str
    exclude: tuple[str, ...] = ()

    def covers(self, key: str) -> bool:
        return any(fnmatchcase(key, k) for k in self.keys) and key not in self.exclude


# The keys where configs/local.yaml (the embedded default, `serve` with no --config) differs from the
# code's defaults in topology: it runs mq on the embedded broker with the four consumer groups, the
# code's defaults are the seed's direct mode with every group off. Overriding these on top of local.yaml
# gives the code's defaults back (tests/unit/test_config.py checks it); tests and benchmarks use it to
# run the packaged sample in direct mode.
DIRECT_TOPOLOGY: dict[str, Any] = {
    "outbox_worker.publish_mode": "direct",
    "rocketmq.room_outbox.enabled": False,
    "rocketmq.room_outbox.tencent_im_consumer_enabled": False,
    "rocketmq.treasure_open.enabled": False,
    "consumers.activity.enabled": False,
    "consumers.notice.enabled": False,
}


INACTIVE_RULES: tuple[InactiveRule, ...] = (
    InactiveRule(
        ("broker.*",),
        lambda s: not _broker_in_use(s),
        "nothing uses a broker (outbox_worker.publish_mode is direct, rocketmq.treasure_open.enabled and "
        "rocketmq.room_outbox.tencent_im_consumer_enabled are false)",
    ),
    InactiveRule(("broker.nats.*",), lambda s: s.broker.driver != "nats", "broker.driver is not nats"),
    InactiveRule(("broker.embedded.*",), lambda s: s.broker.driver != "embedded", "broker.driver is not embedded"),
    InactiveRule(
        (
            "rocketmq.name_servers",
            "rocketmq.name_server_domain",
            "rocketmq.access_key",
            "rocketmq.secret_key",
            "rocketmq.send_timeout",
            "rocketmq.retry",
        ),
        lambda s: not (s.broker.driver == "rocketmq" and _broker_in_use(s)),
        "broker.driver is not rocketmq, or nothing uses the broker: only the RocketMQ driver connects to RocketMQ",
    ),
    InactiveRule(
        ("rocketmq.namespace",),
        lambda s: not (s.broker.driver in ("rocketmq", "nats") and _broker_in_use(s)),
        "only the RocketMQ driver (namespace) and the NATS driver (subject prefix) use it, with a broker in use",
    ),
    InactiveRule(
        ("rocketmq.room_outbox.enabled", "rocketmq.room_outbox.producer_group"),
        lambda s: not _publishes_outbox_to_broker(s),
        "nothing publishes the outbox to a broker (only outbox_worker.publish_mode mq and dual do)",
    ),
    InactiveRule(
        ("rocketmq.room_outbox.topic",),
        lambda s: not _publishes_outbox_to_broker(s) and not _consumes_room_outbox(s),
        "nothing publishes to or consumes the room_outbox topic (publish_mode is direct, no consumer is enabled)",
    ),
    InactiveRule(
        ("rocketmq.room_outbox.tencent_im_consumer_group",),
        lambda s: not s.rocketmq.room_outbox.tencent_im_consumer_enabled,
        "the IM bridge does not run (rocketmq.room_outbox.tencent_im_consumer_enabled is false)",
    ),
    InactiveRule(
        ("rocketmq.room_outbox.consumer_max_reconsume_times",),
        lambda s: not _consumes_room_outbox(s),
        "no room_outbox consumer runs (the IM bridge, consumers.activity and consumers.notice are off)",
    ),
    InactiveRule(
        ("consumers.initial_backoff", "consumers.max_backoff", "consumers.visibility_timeout"),
        lambda s: not (_consumes_room_outbox(s) or s.rocketmq.treasure_open.enabled),
        "no consumer group runs (the IM bridge, consumers.activity, consumers.notice, rocketmq.treasure_open are off)",
    ),
    InactiveRule(
        ("consumers.activity.group",), lambda s: not s.consumers.activity.enabled, "consumers.activity.enabled is false"
    ),
    InactiveRule(
        ("consumers.notice.group",), lambda s: not s.consumers.notice.enabled, "consumers.notice.enabled is false"
    ),
    InactiveRule(
        ("rocketmq.treasure_open.*",),
        lambda s: not s.rocketmq.treasure_open.enabled,
        "rocketmq.treasure_open.enabled is false: treasure boxes open from the durable database timer",
        exclude=("rocketmq.treasure_open.enabled",),
    ),
    InactiveRule(
        ("redis.*",), lambda s: s.lease.driver != "redis", "lease.driver is not redis: only Redis leases use it"
    ),
    InactiveRule(
        ("grpc.shared_secret", "grpc.forward_timeout"),
        lambda s: s.lease.driver != "redis",
        "lease.driver is not redis: one process owns every room, nothing is forwarded between processes",
    ),
    InactiveRule(
        ("lease.ttl", "lease.renew_every", "lease.safety_margin"),
        lambda s: s.lease.driver == "inprocess",
        "lease.driver is inprocess: in-process leases never expire",
    ),
    InactiveRule(
        (
            "outbox_worker.publish_mode",
            "outbox_worker.batch_size",
            "outbox_worker.publish_timeout",
            "outbox_worker.retry_strategy",
            "outbox_worker.max_retry_count",
            "outbox_worker.initial_backoff",
            "outbox_worker.max_backoff",
            "outbox_worker.lock_timeout",
            "outbox_worker.publish_concurrency",
            "outbox_worker.jitter",
        ),
        lambda s: not s.outbox_worker.enabled,
        "outbox_worker.enabled is false: no worker claims outbox rows",
    ),
    InactiveRule(
        ("activity.target",),
        lambda s: not _publishes_direct(s),
        "no direct publishing: the activity publisher runs only with outbox_worker.enabled and publish_mode "
        "direct or dual (the activity consumer group works in this process's database)",
    ),
    InactiveRule(
        ("tencent_im.*",),
        lambda s: not (
            _publishes_direct(s) or s.rocketmq.room_outbox.tencent_im_consumer_enabled or s.consumers.notice.enabled
        ),
        "nothing talks to Tencent IM: no direct publishing (publish_mode direct/dual), no IM bridge, no notice group",
    ),
    InactiveRule(
        ("tencent_im.*",),
        lambda s: not s.tencent_im.enabled,
        "tencent_im.enabled is false",
        exclude=("tencent_im.enabled",),
    ),
    InactiveRule(
        ("tracing.*",),
        lambda s: s.tracing.exporter == "none",
        "tracing.exporter is none: no tracer runs",
        exclude=("tracing.exporter",),
    ),
    InactiveRule(("tracing.otlp.*",), lambda s: s.tracing.exporter != "otlp", "tracing.exporter is not otlp"),
    InactiveRule(("tracing.file.*",), lambda s: s.tracing.exporter != "file", "tracing.exporter is not file"),
    InactiveRule(("console.session_ttl",), lambda s: not s.console.enabled, "console.enabled is false"),
    InactiveRule(("wallet.url", "wallet.api_key"), lambda s: s.wallet.driver != "http", "wallet.driver is not http"),
    InactiveRule(
        ("wallet.starting_balance",), lambda s: s.wallet.driver != "embedded", "wallet.driver is not embedded"
    ),
    InactiveRule(
        ("wallet.timeout",),
        lambda s: s.wallet.driver == "embedded",
        "wallet.driver is embedded: a gift's debit is written in its own commit, under database.timeout",
    ),
)


def inactive_keys(settings: Settings) -> list[tuple[str, str]]:
    """``(dotted key, why it does nothing)`` for every key that ``settings``' choices leave unused."""
    out: list[tuple[str, str]] = []
    for key in setting_keys():
        for rule in INACTIVE_RULES:
            if rule.covers(key) and rule.applies(settings):
                out.append((key, rule.reason))
                break
    return out


# --------------------------------------------------------------------------- loading


def load_settings(path: str | Path | None = None, *, env: Mapping[str, str] | None = None) -> Settings:
    """Load, expand and validate a YAML config; ``None`` = the packaged ``configs/local.yaml``."""
    if path is None:
        resource = resources.files("roomservice").joinpath("configs", "local.yaml")
        text = resource.read_text(encoding="utf-8")
        return settings_from_yaml(text, env=env, source="roomservice/configs/local.yaml")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file: {exc.strerror or exc}", source=str(path)) from None
    return settings_from_yaml(text, env=env, source=str(path))


def settings_from_yaml(text: str, *, env: Mapping[str, str] | None = None, source: str = "<string>") -> Settings:
    """Like :func:`load_settings` for YAML text already in hand."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML: {exc}", source=source) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("the top level must be a mapping of blocks", source=source)
    problems: list[str] = []
    expanded = _expand(data, os.environ if env is None else env, "", problems)
    if problems:
        raise ConfigError(problems, source=source)
    return _validate(expanded, source=source)


def _validate(data: object, *, source: str | None) -> Settings:
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_problems(exc), source=source) from None


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys instead of keeping the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# A default may hold one level of braces: ``{data_dir}`` or a nested ``${OTHER:-x}``,
# which is expanded in turn (the environment's values never are).
_REF = re.compile(r"\$\$\{|\$\{((?:[^{}]|\{[^{}]*\})*)\}|\$\{")
_REF_BODY = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?", re.DOTALL)


def _expand(value: object, env: Mapping[str, str], path: str, problems: list[str]) -> object:
    if isinstance(value, dict):
        return {k: _expand(v, env, _join(path, k), problems) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, env, f"{path}[{i}]", problems) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value
    return _expand_str(value, env, path, problems)


def _expand_str(value: str, env: Mapping[str, str], path: str, problems: list[str]) -> str:
    def replace(match: re.Match[str]) -> str:
        token = match.group(0)
        if token == "$${":
            return "${"
        if match.group(1) is None:
            problems.append(f"{path}: unterminated ${{ (write $${{ for a literal ${{)")
            return ""
        body = _REF_BODY.fullmatch(match.group(1))
        if body is None:
            problems.append(f"{path}: invalid variable reference {token}")
            return ""
        name, default = body.groups()
        found = env.get(name)
        if found:
            return found
        if default is not None:
            return _expand_str(default, env, path, problems) if "${" in default else default
        if found is None:
            problems.append(f"{path}: environment variable {name} is not set (use ${{{name}:-default}} if optional)")
        return ""

    return _REF.sub(replace, value)


def _join(path: str, key: object) -> str:
    if isinstance(key, int) and not isinstance(key, bool):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _dotted(loc: Sequence[int | str], extra: str = "") -> str:
    path = ""
    for part in loc:
        path = _join(path, part)
    if extra:
        path = path + extra if extra.startswith("[") or not path else f"{path}.{extra}"
    return path or "configuration"


_TYPE_MESSAGES = {
    "missing": "is required",
    "string_type": "must be a string",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "list_type": "must be a list",
    "tuple_type": "must be a list",
    "dict_type": "must be a mapping",
    "model_type": "must be a mapping",
    "model_attributes_type": "must be a mapping",
}


def _problems(exc: ValidationError) -> list[str]:
    out: list[str] = []
    for err in exc.errors():
        kind, ctx = err["type"], err.get("ctx") or {}
        path = _dotted(err["loc"], str(ctx.get("field", "")) if kind == "config" else "")
        if kind == "config_unavailable":
            out.extend(p for p in ctx["problems"] if p not in out)
            continue
        if kind == "extra_forbidden":
            problem = f"unknown key: {path}"
        elif kind == "config":
            problem = f"{path} {ctx['message']}"
        elif kind in _TYPE_MESSAGES:
            problem = f"{path} {_TYPE_MESSAGES[kind]}"
        elif kind == "literal_error":
            choices = re.findall(r"'([^']*)'", str(ctx.get("expected")))
            problem = f"{path} must be one of {', '.join(choices)}"
        elif kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
            op = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}[kind]
            bound = ctx.get({">": "gt", ">=": "ge", "<": "lt", "<=": "le"}[op])
            problem = f"{path} must be {op} {bound}"
        elif kind in ("string_too_short", "too_short"):
            n = ctx.get("min_length")
            problem = f"{path} must not be empty" if n == 1 else f"{path} must have at least {n} characters/items"
        elif kind in ("string_too_long", "too_long"):
            problem = f"{path} must have at most {ctx.get('max_length')} characters/items"
        elif kind == "string_pattern_mismatch":
            problem = f"{path} must match {ctx.get('pattern')}"
        else:
            problem = f"{path}: {err['msg'].removeprefix('Value error, ')}"
        if problem not in out:
            out.append(problem)
    return out
