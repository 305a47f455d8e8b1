"""The configurable parts of the room rules, handed to ``decide`` as one value."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Gift:
    id: str
    name: str
    price: int


@dataclass(frozen=True, slots=True)
class RoomRules:
    gifts: dict[str, Gift] = field(default_factory=dict)
    default_seat_count: int = 8
    default_ban_seconds: int = 600
    treasure_levels: tuple[int, ...] = (1000, 5000, 20000)
    treasure_countdown_ms: int = 60_000

    def __post_init__(self) -> None:
        levels = self.treasure_levels
        if any(b <= a for a, b in itertools.pairwise(levels)) or any(x <= 0 for x in levels):
            raise ValueError("treasure levels must be positive and strictly increasing")
