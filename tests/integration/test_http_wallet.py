"""The HTTP wallet adapter against a real wallet server: error mapping, and the gift path's failure cases.

The server (``tests/wallet_server.py``) runs in the test's loop; its ledger is
an EmbeddedWallet on its own SQLite file, so "balance on the server" is the
wallet service's own book, not the room service's. Synchronisation is by
answers and server counters, never by sleeping.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from tests.service.conftest import Clock, make_settings
from tests.service.helpers import APP, count, logged_versions, outbox_rows, run
from tests.wallet_server import WalletServer, running_wallet_server

from roomservice import errors
from roomservice.api.errors import http_status
from roomservice.bootstrap import API, MAINTENANCE, Process
from roomservice.config import Settings
from roomservice.domain import commands as c
from roomservice.store import tables as t
from roomservice.wallet.http import HttpWallet
from roomservice.wallet.port import (
    DEBITED,
    REFUNDED,
    DebitKeyConflict,
    InsufficientFunds,
    WalletUnavailable,
    debit_key,
)

START = 10_000
API_KEY = "wallet-test-key"
HOLD_MS = 30_000  # "longer than any client timeout"; held calls end at release() or shutdown


# ---------------------------------------------------------------------- fixtures


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest_asyncio.fixture
async def server() -> AsyncIterator[WalletServer]:
    async with running_wallet_server(starting_balance=START, api_key=API_KEY) as s:
        yield s


@pytest.fixture
def settings(sqlite_url: str, tmp_path: Path) -> Settings:
    return make_settings(sqlite_url, tmp_path, **{"wallet.timeout": "200ms"})


@asynccontextmanager
async def runtime_with(
    settings: Settings, clock: Clock, base_url: str, *, api_key: str = API_KEY
) -> AsyncIterator[Process]:
    wallet = HttpWallet(base_url, api_key=api_key, timeout_s=settings.wallet.timeout.total_seconds())
    async with (
        wallet,
        Process.running(settings, clock=clock, wallet=wallet, roles=(API, MAINTENANCE), loops=False) as rt,
    ):
        yield rt


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def rose(count: int = 1) -> c.SendGift:
    return c.SendGift(sender_id="bob", receiver_id="owner", gift_id="rose", count=count)


async def open_room(rt: Process, room: str = "r1") -> None:
    await run(rt, room, f"{room}-create", c.CreateRoom(owner_id="owner", title="Room"))
    await run(rt, room, f"{room}-join-bob", c.JoinRoom(user_id="bob"))


async def assert_nothing_committed(rt: Process, outbox_before: int) -> None:
    assert await logged_versions(rt, "r1") == [1, 2]
    assert await count(rt, t.room_outbox) == outbox_before
    assert (await rt.service.room(APP, "r1"))["heat"] == 0


# ---------------------------------------------------------------------- the command path


async def test_gift_debits_once_over_http(server: WalletServer, settings: Settings, clock: Clock) -> None:
    async with runtime_with(settings, clock, server.base_url) as rt:
        await open_room(rt)
        price = rt.service.rules.gifts["rose"].price
        body = await run(rt, "r1", "g1", rose(3))
        again = await run(rt, "r1", "g1", rose(3))
        assert body["version"] == 3 and again == {**body, "replayed": True}
        assert body["room"]["heat"] == 3 * price
        assert (server.counters["debit"], server.counters["charged"]) == (1, 1)
        assert await server.ledger.balance(APP, "bob") == START - 3 * price
        assert await rt.wallet.balance(APP, "bob") == START - 3 * price  # GET /v1/balances agrees
        debit = await server.ledger.lookup(debit_key(APP, "r1", "g1"))
        assert debit is not None and (debit.user_id, debit.amount, debit.status) == ("bob", 3 * price, DEBITED)
        assert [r.event_type for r in await outbox_rows(rt, "r1")][-1] == "RoomGiftSent"


async def test_a_gift_command_id_used_again_after_its_log_row_was_pruned_is_409_not_free(
    server: WalletServer, sqlite_url: str, tmp_path: Path, clock: Clock
) -> None:
    """The wallet keeps its keys longer than the command log keeps command ids: a gift sent again under
    a pruned id got the old debit back and committed unpaid (found by review). The wallet says the debit
    charged nothing and no attempt of this command journaled it: 409, and the old gift's debit stays."""
    settings = make_settings(sqlite_url, tmp_path, **{"wallet.timeout": "2s", "room.snapshot_every_n": 1})
    async with runtime_with(settings, clock, server.base_url) as rt:
        await open_room(rt)
        price = rt.service.rules.gifts["rose"].price
        first = await run(rt, "r1", "g1", rose())
        assert await count(rt, t.wallet_pending_debit) == 0  # its commit settled its journal entry
        clock.advance(8 * 86_400_000)
        assert await rt.store.prune_command_log(before_ms=clock() - 7 * 86_400_000, batch_size=1000) > 0
        cell = rt.registry.peek(APP, "r1")
        assert cell is not None
        rt.registry.discard(cell)  # a restart, or the idle sweep: nothing remembers g1

        with pytest.raises(errors.CommandIdReused, match="committed earlier"):
            await run(rt, "r1", "g1", rose())
        assert (await rt.service.room(APP, "r1"))["heat"] == first["room"]["heat"] == price
        assert await count(rt, t.wallet_pending_debit) == 0  # nothing for reconciliation to refund
        assert (server.counters["debit"], server.counters["charged"]) == (2, 1)
        assert await server.ledger.balance(APP, "bob") == START - price
        report = await rt.reconciler.run_once()
        assert report.refunded == 0 and await server.ledger.balance(APP, "bob") == START - price


