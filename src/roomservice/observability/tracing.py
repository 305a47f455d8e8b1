"""OpenTelemetry tracing: the tracer the ``tracing`` block sets up, and every span of a command's way.

One trace follows a command from the request to its consumers (docs/tracing.md):

    HTTP / gRPC request (server span, continues an incoming W3C ``traceparent``)
      └ room.command <name>          the pipeline; its stages as child spans, the stages of
          ├ room.stage.<stage>       room_command_timing, built from the measured timings afterwards
          └ outbox.deliver <type>    the worker's attempt, parented to the context stored with the row
              └ broker.publish       the broker message, whose headers carry the traceparent
                  └ consume <group>  the consumer group's handling, continuing the header's context
                      └ <effect>     e.g. activity.apply: the leaderboard / reward ledger write

With ``tracing.exporter: none`` (the default) nothing is installed: :data:`ENABLED`
is false, every hook checks it first and creates no span (not even a no-op
one), and :func:`tracer` is OpenTelemetry's no-op tracer. With a tracer
installed, attributes are only built for spans that record (sampled ones).

Exporters: ``otlp`` (http/protobuf or gRPC, batched in a background thread),
``file`` (JSON lines, batched; see :class:`JsonLinesSpanExporter`), or one a
test passes to :func:`installed` (spans exported synchronously as they end).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import NoOpTracer, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from roomservice.config import TracingConfig
    from roomservice.observability.timing import CommandTiming
    from roomservice.outbox.model import ClaimedRow, Outcome

TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"
INSTRUMENTATION: Final = "roomservice"
FILE_EXPORT_DELAY_MS: Final = 500  # the file exporter's batch delay: spans reach the file within about this
# Spans waiting for export (the SDK's default is 2,048: a command makes about six, so a burst of a few
# hundred commands between two exports would already drop some); beyond it new spans are dropped.
EXPORT_QUEUE_SPANS: Final = 16_384

# Read by every hook before it does anything: False means no tracer, no span, no attribute.
ENABLED: bool = False
_tracer: Tracer = NoOpTracer()
_propagator: Final = TraceContextTextMapPropagator()

# The stages of room_command_timing, in pipeline order (CommandTiming field -> span name).
COMMAND_STAGES: Final = (
    ("lease_ms", "lease"),
    ("idempotency_ms", "idempotency"),
    ("wallet_debit_ms", "wallet_debit"),
    ("save_mutation_ms", "save_mutation"),
    ("snapshot_ms", "snapshot"),
    ("projection_ms", "projection"),
    ("tencent_im_ms", "tencent_im"),
)

T = TypeVar("T")


def tracer() -> Tracer:
    """The installed tracer (OpenTelemetry's no-op tracer when tracing is off)."""
    return _tracer


# --------------------------------------------------------------------------- set-up


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to ``path`` (created with its directory if missing).

    Each span is one ``write`` on a file opened with ``O_APPEND``, so several
    processes may share a file without interleaving lines. The fields: ``trace_id``,
    ``span_id``, ``parent_span_id`` (hex; null for a root), ``name``, ``kind``,
    ``start_unix_nano``, ``end_unix_nano``, ``status``, ``status_message``,
    ``attributes``, ``links`` and ``resource`` (its attributes: ``service.name``...).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            try:
                for span in spans:
                    os.write(self._fd, (json.dumps(span_record(span), separators=(",", ":")) + "\n").encode())
            except OSError:
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """A finished span as the file exporter writes it (plain JSON types, ids in hex)."""
    ctx = span.get_span_context()
    assert ctx is not None
    parent = span.parent
    return {
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_span_id": format(parent.span_id, "016x") if parent is not None else None,
        "name": span.name,
        "kind": span.kind.name,
        "start_unix_nano": span.start_time,
        "end_unix_nano": span.end_time,
        "status": span.status.status_code.name,
        "status_message": span.status.description,
        "attributes": _plain(span.attributes),
        "links": [
            {"trace_id": format(link.context.trace_id, "032x"), "span_id": format(link.context.span_id, "016x")}
            for link in span.links
        ],
        "resource": _plain(span.resource.attributes),
    }


def _plain(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in (attributes or {}).items()}


def file_path(config: TracingConfig, data_dir: Path | None) -> Path:
    """``tracing.file.path`` with ``{data_dir}`` resolved (a process without a data dir cannot use it)."""
    from roomservice.config import DATA_DIR_PLACEHOLDER, ConfigError

    raw = config.file.path
    if DATA_DIR_PLACEHOLDER in raw:
        if data_dir is None:
            raise ConfigError(f"tracing.file.path contains {DATA_DIR_PLACEHOLDER} but this process has no data dir")
        raw = raw.replace(DATA_DIR_PLACEHOLDER, data_dir.as_posix())
    return Path(raw).expanduser()


def _exporter(config: TracingConfig, data_dir: Path | None) -> SpanExporter:
    if config.exporter == "file":
        return JsonLinesSpanExporter(file_path(config, data_dir))
    timeout_s = config.otlp.timeout.total_seconds()
    if config.otlp.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        endpoint = config.otlp.endpoint
        insecure = not endpoint.startswith("https://")
        return GrpcExporter(endpoint=endpoint, insecure=insecure, timeout=timeout_s)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=config.otlp.endpoint, timeout=timeout_s)


