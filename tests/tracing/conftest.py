"""An in-memory span exporter installed as the process's tracer, and helpers to read a trace's spans."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from roomservice.config import TracingConfig
from roomservice.observability import tracing


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Every span ended while the test runs, exported synchronously (tracing.exporter stays none)."""
    exporter = InMemorySpanExporter()
    with tracing.installed(TracingConfig(service_name="room-service-test"), exporter=exporter):
        yield exporter


def new_traceparent() -> tuple[str, str, str]:
    """(traceparent, trace id, span id) of a made-up caller's sampled span."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def hex_trace(span: ReadableSpan) -> str:
    ctx = span.get_span_context()
    assert ctx is not None
    return format(ctx.trace_id, "032x")


def hex_id(span: ReadableSpan) -> str:
    ctx = span.get_span_context()
    assert ctx is not None
    return format(ctx.span_id, "016x")


def parent_id(span: ReadableSpan) -> str | None:
    return format(span.parent.span_id, "016x") if span.parent is not None else None


def of_trace(exporter: InMemorySpanExporter, trace_id: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if hex_trace(s) == trace_id]


def one(spans: list[ReadableSpan], name: str, **attributes: Any) -> ReadableSpan:
    """The one span called ``name`` whose attributes include ``attributes``."""
    found = [
        s for s in spans if s.name == name and all((s.attributes or {}).get(k) == v for k, v in attributes.items())
    ]
    assert len(found) == 1, (name, attributes, [s.name for s in spans])
    return found[0]


@pytest.fixture(params=["sqlite", "mariadb"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path}/room.db"
    url: str = request.getfixturevalue("migrated_mariadb_url")
    return url


def traceparent_of(span: ReadableSpan) -> str:
    ctx = span.get_span_context()
    assert ctx is not None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
