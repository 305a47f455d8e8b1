"""The one exception tree of the service; every error knows its HTTP status and code.

    RoomServiceError                 status, code, message
    ├── InvalidArgument              400 invalid_argument
    ├── UnknownGift                  400 unknown_gift
    ├── Unauthorized                 401 unauthorized
    ├── InsufficientBalance          402 insufficient_balance
    ├── NotMember                    403 not_member
    ├── NotAllowed                   403 not_allowed
    ├── UserBanned                   403 user_banned
    ├── RoomNotFound                 404 room_not_found
    ├── NotFound                     404 not_found
    ├── MethodNotAllowed             405 method_not_allowed
    ├── RoomExists                   409 room_exists
    ├── SeatTaken                    409 seat_taken
    ├── RoomClosed                   409 room_closed
    ├── CommandIdReused              409 command_id_reused
    ├── TreasureTooEarly             409 too_early        (internal: wake-up before open_at_ms)
    ├── PayloadTooLarge              413 payload_too_large
    ├── Unavailable                  503 unavailable      (a dependency is down; retry is safe)
    └── Retry                        503 retry            (lost a lease or version race; retry is safe)

Domain rule violations (the 4xx codes a ``decide`` call can raise) subclass
:class:`DomainError` as well, so the pure domain can raise them without
knowing about HTTP.
"""

from __future__ import annotations

from typing import ClassVar


class RoomServiceError(Exception):
    status: ClassVar[int] = 500
    code: ClassVar[str] = "internal"
    default_message: ClassVar[str] = "internal error"

    def __init__(self, message: str | None = None) -> None:
        self.message = message or self.default_message
        super().__init__(self.message)

    def to_body(self) -> dict[str, dict[str, str]]:
        return {"error": {"code": self.code, "message": self.message}}


class DomainError(RoomServiceError):
    """A command broke a room rule; nothing was written."""


class InvalidArgument(DomainError):
    status, code, default_message = 400, "invalid_argument", "invalid argument"


class UnknownGift(DomainError):
    status, code, default_message = 400, "unknown_gift", "gift is not in the catalog"


class Unauthorized(RoomServiceError):
    status, code, default_message = 401, "unauthorized", "a valid admin token is required"


class InsufficientBalance(DomainError):
    status, code, default_message = 402, "insufficient_balance", "wallet balance is too low"


class NotMember(DomainError):
    status, code, default_message = 403, "not_member", "user is not a member of the room"


class NotAllowed(DomainError):
    status, code, default_message = 403, "not_allowed", "operation not allowed"


class UserBanned(DomainError):
    status, code, default_message = 403, "user_banned", "user is banned from the room"


class RoomNotFound(DomainError):
    status, code, default_message = 404, "room_not_found", "room not found"


class NotFound(RoomServiceError):
    status, code, default_message = 404, "not_found", "no such route"


class MethodNotAllowed(RoomServiceError):
    status, code, default_message = 405, "method_not_allowed", "method not allowed"


class RoomExists(DomainError):
    status, code, default_message = 409, "room_exists", "room id already used"


class SeatTaken(DomainError):
    status, code, default_message = 409, "seat_taken", "seat is held by another user"


class RoomClosed(DomainError):
    status, code, default_message = 409, "room_closed", "room is closed"


class CommandIdReused(RoomServiceError):
    status, code, default_message = (
        409,
        "command_id_reused",
        "command_id was already used with a different payload",
    )


class TreasureTooEarly(DomainError):
    status, code, default_message = 409, "too_early", "treasure box cannot open yet"

    def __init__(self, open_at_ms: int, message: str | None = None) -> None:
        super().__init__(message)
        self.open_at_ms = open_at_ms


class PayloadTooLarge(RoomServiceError):
    status, code, default_message = 413, "payload_too_large", "request body too large"


class Unavailable(RoomServiceError):
    status, code, default_message = 503, "unavailable", "a dependency is unavailable; retry"


class Retry(RoomServiceError):
    status, code, default_message = 503, "retry", "lost a lease or version race; retry"
