"""A small, real HTTP wallet service for tests: the server side of :mod:`roomservice.wallet.http`'s REST contract.

    async with running_wallet_server(starting_balance=1_000, api_key="k") as server:
        wallet = server.client(timeout_s=0.2)        # an HttpWallet pointed at it
        server.switches.down = True                  # every /v1 call answers 503
        server.counters["charged"]                   # debits that moved money

It is a Starlette app served by uvicorn in the test's own event loop, on a
socket bound to port 0 before the server starts (so it is reachable at once).
The ledger is an :class:`EmbeddedWallet` over a SQLite file of its own in a
temporary directory — the same idempotency-by-key semantics as the embedded
wallet, because it is the embedded wallet — unless ``ledger=`` gives another
:class:`Wallet`.

Switches (:class:`Switches`, changeable while running):

* ``down`` — every ``/v1`` call answers ``503 unavailable``.
* ``slow_ms`` — hold every ``/v1`` call this long before handling it (the
  handling still happens even if the client gave up, like a real slow server).
* ``stall_after_debit_ms`` — perform a debit, then hold the answer this long:
  with more than the client's timeout this is "the wallet debited, the client
  timed out".
* ``fail_status`` — answer every ``/v1`` call with this status and an error body.
* ``malformed`` — answer every ``/v1`` call ``200`` with a body that is not JSON.
* ``api_key`` — require ``Authorization: Bearer <api_key>`` (``""``: none).

Held calls (slow, stall) end early when :meth:`WalletServer.release` is called
and always on shutdown, so no test waits on a server sleep.

Counters (:class:`Counters`): requests per operation (``debit``, ``lookup``,
``refund``, ``balance``), ``unauthorized``, ``rejected`` (answered by ``down``,
``fail_status`` or ``malformed``), and the effects ``charged`` (a debit that
took money) and ``refunded`` (a refund that gave money back).
``await server.counters.wait_for("charged", 1)`` waits for an effect without
sleeping.
"""

from __future__ import annotations

import asyncio
import hmac
import socket
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from roomservice.store.database import Database
from roomservice.store.migrate import upgrade
from roomservice.wallet.embedded import EmbeddedWallet
from roomservice.wallet.http import NOT_FOUND_CODE, HttpWallet
from roomservice.wallet.port import DEBITED, REFUNDED, Debit, DebitKeyConflict, InsufficientFunds, Wallet


@dataclass
class Switches:
    down: bool = False
    slow_ms: int = 0
    stall_after_debit_ms: int = 0
    fail_status: int | None = None
    malformed: bool = False
    api_key: str = ""