async def test_insufficient_balance_commits_nothing(server: WalletServer, settings: Settings, clock: Clock) -> None:
    async with runtime_with(settings, clock, server.base_url) as rt:
        await open_room(rt)
        outbox_before = await count(rt, t.room_outbox)
        crowns = c.SendGift(sender_id="bob", receiver_id="owner", gift_id="crown", count=9)
        with pytest.raises(errors.InsufficientBalance):
            await run(rt, "r1", "g1", crowns)
        await assert_nothing_committed(rt, outbox_before)
        assert await count(rt, t.wallet_pending_debit) == 0
        assert server.counters["debit"] == 1 and server.counters["charged"] == 0
        assert await server.ledger.balance(APP, "bob") == START
        assert await server.ledger.lookup(debit_key(APP, "r1", "g1")) is None


async def test_wallet_down_answers_unavailable_and_commits_nothing(
    server: WalletServer, settings: Settings, clock: Clock
) -> None:
    async with runtime_with(settings, clock, server.base_url) as rt:
        await open_room(rt)
        outbox_before = await count(rt, t.room_outbox)
        server.switches.down = True
        with pytest.raises(errors.Unavailable):
            await run(rt, "r1", "g1", rose())
        await assert_nothing_committed(rt, outbox_before)
        assert server.counters["rejected"] == 1 and server.counters["charged"] == 0
        server.switches.down = False
        body = await run(rt, "r1", "g1", rose())
        assert body["version"] == 3
        assert server.counters["charged"] == 1
        assert await server.ledger.balance(APP, "bob") == START - rt.service.rules.gifts["rose"].price


async def test_unreachable_wallet_answers_unavailable_and_commits_nothing(settings: Settings, clock: Clock) -> None:
    async with runtime_with(settings, clock, closed_port_url()) as rt:
        await open_room(rt)
        outbox_before = await count(rt, t.room_outbox)
        with pytest.raises(errors.Unavailable) as caught:
            await run(rt, "r1", "g1", rose())
        assert isinstance(caught.value.__cause__, WalletUnavailable)
        await assert_nothing_committed(rt, outbox_before)