def build_provider(
    config: TracingConfig,
    *,
    data_dir: Path | None = None,
    exporter: SpanExporter | None = None,
    resource_attributes: Mapping[str, str] | None = None,
) -> TracerProvider:
    """A provider for ``config``: its service name, sampler and exporter (``exporter`` replaces the
    configured one and is called synchronously as each span ends: for tests)."""
    resource = Resource.create(
        {"service.name": config.service_name, "process.pid": os.getpid(), **(resource_attributes or {})}
    )
    provider = TracerProvider(
        sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)), resource=resource, shutdown_on_exit=False
    )
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        delay = FILE_EXPORT_DELAY_MS if config.exporter == "file" else None
        processor = BatchSpanProcessor(
            _exporter(config, data_dir), max_queue_size=EXPORT_QUEUE_SPANS, schedule_delay_millis=delay
        )
        provider.add_span_processor(processor)
    return provider


@contextmanager
def installed(
    config: TracingConfig,
    *,
    data_dir: Path | None = None,
    exporter: SpanExporter | None = None,
    resource_attributes: Mapping[str, str] | None = None,
) -> Iterator[TracerProvider | None]:
    """Install the tracer ``config`` asks for while the block runs; flush and restore what was before.

    ``exporter: none`` without an ``exporter`` argument installs nothing (and leaves
    a tracer installed by someone else, e.g. a test, in place)."""
    global ENABLED, _tracer
    if exporter is None and config.exporter == "none":
        yield None
        return
    provider = build_provider(config, data_dir=data_dir, exporter=exporter, resource_attributes=resource_attributes)
    previous = (ENABLED, _tracer)
    ENABLED, _tracer = True, provider.get_tracer(INSTRUMENTATION)
    try:
        yield provider
    finally:
        ENABLED, _tracer = previous
        provider.shutdown()  # exports what is still queued


# --------------------------------------------------------------------------- propagation


def extract(carrier: Mapping[str, str] | None) -> otel_context.Context | None:
    """The context a ``traceparent`` (and ``tracestate``) in ``carrier`` names; None without a valid one."""
    if not carrier or TRACEPARENT not in carrier:
        return None
    ctx = _propagator.extract(carrier)
    if not trace.get_current_span(ctx).get_span_context().is_valid:
        return None
    return ctx


def current_traceparent() -> str | None:
    """The current span's context as a W3C ``traceparent`` (None: tracing off or no span)."""
    if not ENABLED:
        return None
    span_context = trace.get_current_span().get_span_context()
    if not span_context.is_valid:
        return None
    return f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{int(span_context.trace_flags):02x}"


