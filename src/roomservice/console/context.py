"""What the console needs from the running process, gathered once when the HTTP app is built."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from roomservice.admin.dead_letters import DeadLetterAdmin
from roomservice.admin.operations import OutboxAdmin
from roomservice.config import Settings
from roomservice.console.jobs import Jobs
from roomservice.console.queries import backlog
from roomservice.console.series import DeliverySeries
from roomservice.console.session import Sessions
from roomservice.health import HealthChecks
from roomservice.integrations.im_sandbox.state import SandboxState
from roomservice.store.database import Database

if TYPE_CHECKING:
    from roomservice.bootstrap.process import Process


@dataclass(slots=True)
class Console:
    """The console's view of one process: its settings and roles, the admin operations, the broker's
    dead letters (when it has a broker), the in-process IM sandbox (embedded default), the room reader."""

    settings: Settings
    roles: frozenset[str]
    db: Database
    health: HealthChecks
    outbox: OutboxAdmin
    sessions: Sessions
    clock: Callable[[], int]
    room_view: Callable[[str, str], Awaitable[dict[str, Any]]] | None = None
    dead_letters: DeadLetterAdmin | None = None
    broker_name: str | None = None
    sandbox: SandboxState | None = None
    series: DeliverySeries = field(default_factory=DeliverySeries)
    jobs: Jobs = field(default_factory=Jobs)

    @classmethod
    def from_process(cls, process: Process, *, admin_token: str) -> Console:
        settings = process.settings
        assert process.outbox_admin is not None  # every process builds the admin operations
        dead_letters = DeadLetterAdmin.of_process(process)
        room_view = None
        if process.commands is not None:
            room_view = process.commands.forwarder.room
        return cls(
            settings=settings,
            roles=process.roles,
            db=process.db,
            health=process.health,
            outbox=process.outbox_admin,
            sessions=Sessions(admin_token, ttl_s=settings.console.session_ttl.total_seconds()),
            clock=process.core.clock,
            room_view=room_view,
            dead_letters=dead_letters,
            broker_name=process.broker.name if process.broker is not None else None,
            sandbox=process.sandbox.state if process.sandbox is not None else None,
        )

    async def sample(self) -> None:
        """Keep the overview's chart series (run as a background task of the process)."""
        db = self.db
        await self.series.run(lambda: backlog(db), self.clock)