async def test_timeout_after_the_wallet_debited_then_retry_charges_once(
    server: WalletServer, settings: Settings, clock: Clock
) -> None:
    async with runtime_with(settings, clock, server.base_url) as rt:
        await open_room(rt)
        value = 2 * rt.service.rules.gifts["rose"].price
        outbox_before = await count(rt, t.room_outbox)

        server.switches.stall_after_debit_ms = HOLD_MS  # debit, then answer far past the 200 ms timeout
        with pytest.raises(errors.Unavailable):
            await run(rt, "r1", "g1", rose(2))
        await server.counters.wait_for("charged", 1)
        assert await server.ledger.balance(APP, "bob") == START - value  # the wallet did take the money
        await assert_nothing_committed(rt, outbox_before)
        assert await count(rt, t.wallet_pending_debit) == 1  # journaled for reconciliation

        server.switches.stall_after_debit_ms = 0  # the wallet recovers
        server.release()
        body = await run(rt, "r1", "g1", rose(2))  # the client's retry, same command_id
        assert body["version"] == 3 and body["replayed"] is False
        assert body["room"]["heat"] == value
        assert (server.counters["debit"], server.counters["charged"]) == (2, 1)
        assert await server.ledger.balance(APP, "bob") == START - value

        again = await run(rt, "r1", "g1", rose(2))
        assert again["replayed"] is True and server.counters["debit"] == 2  # a replay never calls the wallet
        assert await logged_versions(rt, "r1") == [1, 2, 3]
        assert [r.event_type for r in await outbox_rows(rt, "r1")].count("RoomGiftSent") == 1


async def test_slow_wallet_that_debits_after_we_gave_up_charges_once(
    server: WalletServer, settings: Settings, clock: Clock
) -> None:
    async with runtime_with(settings, clock, server.base_url) as rt:
        await open_room(rt)
        value = rt.service.rules.gifts["rose"].price
        outbox_before = await count(rt, t.room_outbox)
        server.switches.slow_ms = HOLD_MS
        with pytest.raises(errors.Unavailable):
            await run(rt, "r1", "g1", rose())
        await assert_nothing_committed(rt, outbox_before)
        server.switches.slow_ms = 0
        server.release()  # the held request now goes through: the debit happens after the client left
        await server.counters.wait_for("charged", 1)
        assert await server.ledger.balance(APP, "bob") == START - value
        body = await run(rt, "r1", "g1", rose())
        assert body["version"] == 3
        assert server.counters["charged"] == 1
        assert await server.ledger.balance(APP, "bob") == START - value


async def test_reconciler_refunds_orphan_debits_through_the_api(
    server: WalletServer, settings: Settings, clock: Clock
) -> None:
    async with runtime_with(settings, clock, server.base_url) as rt:  # wallet.reconcile_after: 10m
        await open_room(rt)
        price = rt.service.rules.gifts["rose"].price
        await run(rt, "r1", "ok", rose(1))
        server.switches.stall_after_debit_ms = HOLD_MS
        with pytest.raises(errors.Unavailable):
            await run(rt, "r1", "orphan", rose(5))  # never retried
        await server.counters.wait_for("charged", 2)
        server.switches.stall_after_debit_ms = 0
        server.release()
        assert await server.ledger.balance(APP, "bob") == START - 6 * price

        assert (await rt.reconciler.run_once()).checked == 0  # nothing is old enough yet
        clock.advance(11 * 60_000)

        server.switches.down = True  # a pass while the wallet is down keeps the orphan for later
        report = await rt.reconciler.run_once()
        assert (report.checked, report.claimed, report.refunded, report.errors) == (1, 0, 0, 1)
        assert server.counters["refund"] == 1 and server.counters["refunded"] == 0
        server.switches.down = False

        report = await rt.reconciler.run_once()
        assert (report.checked, report.claimed, report.refunded, report.errors) == (1, 0, 1, 0)
        assert (server.counters["refund"], server.counters["refunded"]) == (2, 1)  # only the orphan's key
        orphan = await server.ledger.lookup(debit_key(APP, "r1", "orphan"))
        claimed = await server.ledger.lookup(debit_key(APP, "r1", "ok"))
        assert orphan is not None and orphan.status == REFUNDED
        assert claimed is not None and claimed.status == DEBITED
        assert await server.ledger.balance(APP, "bob") == START - price
        assert await count(rt, t.wallet_pending_debit) == 0
        assert (await rt.reconciler.run_once()).checked == 0


