"""The projection port: room list and presence, updated after each commit.

Projections are derived and rebuildable; a failure is logged by the caller and
never fails a command. The in-process adapter serves the embedded mode; the
Redis adapter implements the same port for scale-out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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
        # between expect_restore() and restore(): the users whose presence a command projected meanwhile
        self._touched: set[tuple[str, str]] | None = None

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
        touched = self._touched
        for user in old.keys() - new.keys():
            if self._presence.get((after.app_code, user)) == after.room_id:
                del self._presence[(after.app_code, user)]
            if touched is not None:
                touched.add((after.app_code, user))
        for user in new.keys() - old.keys():
            self._presence[(after.app_code, user)] = after.room_id
            if touched is not None:
                touched.add((after.app_code, user))

    async def seed(self, entries: list[RoomListEntry]) -> None:
        for entry in entries:
            if entry.status == CLOSED:
                continue
            rooms = self._rooms.setdefault(entry.app_code, {})
            current = rooms.get(entry.room_id)
            if current is None or current.version < entry.version:
                rooms[entry.room_id] = entry

    def expect_restore(self) -> None:
        """A :meth:`restore` follows (a restart: the list is seeded at once, presence loaded later); until
        it runs, every user a command projects is remembered, so that the load does not undo it."""
        self._touched = set()

    async def restore(self, states: Iterable[RoomState]) -> int:
        """Presence after a restart, from the open rooms loaded in full after :meth:`seed`: each member is
        in the room, unless a command projected that user since :meth:`expect_restore` (it is newer than
        the load: they joined another room, or left), or the room closed since (its entry is gone). A
        room's list entry is replaced when the loaded state is newer. No await between the checks and
        the writes. Returns how many rooms it restored; after it, nothing more is remembered.

        One case it cannot tell: a member of two rooms who left one of them since is absent from
        presence until their next command (presence holds one room a user)."""
        touched = self._touched or set()
        self._touched = None
        restored = 0
        for state in states:
            rooms = self._rooms.get(state.app_code, {})
            current = rooms.get(state.room_id)
            if state.status == CLOSED or current is None:
                continue
            if current.version < state.version:
                rooms[state.room_id] = RoomListEntry.of(state)
            for user in state.members:
                if (state.app_code, user) not in touched:
                    self._presence.setdefault((state.app_code, user), state.room_id)
            restored += 1
        return restored

    async def list_rooms(self, app_code: str, *, limit: int) -> list[RoomListEntry]:
        rooms = self._rooms.get(app_code, {}).values()
        ranked = sorted(rooms, key=lambda r: (-r.member_count, -r.heat, r.room_id))
        return ranked[:limit]

    async def room_of(self, app_code: str, user_id: str) -> str | None:
        return self._presence.get((app_code, user_id))
