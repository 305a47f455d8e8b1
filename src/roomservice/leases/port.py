"""The lease port: who owns a room's cell right now.

A lease alone is not enough to stop a paused process from writing after it
lost ownership, so every lease comes with a fencing epoch that the store bumps
durably when the lease is taken (``RoomStore.take_lease_epoch``) and that
SaveMutation checks. This module holds the port; ``inprocess`` is the embedded mode's adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from roomservice import errors


class LeaseUnavailable(errors.Retry):
    """Another process holds the room's lease; the command answers ``503 retry``."""


class LeaseBackendUnavailable(errors.Unavailable):
    """The lease store (Redis) did not answer in time: the lease cannot be confirmed, and the
    command answers ``503 unavailable`` (retry with the same command_id). Not a
    :class:`LeaseUnavailable`: nothing says the lease was lost, so the cell is kept until its
    lease could have expired."""


@dataclass(frozen=True, slots=True)
class LeaseOwner:
    """Who holds a room's lease, as the lease value names it (for forwarding a command to it)."""

    owner: str  # the holding process's identity
    address: str  # its internal address, ``host:port``
    token: str


@dataclass(frozen=True, slots=True)
class Lease:
    app_code: str
    room_id: str
    token: str
    expires_at: float  # time.monotonic() deadline; inf for leases that never expire


class LeaseManager(Protocol):
    async def acquire(self, app_code: str, room_id: str) -> Lease:
        """Take the room's lease or raise :class:`LeaseUnavailable`."""
        ...

    async def ensure(self, lease: Lease) -> Lease:
        """Return ``lease`` (renewed if close to expiry) or raise LeaseUnavailable if it was lost."""
        ...

    async def release(self, lease: Lease) -> None:
        """Give the lease up (best effort)."""
        ...
