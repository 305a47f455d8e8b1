"""A command forwarded to the room's owner carries the trace: the owner's gRPC server span is the caller's child."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from tests.service.test_forwarding import JOIN, Peer, StubLeases, StubService, forwarder, owner
from tests.tracing.conftest import hex_id, hex_trace, one, parent_id

from roomservice.leases.port import LeaseOwner
from roomservice.observability import tracing

__all__ = ["owner"]  # the fixture, from the forwarding tests


async def test_a_forwarded_command_continues_the_callers_trace_on_the_owner(
    spans: InMemorySpanExporter, owner: Peer
) -> None:
    local = StubService("A")
    fwd = forwarder(local, StubLeases(owner="A", holder=LeaseOwner("B", owner.address, "t")))
    try:
        with tracing.tracer().start_as_current_span("POST join (the non-owner's request)"):
            await fwd.execute("app", "r1", "c1", JOIN)
    finally:
        await fwd.aclose()
    assert owner.service.ran == [("c1", "JoinRoom")] and local.ran == []
    caller = one(spans.get_finished_spans(), "POST join (the non-owner's request)")
    served = one(spans.get_finished_spans(), "roomservice.v1.RoomApi/JoinRoom")
    assert served.kind is SpanKind.SERVER
    assert hex_trace(served) == hex_trace(caller) and parent_id(served) == hex_id(caller)
