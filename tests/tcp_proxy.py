"""A real TCP proxy for fault tests: forwards, or blackholes like a network partition.

``TcpProxy(host, port)`` listens on ``127.0.0.1:<free port>`` and runs its own
event loop in a thread, so it keeps working whatever the test's loop does, and
can be driven from sync and async tests alike::

    with TcpProxy("127.0.0.1", 3306) as proxy:
        url = f"mysql+asyncmy://root@127.0.0.1:{proxy.port}/db"
        proxy.blackhole()   # from now on no byte passes, in either direction
        proxy.forward()     # and now they pass again

Blackhole mode is what a hung server or a dropped NAT entry looks like:

* both sockets of every connection stay open; bytes read from either side are
  dropped (so neither side's send buffer fills and nothing errors);
* a close by either side is not passed on: a client that gives up leaves its
  server session open, as the server never hears of it (the session and its
  row locks stay until the server ends them itself, or the proxy closes);
* a connection accepted meanwhile gets no upstream connection at all (as if its
  SYN were lost).

When forwarding resumes, bytes pass again on the connections both sides still
hold (their streams may miss what was dropped), a close the server made
meanwhile reaches the client (as the reset a client gets when the path heals),
and connections accepted during the blackhole are closed. A close by the client
during the blackhole is never passed on: the server side stays a "ghost" until
:meth:`close`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

FORWARD = "forward"
BLACKHOLE = "blackhole"


class _Link:
    """One proxied connection: the client's transport and the server's."""

    def __init__(self, proxy: TcpProxy, client: asyncio.Transport) -> None:
        self.proxy = proxy
        self.client: asyncio.Transport | None = client
        self.server: asyncio.Transport | None = None
        self.client_gone = False
        self.server_gone = False
        self.early: list[bytes] = []  # client bytes before the upstream connection is up
        self.upstream_wanted = proxy.mode == FORWARD

    # client side
    def from_client(self, data: bytes) -> None:
        if self.proxy.mode != FORWARD:
            return
        if self.server is not None:
            self.server.write(data)
        elif self.upstream_wanted:
            self.early.append(data)

    def client_closed(self) -> None:
        if self.client_gone:
            return
        self.client_gone = True
        self.client = None
        if self.proxy.mode == FORWARD and self.server is not None:
            self.server.close()

    # server side
    def upstream_made(self, transport: asyncio.Transport) -> None:
        self.server = transport
        for data in self.early:
            transport.write(data)
        self.early.clear()
        if self.client_gone:
            transport.close()

    def from_server(self, data: bytes) -> None:
        if self.proxy.mode == FORWARD and self.client is not None:
            self.client.write(data)

    def server_closed(self) -> None:
        if self.server_gone:
            return
        self.server_gone = True
        self.server = None
        if self.proxy.mode == FORWARD and self.client is not None:
            self.client.close()

    # mode changes
    def resumed(self) -> None:
        """Forwarding again: what happened during the blackhole becomes visible to the client."""
        if self.client is not None and (self.server_gone or not self.upstream_wanted):
            self.client.close()

    def close(self) -> None:
        for transport in (self.client, self.server):
            if transport is not None:
                transport.close()


class _ClientSide(asyncio.Protocol):
    def __init__(self, proxy: TcpProxy) -> None:
        self.proxy = proxy
        self.link: _Link | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        link = self.link = _Link(self.proxy, transport)
        self.proxy.links.append(link)
        self.proxy.accepted += 1
        if link.upstream_wanted:
            self.proxy.loop.create_task(self.proxy._connect_upstream(link))

    def data_received(self, data: bytes) -> None:
        if self.link is not None:
            self.link.from_client(data)

    def eof_received(self) -> bool:
        if self.link is not None:
            self.link.client_closed()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.link is not None:
            self.link.client_closed()


class _ServerSide(asyncio.Protocol):
    def __init__(self, link: _Link) -> None:
        self.link = link

    def data_received(self, data: bytes) -> None:
        self.link.from_server(data)

    def eof_received(self) -> bool:
        self.link.server_closed()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.link.server_closed()


class TcpProxy:
    """See the module docs. ``mode`` is ``"forward"`` or ``"blackhole"``."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.mode = FORWARD
        self.links: list[_Link] = []
        self.accepted = 0
        self.port = 0
        self.loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="tcp-proxy", daemon=True)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> TcpProxy:
        self._thread.start()
        self._server = self._call(self._listen())
        return self

    def close(self) -> None:
        """Stop listening and close every connection, ghosts included."""
        if not self._thread.is_alive():
            return
        self._call(self._shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.loop.close()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ modes

    def blackhole(self) -> None:
        """Drop every byte in both directions from now on; keep every socket open."""
        self._call(self._set_mode(BLACKHOLE))

    def forward(self) -> None:
        """Pass bytes again (see the module docs for what the blackhole leaves behind)."""
        self._call(self._set_mode(FORWARD))

    @property
    def open_upstreams(self) -> int:
        """Server-side connections still open (ghosts of gone clients included)."""
        return self._call(self._count_upstreams())

    # ------------------------------------------------------------------ loop side

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout=10)

    async def _listen(self) -> asyncio.Server:
        server = await self.loop.create_server(lambda: _ClientSide(self), "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        return server

    async def _set_mode(self, mode: str) -> None:
        self.mode = mode
        if mode == FORWARD:
            for link in self.links:
                link.resumed()

    async def _count_upstreams(self) -> int:
        return sum(1 for link in self.links if link.server is not None)

    async def _connect_upstream(self, link: _Link) -> None:
        try:
            transport, _ = await self.loop.create_connection(lambda: _ServerSide(link), *self.upstream)
        except OSError:
            if link.client is not None:
                link.client.close()
            return
        assert isinstance(transport, asyncio.Transport)
        link.upstream_made(transport)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in self.links:
            link.close()
        await asyncio.sleep(0)
