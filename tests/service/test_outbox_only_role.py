"""Bootstrap by role (issue 7 §3): a process with the outbox role alone builds the worker and nothing of the rooms.

No command pipeline (cells, leases, projections), no reconciler, no timer runner,
no consumers; yet it delivers the rows another process committed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.service.conftest import make_settings
from tests.service.test_mq_mode import eventually

from roomservice.bootstrap import API, OUTBOX, Process
from roomservice.domain import commands as c
from roomservice.outbox.model import BROKER, TREASURE_WAKEUP

ROOM_TASKS = {
    "cell-eviction", "lease-renewal", "projections-rebuild", "treasure-timer", "outbox-retention", "dedup-retention",
    "wallet-reconcile", "presence-restore",
}


async def test_the_outbox_role_builds_no_cells_reconciler_or_projections(tmp_path: Path) -> None:
    settings = make_settings(f"sqlite+aiosqlite:///{tmp_path}/room.db", tmp_path)  # mq on the embedded broker
    async with Process.running(settings, roles=(API,), loops=False) as api:
        await api.service.execute("demo", "r1", "c1", c.CreateRoom(owner_id="alice", title="outbox only"))
        await api.service.execute("demo", "r1", "c2", c.JoinRoom(user_id="bob"))

        async with Process.running(settings, roles=(OUTBOX,)) as outbox:
            assert outbox.roles == frozenset({OUTBOX})
            # what the role uses
            assert outbox.worker is not None
            assert set(outbox.worker.publishers.names) == {BROKER, TREASURE_WAKEUP}
            assert outbox.broker is not None
            assert outbox.treasure_timer is not None  # the worker schedules wake-ups; it fires none
            # what it does not build
            assert outbox.commands is None
            for part in ("service", "store", "registry", "leases", "wallet", "reconciler"):
                with pytest.raises(LookupError):
                    getattr(outbox, part)
            assert outbox.maintenance is None
            assert outbox.timer_runner is None
            assert outbox.consumers is None
            assert outbox.room_api is None
            running = {task.get_name() for task in outbox.core.tasks if not task.done()}
            assert not running & ROOM_TASKS, running
            _, checks = await outbox.health.run()
            assert set(checks) == {"database", "broker", "outbox_worker"}

            admin = outbox.outbox_admin
            assert admin is not None

            async def delivered() -> bool:
                stats = await admin.stats()
                return stats.counts.get("delivered", 0) >= 2 and stats.counts.get("pending", 0) == 0

            await eventually(delivered, what="the API process's rows delivered by the outbox-only process")
