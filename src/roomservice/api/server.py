"""The uvicorn HTTP protocol the API is served with: uvicorn's, except that its own 400 is in the error shape.

A request uvicorn cannot parse (a malformed request line or header, a TLS
hello on the plain port) never reaches the app: uvicorn answers it itself with
``400`` and the plain text ``Invalid HTTP request received.``. uvicorn takes
the protocol class as ``Config(http=...)``; this one is the class uvicorn
would pick (httptools when installed, else h11) with ``send_400_response``
answering ``{"error": {"code": "invalid_argument", ...}}`` as JSON, encoded
like every other error, then closing the connection as uvicorn does.

What uvicorn bounds and what it does not (docs/http.md): an idle keep-alive
connection is closed after ``timeout_keep_alive`` (5 s); a request head is
limited in size (h11: ``h11_max_incomplete_event_size``, httptools: its
parser's limits) but not in time; the body is bounded by the app
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


HTTP_PROTOCOL: type[asyncio.Protocol]
try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - httptools is a dependency; h11 is uvicorn's fallback
    HTTP_PROTOCOL = JsonErrorH11Protocol
else:

    class JsonErrorHttpToolsProtocol(HttpToolsProtocol):
        def send_400_response(self, msg: str) -> None:
            body, headers = _json_400(_MESSAGE)
            head = [b"HTTP/1.1 400 Bad Request\r\n"]
            for name, value in [*self.server_state.default_headers, *headers]:
                head.append(name + b": " + value + b"\r\n")
            self.transport.write(b"".join([*head, b"\r\n", body]))
            self.transport.close()

    HTTP_PROTOCOL = JsonErrorHttpToolsProtocol
