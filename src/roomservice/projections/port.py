"""The projection port: room list and presence, updated after each commit.

Projections are derived and rebuildable; a failure is logged by the caller and
never fails a command. The in-process adapter serves the embedded mode; the
Redis adapter implements the same port for scale-out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from roomservice.domain.state import CLOSED, RoomState


@dataclass(frozen=True, slots=True)
class RoomListEntry:
    app_code: str
    room_id: str
    title: str
    owner_id: str
    status: str
    member_count: int
    heat: int
    version: int

    def to_dict(self) -> dict[str, object]:
        return {
            "room_id": self.room_id,
            "title": self.title,
            "owner_id": self.owner_id,
            "status": self.status,
            "member_count": self.member_count,
            "heat": self.heat,
            "version": self.version,
        }

    @classmethod
    def of(cls, state: RoomState) -> RoomListEntry:
        return cls(
            app_code=state.app_code,
            room_id=state.room_id,
            title=state.title,
            owner_id=state.owner_id,
            status=state.status,
            member_count=len(state.members),
            heat=state.heat,
            version=state.version,
        )


class Projections(Protocol):
    async def room_changed(self, before: RoomState | None, after: RoomState) -> None:
        """Update the list entry and presence for a committed change."""
        ...

    async def seed(self, entries: list[RoomListEntry]) -> None:
        """Fill the room list at start (from room_meta); existing newer entries win."""
        ...

    async def list_rooms(self, app_code: str, *, limit: int) -> list[RoomListEntry]:
        """Open rooms of an app, busiest first."""
        ...

    async def room_of(self, app_code: str, user_id: str) -> str | None:
        """The room a user is present in, if any."""
        ...


_NOBODY: Mapping[str, int] = MappingProxyType({})


class InProcessProjections:
    def __init__(self) -> None:
        self._rooms: dict[str, dict[str, RoomListEntry]] = {}
        self._presence: dict[tuple[str, str], str] = {}

    async def room_changed(self, before: RoomState | None, after: RoomState) -> None:
        entry = RoomListEntry.of(after)
        rooms = self._rooms.setdefault(after.app_code, {})
        if entry.status == CLOSED:
            rooms.pop(after.room_id, None)
        else:
            rooms[after.room_id] = entry
        old = before.members if before is not None else _NOBODY
        new = after.members if after.status != CLOSED else _NOBODY
        if old is new:  # the same members (a gift, a mic): nobody came or went
            return
        # differences of the key views: no set of every member built per command
        for user in old.keys() - new.keys():
            if self._presence.get((after.app_code, user)) == after.room_id:
                del self._presence[(after.app_code, user)]
        for user in new.keys() - old.keys():
            self._presence[(after.app_code, user)] = after.room_id

    async def seed(self, entries: list[RoomListEntry]) -> None:
        for entry in entries:
            if entry.status == CLOSED:
                continue
            rooms = self._rooms.setdefault(entry.app_code, {})
            current = rooms.get(entry.room_id)
            if current is None or current.version < entry.version:
                rooms[entry.room_id] = entry

    async def list_rooms(self, app_code: str, *, limit: int) -> list[RoomListEntry]:
        rooms = self._rooms.get(app_code, {}).values()
        ranked = sorted(rooms, key=lambda r: (-r.member_count, -r.heat, r.room_id))
        return ranked[:limit]

    async def room_of(self, app_code: str, user_id: str) -> str | None:
        return self._presence.get((app_code, user_id))
