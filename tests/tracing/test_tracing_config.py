"""The ``tracing`` block: every key takes effect, and a bad one fails loading naming it.

The OTLP exporter is checked against tiny receivers written here (OTLP/HTTP with
protobuf bodies, and OTLP/gRPC), the file exporter against the file it writes.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NoOpTracer
from tests.tracing.conftest import new_traceparent

from roomservice.config import ConfigError, TracingConfig, settings_from_yaml
from roomservice.observability import tracing


@pytest.mark.parametrize(
    ("yaml", "problem"),
    [
        ("tracing: {exporter: jaeger}", "tracing.exporter must be one of none, otlp, file"),
        ("tracing: {sampel_ratio: 0.5}", "unknown key: tracing.sampel_ratio"),
        ("tracing: {otlp: {endpoit: x}}", "unknown key: tracing.otlp.endpoit"),
        ("tracing: {sample_ratio: 1.5}", "tracing.sample_ratio must be <= 1.0"),
        ("tracing: {sample_ratio: -0.1}", "tracing.sample_ratio must be >= 0.0"),
        ("tracing: {sample_ratio: true}", "tracing.sample_ratio must be a number, not true/false"),
        ("tracing: {service_name: ''}", "tracing.service_name must not be empty"),
        ("tracing: {exporter: otlp}", "tracing.otlp.endpoint must be set when tracing.exporter is otlp"),
        (
            "tracing: {exporter: otlp, otlp: {endpoint: 'collector:4318'}}",
            "tracing.otlp.endpoint must be an http(s) URL with tracing.otlp.protocol http/protobuf",
        ),
        ("tracing: {otlp: {protocol: thrift}}", "tracing.otlp.protocol must be one of http/protobuf, grpc"),
        ("tracing: {otlp: {timeout: 0s}}", "tracing.otlp.timeout must be > 0"),
        ("tracing: {file: {path: ''}}", "tracing.file.path must not be empty"),
    ],
)
def test_a_bad_tracing_key_fails_loading_naming_it(yaml: str, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        settings_from_yaml(yaml)
    assert problem in caught.value.problems


def test_the_default_is_no_tracer_at_all() -> None:
    config = settings_from_yaml("{}").tracing
    assert config.exporter == "none"
    with tracing.installed(config) as provider:
        assert provider is None and tracing.ENABLED is False and isinstance(tracing.tracer(), NoOpTracer)


def test_service_name_names_every_span_and_the_block_restores_what_was_before() -> None:
    exporter = InMemorySpanExporter()
    with tracing.installed(TracingConfig(service_name="rooms-eu"), exporter=exporter):
        assert tracing.ENABLED
        with tracing.tracer().start_as_current_span("probe"):
            assert tracing.current_traceparent() is not None
    assert tracing.ENABLED is False and isinstance(tracing.tracer(), NoOpTracer)
    (span,) = exporter.get_finished_spans()
    assert span.resource.attributes["service.name"] == "rooms-eu"


def test_sample_ratio_decides_new_traces_and_an_incoming_traceparent_decides_its_own() -> None:
    exporter = InMemorySpanExporter()
    with tracing.installed(TracingConfig(sample_ratio=0.0), exporter=exporter):
        with tracing.tracer().start_as_current_span("unsampled root") as span:
            assert not span.is_recording()
            traceparent = tracing.current_traceparent()  # still propagated, flagged not sampled
            assert traceparent is not None and int(traceparent[-2:], 16) & 1 == 0
        traceparent, trace_id, _ = new_traceparent()
        with tracing.tracer().start_as_current_span(
            "sampled by its caller", context=tracing.extract({"traceparent": traceparent})
        ):
            pass
    assert [(s.name, format(s.context.trace_id, "032x")) for s in exporter.get_finished_spans()] == [
        ("sampled by its caller", trace_id)
    ]
    ratio_one = InMemorySpanExporter()
    with tracing.installed(TracingConfig(sample_ratio=1.0), exporter=ratio_one):
        for _ in range(20):
            with tracing.tracer().start_as_current_span("root"):
                pass
    assert len(ratio_one.get_finished_spans()) == 20


def test_the_file_exporter_appends_one_json_line_per_span_under_the_data_dir(tmp_path: Path) -> None:
    config = TracingConfig(exporter="file", service_name="filed")
    assert config.file.path == "{data_dir}/traces.jsonl"
    with (
        tracing.installed(config, data_dir=tmp_path),
        tracing.tracer().start_as_current_span("outer"),
        tracing.tracer().start_as_current_span("inner", attributes={"k": "v"}),
    ):
        pass
    lines = [json.loads(line) for line in (tmp_path / "traces.jsonl").read_text().splitlines()]
    inner, outer = lines
    assert (inner["name"], outer["name"]) == ("inner", "outer")
    assert inner["trace_id"] == outer["trace_id"] and inner["parent_span_id"] == outer["span_id"]
    assert outer["parent_span_id"] is None and inner["attributes"] == {"k": "v"}
    assert inner["resource"]["service.name"] == "filed"
    assert inner["start_unix_nano"] <= inner["end_unix_nano"]


def test_a_file_path_with_data_dir_needs_a_data_dir() -> None:
    with pytest.raises(ConfigError, match=r"tracing\.file\.path"), tracing.installed(TracingConfig(exporter="file")):
        pass
    assert tracing.ENABLED is False


class _Receiver(BaseHTTPRequestHandler):
    bodies: list[tuple[str, bytes]]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.bodies.append((self.path, body))  # type: ignore[attr-defined]
        reply = otlp.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def http_receiver() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    server.bodies = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _span_names(request: otlp.ExportTraceServiceRequest) -> list[tuple[str, str]]:
    out = []
    for resource_spans in request.resource_spans:
        service = next(a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name")
        out += [(service, span.name) for scope in resource_spans.scope_spans for span in scope.spans]
    return out


def test_otlp_over_http_protobuf_reaches_the_endpoint(http_receiver: ThreadingHTTPServer) -> None:
    endpoint = f"http://127.0.0.1:{http_receiver.server_port}/v1/traces"
    config = settings_from_yaml(
        f"tracing: {{exporter: otlp, service_name: over-http, otlp: {{endpoint: '{endpoint}'}}}}"
    )
    with tracing.installed(config.tracing) as provider:
        assert provider is not None
        with tracing.tracer().start_as_current_span("exported"):
            pass
        assert provider.force_flush()
    ((path, body),) = http_receiver.bodies  # type: ignore[attr-defined]
    assert path == "/v1/traces"
    assert _span_names(otlp.ExportTraceServiceRequest.FromString(body)) == [("over-http", "exported")]


class _TraceService(otlp_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[otlp.ExportTraceServiceRequest] = []

    def Export(self, request: otlp.ExportTraceServiceRequest, context: Any) -> otlp.ExportTraceServiceResponse:
        self.requests.append(request)
        return otlp.ExportTraceServiceResponse()


def test_otlp_over_grpc_reaches_the_endpoint_with_its_timeout() -> None:
    service = _TraceService()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    otlp_grpc.add_TraceServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        config = settings_from_yaml(
            "tracing: {exporter: otlp, service_name: over-grpc, "
            f"otlp: {{endpoint: '127.0.0.1:{port}', protocol: grpc, timeout: 2500ms}}}}"
        ).tracing
        exporter = tracing._exporter(config, None)
        assert exporter._timeout == 2.5  # type: ignore[attr-defined]
        exporter.shutdown()
        with tracing.installed(config) as provider:
            assert provider is not None
            with tracing.tracer().start_as_current_span("exported"):
                pass
            assert provider.force_flush()
    finally:
        server.stop(grace=None)
    assert [name for request in service.requests for name in _span_names(request)] == [("over-grpc", "exported")]
