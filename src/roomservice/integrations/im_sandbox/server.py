"""Run the IM sandbox: in process (``async with running_sandbox(...)``) or alone (``run_sandbox``).
With ``state_dir`` its state is kept in ``<state_dir>/im-sandbox-<sdk_app_id>.sqlite3`` and a
restart on the same dir sees the same accounts, groups and messages (:mod:`.journal`);
without, it lives in memory.

The server is uvicorn on the current event loop, on a socket we bind first (so port 0
gives a free port, known before the first request, and a bind failure is a plain
``OSError``), or on a unix socket. It installs no signal handlers: the host process
(``room-service serve`` or the ``im-sandbox`` command) owns them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from roomservice.integrations.im_sandbox.app import create_app
from roomservice.integrations.im_sandbox.journal import SandboxJournal, state_file
from roomservice.integrations.im_sandbox.state import SandboxState
from roomservice.integrations.im_sandbox.transport import InProcessTransport

__all__ = ["RunningSandbox", "run_sandbox", "running_sandbox"]


class _InProcessServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass(frozen=True, slots=True)
class RunningSandbox:
    state: SandboxState
    host: str
    port: int
    uds: str | None = None

    @property
    def base_url(self) -> str:
        """The URL to give the client (over ``uds``, any host name; use :meth:`transport`)."""
        if self.uds is not None:
            return "http://im-sandbox"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def transport(self) -> httpx.AsyncBaseTransport | None:
        """The httpx transport reaching the sandbox (``None``: the default TCP one)."""
        return httpx.AsyncHTTPTransport(uds=self.uds) if self.uds is not None else None

    def in_process_transport(self) -> httpx.AsyncBaseTransport:
        """The transport for a client in the sandbox's own process: no socket (:mod:`.transport`)."""
        return InProcessTransport(self.state)


def _bind(host: str, port: int, uds: str | None) -> socket.socket:
    if uds is not None:
        path = Path(uds)
        if path.is_socket():
            path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        os.chmod(path, 0o600)
    else:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # proto must be IPPROTO_TCP: asyncio sets TCP_NODELAY only on such sockets (else +40 ms a request)
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
    sock.listen(2048)
    sock.setblocking(False)
    return sock


@contextlib.asynccontextmanager
async def running_sandbox(
    sdk_app_id: int,
    secret_key: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    uds: str | None = None,
    admin_identifiers: Iterable[str] = ("administrator",),
    rate_limit_per_second: float | None = 200.0,
    clock: Callable[[], float] = time.time,
    state: SandboxState | None = None,
    state_dir: str | os.PathLike[str] | None = None,
) -> AsyncIterator[RunningSandbox]:
    """Serve a sandbox for app ``sdk_app_id`` (UserSigs checked with ``secret_key``) until
    the block exits. ``port`` 0 picks a free port; ``uds`` serves on a unix socket instead.
    ``state_dir``: keep the state there (replayed now; raises
    :class:`~.journal.SandboxStateInUse` while another process uses it); ``None``: memory."""
    journal: SandboxJournal | None = None
    if state is None:
        if state_dir is not None:
            journal = SandboxJournal(state_file(state_dir, sdk_app_id), sdk_app_id=sdk_app_id)
        try:
            state = SandboxState(
                sdk_app_id,
                secret_key,
                admin_identifiers=admin_identifiers,
                rate_limit_per_second=rate_limit_per_second,
                clock=clock,
                journal=journal,
            )
        except BaseException:
            if journal is not None:
                journal.close()
            raise
    elif state_dir is not None:
        raise ValueError("pass state or state_dir, not both (give the state its journal instead)")
    try:
        async with _serving(state, host=host, port=port, uds=uds) as running:
            yield running
    finally:
        if journal is not None:
            journal.close()


@contextlib.asynccontextmanager
async def _serving(state: SandboxState, *, host: str, port: int, uds: str | None) -> AsyncIterator[RunningSandbox]:
    state.stopping.clear()
    sock = _bind(host, port, uds)
    bound_port = 0 if uds is not None else int(sock.getsockname()[1])
    server = _InProcessServer(
        uvicorn.Config(
            create_app(state),
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=1,
        )
    )
    serving = asyncio.create_task(server.serve(sockets=[sock]), name="im-sandbox")
    try:
        while not server.started and not serving.done():  # noqa: ASYNC110 - uvicorn exposes only a flag
            await asyncio.sleep(0.01)
        if not server.started:
            serving.result()  # raises the start-up failure
            raise RuntimeError("IM sandbox stopped before it started")
        yield RunningSandbox(state=state, host=host, port=bound_port, uds=uds)
    finally:
        state.stopping.set()
        server.should_exit = True
        try:
            if not serving.done():
                try:
                    await asyncio.wait_for(asyncio.shield(serving), timeout=5)
                except TimeoutError:
                    serving.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await serving
        finally:
            sock.close()
            if uds is not None:
                with contextlib.suppress(OSError):
                    os.unlink(uds)


async def run_sandbox(
    host: str,
    port: int,
    *,
    sdk_app_id: int,
    secret_key: str,
    admin_identifiers: Iterable[str] = ("administrator",),
    rate_limit_per_second: float | None = 200.0,
    stop: asyncio.Event | None = None,
    on_started: Callable[[RunningSandbox], None] | None = None,
    state_dir: str | os.PathLike[str] | None = None,
) -> None:
    """Serve the sandbox until ``stop`` is set (or the task is cancelled)."""
    async with running_sandbox(
        sdk_app_id,
        secret_key,
        host=host,
        port=port,
        admin_identifiers=admin_identifiers,
        rate_limit_per_second=rate_limit_per_second,
        state_dir=state_dir,
    ) as sandbox:
        if on_started is not None:
            on_started(sandbox)
        await (stop or asyncio.Event()).wait()