@pytest.mark.parametrize("client_key", ["wrong-key", ""])
async def test_wrong_api_key_answers_unavailable_and_commits_nothing(
    server: WalletServer, settings: Settings, clock: Clock, client_key: str
) -> None:
    async with runtime_with(settings, clock, server.base_url, api_key=client_key) as rt:
        await open_room(rt)
        outbox_before = await count(rt, t.room_outbox)
        with pytest.raises(errors.Unavailable) as caught:
            await run(rt, "r1", "g1", rose())
        assert http_status(caught.value) == 503
        assert isinstance(caught.value.__cause__, WalletUnavailable)
        assert "wallet.api_key" in str(caught.value.__cause__)
        await assert_nothing_committed(rt, outbox_before)
        assert server.counters["unauthorized"] == 1
        assert await server.ledger.lookup(debit_key(APP, "r1", "g1")) is None
        assert await server.ledger.balance(APP, "bob") == START


# ---------------------------------------------------------------------- the adapter against the real server


@pytest.mark.parametrize(
    "key", ["room-gift:demo:r1:c-1", "a/b c?d#e%f&g=h+i", "ünï/cødé/refund", "..", ".", "x/refund", "../.."]
)
async def test_keys_are_path_escaped(server: WalletServer, key: str) -> None:
    async with server.client() as wallet:
        debit = await wallet.debit(key=key, app_code="app", user_id="bob", amount=7)
        assert debit.key == key
        found = await wallet.lookup(key)
        assert found == debit
        refunded = await wallet.refund(key)
        assert refunded is not None and (refunded.key, refunded.status) == (key, REFUNDED)
        assert await wallet.balance("app", "bob") == START
    ledger_view = await server.ledger.lookup(key)
    assert ledger_view is not None and ledger_view.status == REFUNDED


@pytest.mark.parametrize("status", [429, 500, 502, 503, 400, 401, 403, 404, 418])
async def test_injected_statuses_are_unavailable(server: WalletServer, status: int) -> None:
    server.switches.fail_status = status
    async with server.client() as wallet:
        for call in (
            wallet.debit(key="k", app_code="app", user_id="bob", amount=1),
            wallet.lookup("k"),
            wallet.refund("k"),
            wallet.balance("app", "bob"),
        ):
            with pytest.raises(WalletUnavailable):
                await call


async def test_malformed_answers_are_unavailable(server: WalletServer) -> None:
    server.switches.malformed = True
    async with server.client() as wallet:
        with pytest.raises(WalletUnavailable, match="not JSON"):
            await wallet.debit(key="k", app_code="app", user_id="bob", amount=1)
        with pytest.raises(WalletUnavailable):
            await wallet.lookup("k")


async def test_wrong_base_url_is_unavailable_not_missing(server: WalletServer) -> None:
    async with HttpWallet(server.base_url + "/nope", api_key=API_KEY, timeout_s=2.0) as wallet:
        with pytest.raises(WalletUnavailable, match=r"wallet\.url"):
            await wallet.lookup("k")  # a 404 without debit_not_found is not "no such debit"
        with pytest.raises(WalletUnavailable):
            await wallet.refund("k")
        with pytest.raises(WalletUnavailable):
            await wallet.debit(key="k", app_code="app", user_id="bob", amount=1)


async def test_definitive_answers_from_the_server(server: WalletServer) -> None:
    async with server.client() as wallet:
        assert await wallet.lookup("missing") is None
        assert await wallet.refund("missing") is None
        with pytest.raises(InsufficientFunds):
            await wallet.debit(key="big", app_code="app", user_id="bob", amount=START + 1)
        await wallet.debit(key="k", app_code="app", user_id="bob", amount=5)
        with pytest.raises(DebitKeyConflict):
            await wallet.debit(key="k", app_code="app", user_id="bob", amount=6)


