"""The in-process way into a sandbox: an httpx transport that hands REST calls straight to its state.

``room-service serve`` in the embedded mode runs the sandbox in its own process and
talks to it with the real :class:`~roomservice.integrations.tencent_im.client.TencentImClient`.
Over loopback TCP each call went through httpx's connection pool and h11, a socket
pair, uvicorn and Starlette, about 2 ms of CPU a call in the same process (measured
with the IM bridge under load: the biggest single cost of an outbox row in the
embedded default). This transport skips the sockets and both HTTP stacks: a
``POST /v4/{service}/{command}`` meets the same injected faults
(:func:`~.app.injected_fault`) and is answered by the same
:meth:`~.state.SandboxState.handle`, with the body and status the app answers; the
client above it (URL, query, UserSig, JSON, error classification, rate limit,
deadlines) is unchanged, and calls :meth:`InProcessTransport.rest_call` directly,
without even httpx's request and response objects. Anything else (the control API)
goes to the sandbox's ASGI app. The sandbox still listens on its port for everyone else.

An ``http_503`` outage answers 503 as the app does; a ``reset`` outage raises
:class:`httpx.RemoteProtocolError`, what the client meets when the app closes the
connection mid-answer.
"""

from __future__ import annotations

from collections.abc import Mapping

import httpx

from roomservice.integrations.im_sandbox.app import OUTAGE_BODY, create_app, injected_fault, render_json
from roomservice.integrations.im_sandbox.state import SandboxState

__all__ = ["InProcessTransport"]

class InProcessTransport(httpx.AsyncBaseTransport):
    """REST calls to ``state`` without a socket (see the module docstring)."""

    def __init__(self, state: SandboxState) -> None:
        self.state = state
        self._app = httpx.ASGITransport(app=create_app(state))  # the control API and anything unusual

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        parts = request.url.path.split("/")
        if request.method != "POST" or len(parts) != 4 or parts[1] != "v4" or not parts[2] or not parts[3]:
            return await self._app.handle_async_request(request)
        query = dict(request.url.params.multi_items())  # the last value of a repeated name, as Starlette's
        status, body = await self.rest_call(parts[2], parts[3], query, await request.aread())
        content_type = "text/plain" if body is OUTAGE_BODY else "application/json"
        return httpx.Response(status, headers={"content-type": content_type}, content=body, request=request)

    async def rest_call(self, service: str, command: str, query: Mapping[str, str], body: bytes) -> tuple[int, bytes]:
        """One REST call as the app answers it: (status, body); the client's direct way in
        (:class:`~roomservice.integrations.tencent_im.client.DirectCalls`)."""
        outage = await injected_fault(self.state, service, command, lambda: query.get("identifier", ""))
        if outage == "http_503":
            return 503, OUTAGE_BODY
        if outage is not None:
            raise httpx.RemoteProtocolError("sandbox outage: connection reset")
        reply = self.state.handle(service, command, query, body)
        if self.state.answer_lost(command):  # applied, and its answer lost on the way
            return 503, OUTAGE_BODY
        return reply.status, render_json(reply.body)

    async def aclose(self) -> None:
        await self._app.aclose()
