"""The console in Debian's Chromium, driven by Playwright, against a served process on MariaDB.

* direct mode: a real IM outage (the sandbox answers 503) turns rows into dead
  letters; the operator logs in, filters the failed rows, opens one, replays
  the set after the outage and watches them become delivered.
* mq mode (embedded broker): the IM bridge group dead-letters what it could
  not deliver during the outage; the operator finds them and replays them.

Every page is checked at 375 px wide (no sideways scrolling) and kept as a
screenshot in ``test-artifacts/console/``. One browser serves the module.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import sqlalchemy as sa
import uvicorn
from tests.acceptance.conftest import FAST_RETRIES, statuses
from tests.conftest import in_ci
from tests.console.conftest import ADMIN_TOKEN
from tests.service.conftest import DIRECT, make_settings

from roomservice.api.app import ApiContext, create_app
from roomservice.bootstrap import Process
from roomservice.config import Settings
from roomservice.console import Console
from roomservice.domain import commands as c
from roomservice.store import tables as t

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "console"
NARROW = {"width": 375, "height": 740}
APP = "demo"
IM_BRIDGE = "hyapp-room-im-bridge"


def _require_chromium() -> None:
    """A missing browser fails the browser tests in CI and skips them (with the reason) elsewhere."""
    if not CHROMIUM.exists():
        message = f"{CHROMIUM} is missing: scripts/browser installs Debian's chromium"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser() -> AsyncIterator[Any]:
    _require_chromium()
    from playwright.async_api import async_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    async with async_playwright() as playwright:
        chromium = await playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            await chromium.close()


@asynccontextmanager
async def served(settings: Settings) -> AsyncIterator[tuple[Process, str]]:
    """The process as ``serve`` runs it (every role, the console and its sampler) on a free port."""
    async with Process.running(settings) as rt:
        console = Console.from_process(rt, admin_token=ADMIN_TOKEN)
        rt.core.spawn("console-sampler", console.sample())
        app = create_app(ApiContext(service=rt.service, health=rt.health, admin_token=ADMIN_TOKEN, console=console))
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, access_log=False, lifespan="off")
        )
        server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        serving = asyncio.create_task(server.serve())
        await until(lambda: _started(server), what="uvicorn to listen")
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            yield rt, f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            await serving
            await console.jobs.aclose()


async def _started(server: uvicorn.Server) -> bool:
    return server.started


async def until(check: Callable[[], Awaitable[Any]], *, what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        result = await check()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def check_page(page: Any, name: str) -> None:
    """No sideways scrolling at this width; keep a screenshot."""
    width = await page.evaluate("document.documentElement.scrollWidth")
    viewport = page.viewport_size["width"]
    await page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)
    assert width <= viewport, f"{name} scrolls sideways at {viewport}px: {width}px wide ({page.url})"


async def log_in(page: Any, base: str, *, operator: str) -> None:
    await page.goto(f"{base}/console/")
    assert "/console/login" in page.url  # no session: the login page
    await check_page(page, "login")
    await page.fill('input[name="operator"]', operator)
    await page.fill('input[name="token"]', ADMIN_TOKEN)
    await page.click('button[type="submit"]')
    await page.wait_for_url(f"{base}/console/")
    assert operator in await page.inner_text("header")


async def test_direct_mode_filter_the_failed_rows_of_an_im_outage_open_one_replay_them(
    browser: Any, fresh_mariadb_url: str, tmp_path: Path
) -> None:
    settings = make_settings(fresh_mariadb_url, tmp_path, **FAST_RETRIES, **DIRECT)
    async with served(settings) as (rt, base):
        assert rt.sandbox is not None
        rt.sandbox.state.set_outage("http_503")
        room = "outage"
        await rt.service.execute(APP, room, "b-1", c.CreateRoom(owner_id="alice", title="IM is down"))
        await rt.service.execute(APP, room, "b-2", c.JoinRoom(user_id="bob"))
        await rt.service.execute(APP, room, "b-3", c.JoinRoom(user_id="carol"))

        async def three_failed() -> bool:
            return (await statuses(rt)).get("failed", 0) == 3

        await until(three_failed, what="the outage's rows to become dead letters")

        context = await browser.new_context(viewport=NARROW)
        page = await context.new_page()
        await log_in(page, base, operator="Olga")
        assert await page.inner_text('td[data-status="failed"]') == "3"
        await check_page(page, "overview")

        # filter: failed rows whose error names the outage
        await page.click('nav a[href="/console/outbox"]')
        await page.check('input[name="status"][value="failed"]')
        await page.fill('input[name="error"]', "503")
        await page.click('form.filters button[type="submit"]')
        await page.wait_for_url("**/console/outbox?*")
        assert await page.inner_text("#match-count") == "3"
        assert await page.locator('tr[data-status="failed"]').count() == 3
        await check_page(page, "outbox-failed")
        filtered = page.url

        # open one
        await page.locator('tr[data-status="failed"] a[href^="/console/outbox/"]').first.click()
        await page.wait_for_selector("#row-status")
        assert await page.inner_text("#row-status") == "failed"
        assert "im" in await page.inner_text("table.kv")  # the target still pending
        await check_page(page, "event-detail")

        # the outage ends; replay the whole filtered set, after the confirmation
        rt.sandbox.state.set_outage(None)
        await page.goto(filtered)
        await page.click('button[name="selection"][value="matching"]')
        await page.wait_for_selector("#confirm-count")
        assert await page.inner_text("#confirm-count") == "3"
        await check_page(page, "confirm-replay")
        await page.click("#confirm")
        await page.wait_for_url("**/console/jobs/*")
        from playwright.async_api import expect

        await expect(page.locator("#job-state")).to_have_text("done", timeout=15_000)  # the page's own polling
        assert await page.inner_text("#job-done") == "3"
        await check_page(page, "replay-job")

        # poll the browser until the rows are delivered
        async def delivered_in_the_browser() -> bool:
            await page.goto(f"{base}/console/outbox?status=delivered&room={room}")
            return await page.inner_text("#match-count") == "3"

        await until(delivered_in_the_browser, what="the replayed rows to be delivered")
        await check_page(page, "outbox-delivered")

        # the event's history names the operator
        await page.locator('a[href^="/console/outbox/"]').first.click()
        await page.wait_for_selector("#row-status")
        assert await page.inner_text("#row-status") == "delivered"
        assert "console:Olga" in await page.content()

        # the other pages, for the record
        await page.goto(f"{base}/console/rooms?app={APP}&room={room}")
        assert await page.inner_text("#room-version") == "3"
        await check_page(page, "room-inspector")
        await page.goto(f"{base}/console/im")
        await check_page(page, "im-sandbox")
        group_link = page.locator('a[href^="/console/im?group="]').first
        await group_link.click()
        await page.wait_for_url("**/console/im?group=*")
        assert "RoomUserJoined" in await page.content()
        await check_page(page, "im-sandbox-group")
        await page.goto(f"{base}/console/")
        await check_page(page, "overview-after")

        # the same pages on a desktop screen, for the record
        desktop = await browser.new_context(
            viewport={"width": 1280, "height": 900}, storage_state=await context.storage_state()
        )
        wide = await desktop.new_page()
        for name, path in [
            ("overview", "/console/"),
            ("outbox", "/console/outbox"),
            ("room-inspector", f"/console/rooms?app={APP}&room={room}"),
            ("im-sandbox", "/console/im"),
        ]:
            await wide.goto(base + path)
            await check_page(wide, f"desktop-{name}")
        await desktop.close()
        await context.close()


async def test_mq_mode_find_a_consumer_groups_dead_letters_after_an_outage_and_replay_them(
    browser: Any, fresh_mariadb_url: str, tmp_path: Path
) -> None:
    settings = make_settings(
        fresh_mariadb_url,
        tmp_path,
        **FAST_RETRIES,
        **{"rocketmq.room_outbox.consumer_max_reconsume_times": 1, "broker.driver": "embedded"},
    )
    assert settings.outbox_worker.publish_mode == "mq"
    async with served(settings) as (rt, base):
        assert rt.sandbox is not None and rt.broker is not None
        rt.sandbox.state.set_outage("http_503")
        room = f"mq-{secrets.token_hex(3)}"
        await rt.service.execute(APP, room, "m-1", c.CreateRoom(owner_id="alice", title="Bridge down"))
        await rt.service.execute(APP, room, "m-2", c.JoinRoom(user_id="bob"))

        async def dead_lettered() -> bool:
            stats = await rt.broker.group_stats(settings.rocketmq.room_outbox.topic, IM_BRIDGE)  # type: ignore[union-attr]
            return stats.dead_letters == 2

        await until(dead_lettered, what="the IM bridge to dead-letter the outage's messages")
        assert set(await statuses(rt)) == {"delivered"}  # the outbox did its part: the broker has them

        context = await browser.new_context(viewport=NARROW)
        page = await context.new_page()
        await log_in(page, base, operator="Mia")
        assert IM_BRIDGE in await page.inner_text("main")  # the overview lists the group
        await check_page(page, "mq-overview")
        await page.click('nav a[href="/console/consumers"]')
        await page.click(f'a[href="/console/consumers?group={IM_BRIDGE}"]')
        await page.wait_for_url(f"**group={IM_BRIDGE}")
        assert await page.inner_text(f'td[data-group="{IM_BRIDGE}"]') == "2"
        assert await page.inner_text("#letter-count") == "2"
        await check_page(page, "consumer-dead-letters")

        rt.sandbox.state.set_outage(None)
        await page.click('button[name="selection"][value="all"]')
        await page.wait_for_selector("#confirm-count")
        assert await page.inner_text("#confirm-count") == "2"
        await check_page(page, "consumer-confirm")
        await page.click("#confirm")
        await page.wait_for_selector('#job[data-state="done"]')  # a job, its page polling it to the end
        assert "replayed 2 dead letter(s)" in await page.inner_text("#job-summary")
        assert await page.inner_text("#job-done") == "2"
        await check_page(page, "consumer-replayed")

        async def no_dead_letters_left() -> bool:
            await page.goto(f"{base}/console/consumers?group={IM_BRIDGE}")
            return await page.inner_text(f'td[data-group="{IM_BRIDGE}"]') == "0"

        await until(no_dead_letters_left, what="the replayed dead letters to be consumed")
        joined = await until(lambda: _im_types(rt, room), what="the IM bridge to deliver the replayed messages")
        assert joined == ["RoomUserJoined"]
        async with rt.db.read() as conn:
            audit = (
                await conn.execute(
                    sa.select(t.room_outbox_audit.c.action, t.room_outbox_audit.c.actor).where(
                        t.room_outbox_audit.c.action == "consumer_replay"
                    )
                )
            ).all()
        assert [tuple(a) for a in audit] == [("consumer_replay", "console:Mia")] * 2
        await context.close()


async def _im_types(rt: Process, room: str) -> list[str] | None:
    import json

    from roomservice.integrations.tencent_im.client import group_id_for

    assert rt.sandbox is not None
    group = group_id_for(APP, room, group_type=rt.settings.tencent_im.group_type)
    types = [json.loads(m.data or "{}").get("type") for m in rt.sandbox.state.messages(group)]
    return types or None