async def test_refund_then_retry_charges_again_net_once(server: WalletServer) -> None:
    async with server.client() as wallet:
        await wallet.debit(key="k", app_code="app", user_id="bob", amount=100)
        await wallet.refund("k")
        again = await wallet.debit(key="k", app_code="app", user_id="bob", amount=100)
        assert again.status == DEBITED
        assert await wallet.balance("app", "bob") == START - 100
        assert (server.counters["charged"], server.counters["refunded"]) == (2, 1)


async def test_connection_refused_is_unavailable() -> None:
    async with HttpWallet(closed_port_url(), timeout_s=2.0) as wallet:
        with pytest.raises(WalletUnavailable):
            await wallet.debit(key="k", app_code="app", user_id="bob", amount=1)
        with pytest.raises(WalletUnavailable):
            await wallet.refund("k")


# ---------------------------------------------------------------------- the adapter against scripted answers


def scripted(status: int, body: Any = None, *, raw: bytes | None = None) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        if raw is not None:
            return httpx.Response(status, content=raw)
        return httpx.Response(status, json=body)

    return httpx.MockTransport(handler)


def debit_json(**overrides: Any) -> dict[str, Any]:
    debit = {"key": "k", "app_code": "app", "user_id": "bob", "amount": 5, "status": "debited", **overrides}
    return {"debit": debit}


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (402, {"error": {"code": "insufficient_balance"}}, InsufficientFunds),
        (409, {"error": {"code": "debit_key_conflict"}}, DebitKeyConflict),
        (429, {"error": {"code": "rate_limited"}}, WalletUnavailable),
        (500, None, WalletUnavailable),
        (503, {"error": {"code": "unavailable"}}, WalletUnavailable),
        (401, {"error": {"code": "unauthorized"}}, WalletUnavailable),
        (403, {"error": {"code": "forbidden"}}, WalletUnavailable),
        (400, {"error": {"code": "invalid_argument"}}, WalletUnavailable),
        (404, {"error": {"code": "debit_not_found"}}, WalletUnavailable),  # a debit POST has no "not found"
        (302, None, WalletUnavailable),
        (200, [1, 2], WalletUnavailable),
        (200, {"debit": None}, WalletUnavailable),
        (200, debit_json(amount="5"), WalletUnavailable),
        (200, debit_json(amount=True), WalletUnavailable),
        (200, debit_json(status="pending"), WalletUnavailable),
        (200, debit_json(key="other"), WalletUnavailable),
        (200, debit_json(amount=6), WalletUnavailable),
        (200, {**debit_json(), "charged": "no"}, WalletUnavailable),
        (200, debit_json(status="refunded"), WalletUnavailable),  # a debit call must leave the key debited
        (409, {"error": {"code": "in_progress"}}, WalletUnavailable),  # only debit_key_conflict is definitive
    ],
)
async def test_debit_answer_mapping(status: int, body: Any, expected: type[Exception]) -> None:
    async with HttpWallet("http://wallet.test", timeout_s=1.0, transport=scripted(status, body)) as wallet:
        with pytest.raises(expected):
            await wallet.debit(key="k", app_code="app", user_id="bob", amount=5)


@pytest.mark.parametrize(("extra", "charged"), [({}, True), ({"charged": True}, True), ({"charged": False}, False)])
async def test_whether_the_debit_charged_now_is_read(extra: dict[str, Any], charged: bool) -> None:
    """Without "charged" (a wallet that does not say) a charge is assumed, as before."""
    transport = scripted(200, {**debit_json(), **extra})
    async with HttpWallet("http://wallet.test", timeout_s=1.0, transport=transport) as wallet:
        assert (await wallet.debit(key="k", app_code="app", user_id="bob", amount=5)).charged is charged


async def test_well_formed_answers_are_read() -> None:
    async with HttpWallet("http://wallet.test", timeout_s=1.0, transport=scripted(200, debit_json())) as wallet:
        debit = await wallet.debit(key="k", app_code="app", user_id="bob", amount=5)
        assert (debit.key, debit.amount, debit.status) == ("k", 5, DEBITED)
        assert await wallet.lookup("k") == debit
    not_found = scripted(404, {"error": {"code": "debit_not_found"}})
    async with HttpWallet("http://wallet.test", timeout_s=1.0, transport=not_found) as wallet:
        assert await wallet.lookup("k") is None
        assert await wallet.refund("k") is None


