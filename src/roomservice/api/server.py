"""The uvicorn HTTP protocol the API is served with: uvicorn's, except that its own 400 is in the error shape.

A request uvicorn cannot parse (a malformed request line or header, a TLS
hello on the plain port) never reaches the app: uvicorn answers it itself with
``400`` and the plain text ``Invalid HTTP request received.``. uvicorn takes
the protocol class as ``Config(http=...)``; this one is the class uvicorn
would pick (httptools when installed, else h11) with ``send_400_response``
answering ``{"error": {"code": "invalid_argument", ...}}`` as JSON, encoded
like every other error, then closing the connection as uvicorn does.

What bounds a connection (docs/http.md): uvicorn closes an idle keep-alive
connection after ``timeout_keep_alive`` (5 s) and limits a request head in
size; this protocol gives the head a deadline too (``HEAD_READ_TIMEOUT_S``,
httptools only: the h11 fallback has none); the app bounds the body
(:mod:`roomservice.api.body_limit`: 64 KiB, ``http.body_read_timeout``).
"""

from __future__ import annotations

import asyncio

from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from roomservice import errors


def _json_400(message: str) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    response = JSONResponse(errors.InvalidArgument(message).to_body(), status_code=400)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(response.body)).encode("ascii")),
        (b"connection", b"close"),
    ]
    return bytes(response.body), headers


_MESSAGE = "invalid HTTP request: the request line or a header could not be parsed"


class JsonErrorH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        import h11

        body, headers = _json_400(_MESSAGE)
        self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request")))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()


HEAD_READ_TIMEOUT_S = 10.0


def http_protocol(*, head_timeout_s: float = HEAD_READ_TIMEOUT_S) -> type[asyncio.Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``; the request head must arrive within ``head_timeout_s``."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # pragma: no cover - httptools comes with uvicorn[standard]; h11 is the fallback
        return JsonErrorH11Protocol

    class JsonErrorHttpToolsProtocol(HttpToolsProtocol):
        """httptools, with the JSON 400 and a deadline on the request head.

        uvicorn bounds the idle time between requests (``timeout_keep_alive``)
        but not the time a request head takes: a client sending a byte of its
        headers at a time, or connecting and sending nothing, holds its
        connection forever. Here a head must be complete ``head_timeout_s``
        after its first byte (after the connection opened, for the first one);
        a partial head then gets the JSON 400, a silent connection is closed.
        """

        _head_timer: asyncio.TimerHandle | None = None
        _head_started = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_started = True
            self._arm_head_timer()

        def on_headers_complete(self) -> None:
            self._cancel_head_timer()
            self._head_started = False
            super().on_headers_complete()

        def send_400_response(self, msg: str) -> None:
            self._send_json_400(_MESSAGE)

        def _send_json_400(self, message: str) -> None:
            self._cancel_head_timer()
            body, headers = _json_400(message)
            head = [b"HTTP/1.1 400 Bad Request\r\n"]
            for name, value in [*self.server_state.default_headers, *headers]:
                head.append(name + b": " + value + b"\r\n")
            self.transport.write(b"".join([*head, b"\r\n", body]))
            self.transport.close()

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.keep_alive = False  # a pipelined head behind a response: close once it is written
            elif self._head_started:
                self._send_json_400(f"request head not received within {head_timeout_s:g}s")
            else:
                self.transport.close()  # connected and sent nothing

    return JsonErrorHttpToolsProtocol


HTTP_PROTOCOL = http_protocol()
