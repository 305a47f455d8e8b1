"""The direct-mode targets (Tencent IM, activity) and, in the embedded mode, the in-process services behind them.

An empty ``tencent_im.base_url`` serves an IM sandbox in process (its app id
and key made up at start) so a newcomer sees messages without credentials; an
empty ``activity.target`` runs the reference activity service in process.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import httpx

from roomservice.activity.service import RunningActivityService, running_activity_service
from roomservice.bootstrap.core import Check, Core, alive_check
from roomservice.integrations.im_sandbox.server import RunningSandbox, running_sandbox
from roomservice.integrations.tencent_im.client import TencentImClient
from roomservice.observability.logging import get_logger
from roomservice.outbox.model import ACTIVITY, IM
from roomservice.publishers.activity import ActivityPublisher
from roomservice.publishers.port import Publisher
from roomservice.publishers.tencent_im import SentSteps, TencentImPublisher

_log = get_logger("roomservice.bootstrap")

EMBEDDED_SDK_APP_ID = 1_400_000_000  # the in-process IM sandbox's app when none is configured


@dataclass(slots=True)
class ImParts:
    """The Tencent IM client of this process, the publisher on it, and the in-process sandbox if it serves one."""

    client: TencentImClient
    publisher: TencentImPublisher
    sandbox: RunningSandbox | None = None


@dataclass(slots=True)
class DirectTargets:
    publishers: dict[str, Publisher] = field(default_factory=dict)
    activity_service: RunningActivityService | None = None


async def build_direct_targets(core: Core, *, im: ImParts | None, skip: frozenset[str] = frozenset()) -> DirectTargets:
    """The publishers of the direct mode that ``skip`` (targets given by the caller) does not name;
    ``im`` is the process's IM (None when tencent_im is disabled or the caller gives the target)."""
    targets = DirectTargets()
    if IM not in skip and im is not None:
        targets.publishers[IM] = im.publisher
    if ACTIVITY not in skip:
        target = core.settings.activity.target
        if not target:
            service = await core.stack.enter_async_context(running_activity_service(core.db, clock=core.clock))
            targets.activity_service = service
            target = service.target
            core.health.register("activity_service", alive_check("activity service", lambda: service.serving))
        publisher = ActivityPublisher(target)
        core.stack.push_async_callback(publisher.close)
        targets.publishers[ACTIVITY] = publisher
    return targets


async def start_im(core: Core) -> ImParts:
    """The IM client (and the sandbox behind it in the embedded mode), closed with the process."""
    config = core.settings.tencent_im
    sandbox: RunningSandbox | None = None
    if config.base_url:
        client = TencentImClient.from_config(config)
    else:
        sdk_app_id = config.sdk_app_id or EMBEDDED_SDK_APP_ID
        secret = config.secret_key.get_secret_value() or secrets.token_hex(32)
        data_dir = core.settings.data_dir  # None (tests without a data dir): the sandbox lives in memory
        sandbox = await core.stack.enter_async_context(
            running_sandbox(sdk_app_id, secret, admin_identifiers=(config.admin_identifier,), state_dir=data_dir)
        )
        client = TencentImClient.from_config(
            config,
            base_url=sandbox.base_url,
            sdk_app_id=sdk_app_id,
            secret_key=secret,
            transport=sandbox.in_process_transport(),  # the same process: no socket, no HTTP stack
        )
        core.health.register("im_sandbox", _http_check(f"{sandbox.base_url}/_sandbox/healthz", sandbox.transport()))
        kept = sandbox.state.persistence()
        _log.info(
            "im_sandbox_started",
            url=sandbox.base_url,
            sdk_app_id=sdk_app_id,
            state=kept["path"] or "memory",
            replayed=kept["replayed"],
        )
    core.stack.push_async_callback(client.aclose)
    publisher = TencentImPublisher(client, SentSteps(core.db, clock=core.clock), group_type=config.group_type)
    return ImParts(client=client, publisher=publisher, sandbox=sandbox)


def _http_check(url: str, transport: httpx.AsyncBaseTransport | None) -> Check:
    async def check() -> None:
        async with httpx.AsyncClient(transport=transport, timeout=2.0) as http:
            (await http.get(url)).raise_for_status()

    return check