@pytest.mark.parametrize("balance", ["10", 1.5, True, None])
async def test_malformed_balance_is_unavailable(balance: Any) -> None:
    transport = scripted(200, {"app_code": "app", "user_id": "bob", "balance": balance})
    async with HttpWallet("http://wallet.test", timeout_s=1.0, transport=transport) as wallet:
        with pytest.raises(WalletUnavailable):
            await wallet.balance("app", "bob")


async def test_non_json_body_is_unavailable() -> None:
    transport = scripted(200, raw=b"<html>gateway</html>")
    async with HttpWallet("http://wallet.test", timeout_s=1.0, transport=transport) as wallet:
        with pytest.raises(WalletUnavailable):
            await wallet.lookup("k")


@pytest.mark.parametrize(
    "error",
    [
        httpx.ConnectError("refused"),
        httpx.ReadTimeout("slow"),
        httpx.ConnectTimeout("slow"),
        httpx.RemoteProtocolError("closed mid-answer"),
        httpx.ReadError("reset"),
    ],
)
async def test_transport_errors_are_unavailable(error: httpx.HTTPError) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise error

    async with HttpWallet("http://wallet.test", timeout_s=1.0, transport=httpx.MockTransport(handler)) as wallet:
        with pytest.raises(WalletUnavailable):
            await wallet.debit(key="k", app_code="app", user_id="bob", amount=5)


async def test_a_hanging_wallet_is_cut_off_at_the_timeout() -> None:
    never = asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        await never.wait()
        raise AssertionError("unreachable")

    loop = asyncio.get_running_loop()
    async with HttpWallet("http://wallet.test", timeout_s=0.05, transport=httpx.MockTransport(handler)) as wallet:
        started = loop.time()
        with pytest.raises(WalletUnavailable, match="no answer within"):
            await wallet.debit(key="k", app_code="app", user_id="bob", amount=5)
        assert loop.time() - started < 1.0


async def test_request_shape_and_bearer_header() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path.startswith("/base/v1/balances/"):
            return httpx.Response(200, json={"app_code": "app", "user_id": "bob", "balance": 3})
        return httpx.Response(200, json=debit_json(key="a/b"))

    transport = httpx.MockTransport(handler)
    async with HttpWallet("http://wallet.test/base/", api_key="sekrit", timeout_s=1.0, transport=transport) as w:
        await w.debit(key="a/b", app_code="app", user_id="bob", amount=5)
        await w.lookup("a/b")
        await w.refund("a/b")
        assert await w.balance("app", "bob") == 3
    assert [(r.method, r.url.raw_path.decode()) for r in seen] == [
        ("POST", "/base/v1/debits"),
        ("GET", "/base/v1/debits/a%2Fb"),
        ("POST", "/base/v1/debits/a%2Fb/refund"),
        ("GET", "/base/v1/balances/app/bob"),
    ]
    assert all(r.headers["authorization"] == "Bearer sekrit" for r in seen)
    assert json.loads(seen[0].content) == {"key": "a/b", "app_code": "app", "user_id": "bob", "amount": 5}

    seen.clear()
    async with HttpWallet("http://wallet.test/base", timeout_s=1.0, transport=transport) as w:
        await w.lookup("a/b")
    assert "authorization" not in seen[0].headers


async def test_from_config(tmp_path: Path) -> None:
    settings = make_settings(
        f"sqlite+aiosqlite:///{tmp_path}/room.db",
        tmp_path,
        **{"wallet.driver": "http", "wallet.url": "http://wallet.internal:8080", "wallet.api_key": "k"},
    )
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"app_code": "app", "user_id": "bob", "balance": 1})

    async with HttpWallet.from_config(settings.wallet, transport=httpx.MockTransport(handler)) as wallet:
        assert await wallet.balance("app", "bob") == 1
    assert str(seen[0].url) == "http://wallet.internal:8080/v1/balances/app/bob"
    assert seen[0].headers["authorization"] == "Bearer k"
