"""What a projection is rebuilt from: the open rooms of the database, each loaded in full."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeAlias

from roomservice import errors
from roomservice.domain.state import CLOSED, RoomState
from roomservice.observability.logging import get_logger
from roomservice.projections.port import RoomListEntry
from roomservice.store.port import RoomStore

_log = get_logger("roomservice.projections")

RebuildItem: TypeAlias = RoomState | RoomListEntry
Loader: TypeAlias = Callable[[], Awaitable[Sequence[RebuildItem]]]


def store_loader(store: RoomStore, *, limit: int = 10_000, concurrency: int = 4) -> Loader:
    """A rebuild loader: the open rooms among the ``limit`` newest room_meta rows, each loaded in full
    (snapshot + log, ``concurrency`` at a time) so that presence comes back with the list."""

    async def load() -> list[RebuildItem]:
        summaries = [s for s in await store.list_room_summaries(limit=limit) if s.status != CLOSED]
        gate = asyncio.Semaphore(concurrency)

        async def one(app_code: str, room_id: str) -> RoomState | None:
            async with gate:
                try:
                    return (await store.load_room(app_code, room_id)).state
                except errors.Unavailable:  # the database did not answer (StoreUnavailable): no rebuild now
                    raise
                except Exception as exc:  # inconsistent, undecodable: this room cannot be served either
                    _log.warning(
                        "projections_rebuild_skipped_room", app_code=app_code, room_id=room_id, error=repr(exc)
                    )
                    return None

        states = await asyncio.gather(*(one(s.app_code, s.room_id) for s in summaries))
        return [state for state in states if state is not None and state.status != CLOSED]

    return load