def inject(headers: Mapping[str, str] | None) -> Mapping[str, str] | None:
    """``headers`` plus the current span's ``traceparent`` (unchanged when tracing is off)."""
    if not ENABLED:
        return headers
    carrier: dict[str, str] = dict(headers or {})
    _propagator.inject(carrier)
    return carrier


def grpc_metadata() -> tuple[tuple[str, str], ...]:
    """The current context as gRPC metadata for an outgoing call (empty when tracing is off)."""
    if not ENABLED:
        return ()
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return tuple(carrier.items())


# --------------------------------------------------------------------------- request spans


class HttpServerSpans:
    """ASGI middleware: one SERVER span per HTTP request, continuing an incoming ``traceparent``.

    Added to the app only when tracing is on (:func:`roomservice.api.app.create_app`).
    The span is named ``<METHOD> <route template>`` once the router matched a route.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not ENABLED:
            await self.app(scope, receive, send)
            return
        carrier = {}
        for name, value in scope["headers"]:
            if name in (b"traceparent", b"tracestate"):
                carrier[name.decode("latin-1")] = value.decode("latin-1")
        method = scope["method"]
        with _tracer.start_as_current_span(
            method, context=extract(carrier), kind=SpanKind.SERVER, record_exception=False
        ) as span:
            status = 500

            async def sending(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            try:
                await self.app(scope, receive, sending)
            finally:
                if span.is_recording():
                    route = scope.get("route")
                    template = getattr(route, "path", None)
                    if template:
                        span.update_name(f"{method} {template}")
                        span.set_attribute("http.route", template)
                    span.set_attribute("http.request.method", method)
                    span.set_attribute("url.path", scope["path"])
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))


@contextmanager
def grpc_server_span(service: str, rpc: str, metadata: Iterable[tuple[str, str | bytes]] | None) -> Iterator[None]:
    """A SERVER span around one gRPC call, continuing the ``traceparent`` of its metadata."""
    carrier = {k: v for k, v in (metadata or ()) if k in (TRACEPARENT, TRACESTATE) and isinstance(v, str)}
    with _tracer.start_as_current_span(
        f"{service}/{rpc}", context=extract(carrier), kind=SpanKind.SERVER, record_exception=False
    ) as span:
        if span.is_recording():
            span.set_attribute("rpc.system", "grpc")
            span.set_attribute("rpc.service", service)
            span.set_attribute("rpc.method", rpc)
        yield


# --------------------------------------------------------------------------- the command


async def traced_command(timing: CommandTiming, run: Callable[[], Awaitable[T]]) -> T:
    """Run the command pipeline inside a ``room.command <name>`` span.

    Its stages become child spans once it finished (:func:`_stage_spans`), from the
    durations ``room_command_timing`` measured: nothing extra on the hot path. The
    outbox rows of the command store this span's context (:func:`current_traceparent`)."""
    start_ns = time.time_ns()
    with _tracer.start_as_current_span(
        f"room.command {timing.command}",
        start_time=start_ns,
        record_exception=False,
        set_status_on_exception=False,  # the span has ended by then; its status is the timing's result
        end_on_exit=False,
    ) as span:
        try:
            return await run()
        finally:
            end_ns = time.time_ns()
            if span.is_recording():
                _describe_command(span, timing)
                _stage_spans(span, timing, start_ns, end_ns)
            span.end(end_time=end_ns)


def _describe_command(span: trace.Span, timing: CommandTiming) -> None:
    span.set_attribute("room.app_code", timing.app_code)
    span.set_attribute("room.id", timing.room_id)
    span.set_attribute("room.command", timing.command)
    span.set_attribute("room.command_id", timing.command_id)
    span.set_attribute("room.result", timing.result)
    span.set_attribute("room.version", timing.version)
    span.set_attribute("room.replayed", timing.replayed)
    if timing.result != "ok":
        span.set_status(Status(StatusCode.ERROR, timing.result))


