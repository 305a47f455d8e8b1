"""``/admin/outbox…``: the dead-letter operations of :class:`OutboxAdmin` over HTTP (bearer admin token).

    GET  /admin/outbox/stats
    GET  /admin/outbox?status=&type=&app=&room=&older_than=&newer_than=&error=&limit=&after_id=
    GET  /admin/outbox/{event_id}
    POST /admin/outbox/replay   {"event_ids": [...], "as_repair": false}
                                or {"filter": {...}, "as_repair": false}
                                (a repair may add "targets": ["im", "activity", ...];
                                 without it, the targets the original had not reached)

``status`` may be repeated or comma-separated; durations are Go strings
(``"10m"``, ``"1h30m"``). Bad values answer ``400 invalid_argument``, an
unknown event id ``404 not_found``, a missing or wrong token ``401
unauthorized`` — always in the one error shape of SPEC §8.

Event ids (in the path and in ``event_ids``) and the ``type``, ``app`` and
``room`` filters must match the domain's patterns (``domain/limits.py``, as on
the public routes); anything else is ``400 invalid_argument`` naming the field,
``GET /admin/outbox/{event_id}`` included: such a value is malformed, not
missing, and MariaDB would not even compare it with its ascii_bin column
("database unavailable", 503). See :mod:`roomservice.admin.operations`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, model_validator

from roomservice.admin.operations import MAX_LIST_LIMIT, OutboxAdmin, OutboxFilter
from roomservice.domain.limits import APP_CODE_PATTERN, ID_PATTERN, MAX_ID_VALUE, ROOM_ID_PATTERN

ACTOR = "admin-api"
MAX_REPLAY_IDS = 1000

# ids are compared with ascii_bin columns: the domain's patterns, not only lengths (module docstring)
EventId = Annotated[str, Field(pattern=ID_PATTERN, min_length=1, max_length=64)]
EventType = Annotated[str, Field(pattern=ID_PATTERN, min_length=1, max_length=64)]
AppCode = Annotated[str, Field(pattern=APP_CODE_PATTERN, min_length=1, max_length=32)]
RoomId = Annotated[str, Field(pattern=ROOM_ID_PATTERN, min_length=1, max_length=48)]
FilterText = Annotated[str, Field(min_length=1, max_length=200)]


class ReplayFilterBody(BaseModel):
    """The bulk replay filter; ``status`` may only be ``failed`` (the default)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    status: list[FilterText] | None = None
    type: EventType | None = None
    app: AppCode | None = None
    room: RoomId | None = None
    older_than: FilterText | None = None
    newer_than: FilterText | None = None
    error: FilterText | None = None

    def to_filter(self) -> OutboxFilter:
        return OutboxFilter.parse(
            statuses=self.status or [],
            event_type=self.type,
            app_code=self.app,
            room_id=self.room,
            older_than=self.older_than,
            newer_than=self.newer_than,
            error_contains=self.error,
        )


class ReplayBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    event_ids: list[EventId] | None = Field(default=None, min_length=1, max_length=MAX_REPLAY_IDS)
    filter: ReplayFilterBody | None = None
    as_repair: bool = False
    # repair only; names checked by OutboxAdmin (400 naming the valid ones)
    targets: list[FilterText] | None = Field(
        default=None,
        max_length=16,
        description="as_repair only: send the repair to these targets (im, activity, broker, treasure_wakeup); "
        "default: the targets the original had not reached",
    )

    @model_validator(mode="after")
    def _ids_or_filter(self) -> ReplayBody:
        if (self.event_ids is None) == (self.filter is None):
            raise ValueError("give exactly one of event_ids or filter")
        return self


def admin_router(
    admin: OutboxAdmin,
    require_admin: Callable[..., Awaitable[None]],
    *,
    route_class: type[APIRoute] = APIRoute,
    responses: dict[int | str, dict[str, Any]] | None = None,
) -> APIRouter:
    """The routes; ``route_class`` and ``responses`` are the app's (body reading, documented errors)."""
    router = APIRouter(
        prefix="/admin/outbox",
        tags=["admin"],
        dependencies=[Depends(require_admin)],
        route_class=route_class,
        responses=responses,
    )

    @router.get("/stats")
    async def outbox_stats() -> dict[str, Any]:
        return (await admin.stats()).to_dict()

    @router.get("")
    async def outbox_list(
        status: Annotated[list[str] | None, Query(description="repeat or comma-separate")] = None,
        event_type: Annotated[str | None, Query(alias="type", pattern=ID_PATTERN, min_length=1, max_length=64)] = None,
        app: Annotated[str | None, Query(pattern=APP_CODE_PATTERN, min_length=1, max_length=32)] = None,
        room: Annotated[str | None, Query(pattern=ROOM_ID_PATTERN, min_length=1, max_length=48)] = None,
        older_than: Annotated[str | None, Query(description='Go duration, e.g. "10m"')] = None,
        newer_than: Annotated[str | None, Query(description='Go duration, e.g. "1h"')] = None,
        error: Annotated[str | None, Query(min_length=1, max_length=200)] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT)] = 50,
        after_id: Annotated[int | None, Query(ge=0, le=MAX_ID_VALUE)] = None,
    ) -> dict[str, Any]:
        flt = OutboxFilter.parse(
            statuses=status or [],
            event_type=event_type,
            app_code=app,
            room_id=room,
            older_than=older_than,
            newer_than=newer_than,
            error_contains=error,
        )
        rows = await admin.list(flt, limit=limit, after_id=after_id)
        return {
            "rows": [r.to_dict() for r in rows],
            # a full page may have more behind it: ask again with after_id
            "next_after_id": rows[-1].id if len(rows) == limit else None,
        }

    @router.get("/{event_id}")
    async def outbox_show(
        event_id: Annotated[str, Path(pattern=ID_PATTERN, min_length=1, max_length=64)],
    ) -> dict[str, Any]:
        return (await admin.show(event_id)).to_dict()

    @router.post("/replay")
    async def outbox_replay(body: ReplayBody) -> dict[str, Any]:
        if body.event_ids is not None:
            report = await admin.replay(body.event_ids, actor=ACTOR, as_repair=body.as_repair, targets=body.targets)
        else:
            assert body.filter is not None  # the model validator guarantees one of the two
            report = await admin.replay_matching(
                body.filter.to_filter(), actor=ACTOR, as_repair=body.as_repair, targets=body.targets
            )
        return report.to_dict()

    return router