class Counters:
    """Named counters the test can read, and wait on without sleeping."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._changed = asyncio.Event()

    def __getitem__(self, name: str) -> int:
        return self._counts[name]

    def bump(self, name: str) -> None:
        self._counts[name] += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def snapshot(self) -> dict[str, int]:
        return dict(self._counts)

    async def wait_for(self, name: str, at_least: int, *, timeout_s: float = 5.0) -> None:
        async with asyncio.timeout(timeout_s):
            while self._counts[name] < at_least:
                await self._changed.wait()


def _error(status: int, code: str, message: str = "") -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message or code}}, status_code=status)


def _debit_body(debit: Debit) -> dict[str, Any]:
    return {
        "debit": {
            "key": debit.key,
            "app_code": debit.app_code,
            "user_id": debit.user_id,
            "amount": debit.amount,
            "status": debit.status,
        }
    }


Handler = Callable[[Request], Awaitable[Response]]


@dataclass
class WalletServer:
    base_url: str
    switches: Switches
    counters: Counters
    ledger: Wallet
    _release: asyncio.Event = field(default_factory=asyncio.Event)
    _key_locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    def client(self, *, api_key: str | None = None, timeout_s: float = 2.0) -> HttpWallet:
        """An :class:`HttpWallet` for this server (with the server's api key unless given)."""
        key = self.switches.api_key if api_key is None else api_key
        return HttpWallet(self.base_url, api_key=key, timeout_s=timeout_s)

    def release(self) -> None:
        """End every held (slow or stalled) call now; later calls are held again as switched."""
        released, self._release = self._release, asyncio.Event()
        released.set()

    async def _hold(self, ms: int) -> None:
        if ms > 0:
            try:
                async with asyncio.timeout(ms / 1000):
                    await self._release.wait()
            except TimeoutError:
                pass

    def _lock(self, key: str) -> asyncio.Lock:
        return self._key_locks.setdefault(key, asyncio.Lock())

    # ------------------------------------------------------------------ app

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/healthz", self._healthz, methods=["GET"]),
                Route("/v1/debits", self._guard("debit", self._debit), methods=["POST"]),
                Route("/v1/debits/{key:path}/refund", self._guard("refund", self._refund), methods=["POST"]),
                Route("/v1/debits/{key:path}", self._guard("lookup", self._lookup), methods=["GET"]),
                Route("/v1/balances/{app_code}/{user_id:path}", self._guard("balance", self._balance), methods=["GET"]),
            ]
        )

    async def _healthz(self, request: Request) -> Response:
        return PlainTextResponse("ok")

    def _guard(self, operation: str, handler: Handler) -> Handler:
        async def guarded(request: Request) -> Response:
            self.counters.bump(operation)
            s = self.switches
            if s.api_key:
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {s.api_key}".encode()):
                    self.counters.bump("unauthorized")
                    return _error(401, "unauthorized", "a valid bearer api key is required")
            await request.body()  # read (and cache) the request before holding it, like a real server
            await self._hold(s.slow_ms)
            if s.down:
                self.counters.bump("rejected")
                return _error(503, "unavailable", "wallet is down")
            if s.fail_status is not None:
                self.counters.bump("rejected")
                return _error(s.fail_status, "injected", f"injected status {s.fail_status}")
            if s.malformed:
                self.counters.bump("rejected")
                return PlainTextResponse("<html>not json", status_code=200)
            return await handler(request)

        return guarded

    async def _debit(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "invalid_argument", "body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "invalid_argument", "body is not an object")
        key, app_code, user_id, amount = (body.get(k) for k in ("key", "app_code", "user_id", "amount"))
        if not (isinstance(key, str) and key and isinstance(app_code, str) and app_code):
            return _error(400, "invalid_argument", "key and app_code are required strings")
        if not (isinstance(user_id, str) and user_id and type(amount) is int and amount > 0):
            return _error(400, "invalid_argument", "user_id is a required string, amount a positive integer")
        async with self._lock(key):  # exact "charged" counting for concurrent calls of one key
            before = await self.ledger.lookup(key)
            try:
                debit = await self.ledger.debit(key=key, app_code=app_code, user_id=user_id, amount=amount)
            except InsufficientFunds as exc:
                return _error(402, "insufficient_balance", str(exc))
            except DebitKeyConflict as exc:
                return _error(409, "debit_key_conflict", f"key {exc} was used for another debit")
            charged = before is None or before.status == REFUNDED
            if charged:
                self.counters.bump("charged")
        await self._hold(self.switches.stall_after_debit_ms)
        return JSONResponse({**_debit_body(debit), "charged": charged})

    async def _lookup(self, request: Request) -> Response:
        debit = await self.ledger.lookup(request.path_params["key"])
        if debit is None:
            return _error(404, NOT_FOUND_CODE, "no debit under this key")
        return JSONResponse(_debit_body(debit))

    async def _refund(self, request: Request) -> Response:
        key = request.path_params["key"]
        async with self._lock(key):
            before = await self.ledger.lookup(key)
            debit = await self.ledger.refund(key)
            if debit is None:
                return _error(404, NOT_FOUND_CODE, "no debit under this key")
            if before is not None and before.status == DEBITED:
                self.counters.bump("refunded")
        return JSONResponse(_debit_body(debit))

    async def _balance(self, request: Request) -> Response:
        app_code, user_id = request.path_params["app_code"], request.path_params["user_id"]
        balance = await self.ledger.balance(app_code, user_id)
        return JSONResponse({"app_code": app_code, "user_id": user_id, "balance": balance})


def _wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


@asynccontextmanager
async def _embedded_ledger(starting_balance: int) -> AsyncIterator[Wallet]:
    with tempfile.TemporaryDirectory(prefix="wallet-server-") as tmp:
        db = Database.from_url(f"sqlite+aiosqlite:///{Path(tmp) / 'wallet.db'}", pool_size=5, max_overflow=5)
        try:
            await upgrade(db)
            yield EmbeddedWallet(db, starting_balance=starting_balance, clock=_wall_clock_ms)
        finally:
            await db.dispose()


@asynccontextmanager
async def running_wallet_server(
    *, starting_balance: int = 100_000, ledger: Wallet | None = None, **switches: Any
) -> AsyncIterator[WalletServer]:
    """Serve the wallet REST API on 127.0.0.1:<free port> in this loop until the block ends."""
    async with AsyncExitStack() as stack:
        if ledger is None:
            ledger = await stack.enter_async_context(_embedded_ledger(starting_balance))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets: no 40 ms stalls
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        host, port = sock.getsockname()[:2]
        server = WalletServer(
            base_url=f"http://{host}:{port}", switches=Switches(**switches), counters=Counters(), ledger=ledger
        )
        config = uvicorn.Config(
            server.app(),
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=2,
        )
        uv = uvicorn.Server(config)
        task = asyncio.create_task(uv.serve(sockets=[sock]), name="wallet-server")
        try:
            await _wait_healthy(server.base_url, task)
            yield server
        finally:
            server.release()
            uv.should_exit = True
            try:
                await task
            finally:
                sock.close()


async def _wait_healthy(base_url: str, task: asyncio.Task[None]) -> None:
    """The socket listens already: one request answers once uvicorn serves it (or its task died)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=10.0) as probe:
        request = asyncio.ensure_future(probe.get("/healthz"))
        done, _ = await asyncio.wait({request, task}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            request.cancel()
            task.result()  # raises what killed the server
            raise RuntimeError("wallet server stopped before serving")
        request.result().raise_for_status()