def _stage_spans(parent: trace.Span, timing: CommandTiming, start_ns: int, end_ns: int) -> None:
    """One child span per stage that ran (``*_ms`` > 0), laid end to end from the command's start
    in pipeline order: each lasts exactly what room_command_timing measured; a step that is no
    stage (deciding, building the mutation) is not drawn, so later stages start that much early."""
    ctx = trace.set_span_in_context(parent)
    at = start_ns
    for field, stage in COMMAND_STAGES:
        ms: float = getattr(timing, field)
        if ms <= 0:
            continue
        stage_end = min(end_ns, at + int(ms * 1_000_000))
        span = _tracer.start_span(f"room.stage.{stage}", context=ctx, start_time=at, attributes={"room.stage": stage})
        span.end(end_time=stage_end)
        at = stage_end


# --------------------------------------------------------------------------- outbox, broker, consumers


async def traced_delivery(row: ClaimedRow, deliver: Callable[[ClaimedRow], Awaitable[Outcome]]) -> Outcome:
    """The worker's attempt at one row, as ``outbox.deliver <type>``: the child of the context stored
    with the row (the command that wrote it), a new root for a row stored without one."""
    parent = extract({TRACEPARENT: row.trace_context}) if row.trace_context else None
    with _tracer.start_as_current_span(
        f"outbox.deliver {row.event_type}", context=parent, kind=SpanKind.INTERNAL, record_exception=False
    ) as span:
        outcome = await deliver(row)
        if span.is_recording():
            span.set_attribute("outbox.row_id", row.id)
            span.set_attribute("outbox.event_id", row.event_id)
            span.set_attribute("outbox.event_type", row.event_type)
            span.set_attribute("outbox.attempt", row.retry_count + 1)
            span.set_attribute("outbox.targets_done", sorted(outcome.targets_done))
            span.set_attribute("outbox.delivered", outcome.delivered)
            if not outcome.delivered:
                span.set_status(Status(StatusCode.ERROR, (outcome.error or "")[:200]))
        return outcome


@contextmanager
def broker_publish_span(topic: str, *, key: str, tag: str, broker: str) -> Iterator[Mapping[str, str]]:
    """A PRODUCER span around one broker publish; yields the headers that carry its context."""
    with _tracer.start_as_current_span(f"{topic} publish", kind=SpanKind.PRODUCER, record_exception=False) as span:
        if span.is_recording():
            span.set_attribute("messaging.system", broker)
            span.set_attribute("messaging.destination.name", topic)
            span.set_attribute("messaging.message.id", key)
            span.set_attribute("messaging.message.tag", tag)
        carrier: dict[str, str] = {}
        _propagator.inject(carrier)
        yield carrier


async def traced_consume(
    group: str, key: str, tag: str, delivery_count: int, headers: Mapping[str, str], handle: Callable[[], Awaitable[T]]
) -> T:
    """One delivery's handling by ``group`` as a CONSUMER span continuing the message's headers;
    an exception marks it failed and goes on up."""
    with _tracer.start_as_current_span(
        f"consume {group}", context=extract(headers), kind=SpanKind.CONSUMER, record_exception=False
    ) as span:
        if span.is_recording():
            span.set_attribute("messaging.consumer.group.name", group)
            span.set_attribute("messaging.message.id", key)
            span.set_attribute("messaging.message.tag", tag)
            span.set_attribute("messaging.delivery_count", delivery_count)
        try:
            result = await handle()
        except BaseException as exc:
            if span.is_recording():
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:200]))
            raise
        if span.is_recording():
            span.set_attribute("consumer.outcome", str(result))
        return result


@contextmanager
def effect_span(name: str, **attributes: str) -> Iterator[trace.Span | None]:
    """A child span for a consumer group's effect (the activity group's leaderboard write);
    yields None, creating nothing, when tracing is off."""
    if not ENABLED:
        yield None
        return
    with _tracer.start_as_current_span(name, record_exception=False) as span:
        if span.is_recording():
            for k, v in attributes.items():
                span.set_attribute(k, v)
        yield span
