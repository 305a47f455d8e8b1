"""The one exception tree of the service: every error has a ``code`` and says whether it is ``retryable``.

    RoomServiceError                     code, retryable, message
    ├── DomainError                      a command broke a room rule; nothing was written
    │   ├── InvalidArgument              invalid_argument
    │   ├── UnknownGift                  unknown_gift
    │   ├── InsufficientBalance          insufficient_balance
    │   ├── NotMember                    not_member
    │   ├── NotAllowed                   not_allowed
    │   ├── UserBanned                   user_banned
    │   ├── RoomNotFound                 room_not_found
    │   ├── RoomExists                   room_exists
    │   ├── SeatTaken                    seat_taken
    │   ├── RoomClosed                   room_closed
    │   └── TreasureTooEarly             too_early        (internal: wake-up before open_at_ms; retryable)
    ├── CommandIdReused                  command_id_reused
    ├── RequestError                     the request itself is wrong (the entrypoints raise these)
    │   ├── Unauthorized                 unauthorized
    │   ├── NotFound                     not_found
    │   ├── MethodNotAllowed             method_not_allowed
    │   └── PayloadTooLarge              payload_too_large
    ├── Unavailable                      unavailable      a dependency is down; retryable
    │   ├── StoreUnavailable             (store.port)     the database did not answer; a write's outcome is unknown
    │   ├── WalletUnavailable            (wallet.port)    the wallet did not answer; the debit may have happened
    │   └── LeaseBackendUnavailable      (leases.port)    Redis did not answer: the room's lease cannot be confirmed
    ├── Retry                            retry            lost a lease or version race; retryable
    │   ├── StoreConflict                (store.port)     SaveMutation's guard did not match
    │   │   └── CommandIdTaken           (store.port)     another writer logged the command_id first
    │   └── LeaseUnavailable             (leases.port)    another process holds the room, or the lease was lost
    ├── WalletError                      (wallet.port)    InsufficientFunds, DebitKeyConflict: definitive answers
    └── PublishError                     (publishers.port) a delivery target did not take an event
        ├── RetryableError               publish_retryable  timeout, outage, throttling: retry with backoff
        └── PermanentError               publish_rejected   it never will: dead letter now

Nothing here knows about HTTP: ``roomservice.api.errors`` maps codes to status
codes, and the gRPC API will map them to gRPC statuses. Client errors of an
integration (``ImError`` of the Tencent IM client, with Tencent's numeric
codes) are translated into this tree at the adapter that uses them.
"""

from __future__ import annotations

from typing import Any, ClassVar


class RoomServiceError(Exception):
    code: ClassVar[str] = "internal"
    retryable: ClassVar[bool] = False
    default_message: ClassVar[str] = "internal error"

    def __init__(self, message: str | None = None) -> None:
        self.message = message or self.default_message
        super().__init__(self.message)

    def to_body(self) -> dict[str, Any]:
        """The one error shape of SPEC §8; a subclass may add keys beside ``error``, never inside it."""
        return {"error": {"code": self.code, "message": self.message}}


class DomainError(RoomServiceError):
    """A command broke a room rule; nothing was written."""


class InvalidArgument(DomainError):
    code, default_message = "invalid_argument", "invalid argument"


class UnknownGift(DomainError):
    code, default_message = "unknown_gift", "gift is not in the catalog"


class InsufficientBalance(DomainError):
    code, default_message = "insufficient_balance", "wallet balance is too low"


class NotMember(DomainError):
    code, default_message = "not_member", "user is not a member of the room"


class NotAllowed(DomainError):
    code, default_message = "not_allowed", "operation not allowed"


class UserBanned(DomainError):
    code, default_message = "user_banned", "user is banned from the room"


class RoomNotFound(DomainError):
    code, default_message = "room_not_found", "room not found"


class RoomExists(DomainError):
    code, default_message = "room_exists", "room id already used"


class SeatTaken(DomainError):
    code, default_message = "seat_taken", "seat is held by another user"


class RoomClosed(DomainError):
    code, default_message = "room_closed", "room is closed"


class TreasureTooEarly(DomainError):
    code, default_message = "too_early", "treasure box cannot open yet"
    retryable = True  # the wake-up path retries at open_at_ms

    def __init__(self, open_at_ms: int, message: str | None = None) -> None:
        super().__init__(message)
        self.open_at_ms = open_at_ms


class CommandIdReused(RoomServiceError):
    code, default_message = "command_id_reused", "command_id was already used with a different payload"


class RequestError(RoomServiceError):
    """The request itself is wrong: raised by the entrypoints, never by the domain."""


class Unauthorized(RequestError):
    code, default_message = "unauthorized", "a valid admin token is required"


class NotFound(RequestError):
    code, default_message = "not_found", "no such route"


class MethodNotAllowed(RequestError):
    code, default_message = "method_not_allowed", "method not allowed"


class PayloadTooLarge(RequestError):
    code, default_message = "payload_too_large", "request body too large"


class Unavailable(RoomServiceError):
    code, default_message = "unavailable", "a dependency is unavailable; retry"
    retryable = True


class Retry(RoomServiceError):
    code, default_message = "retry", "lost a lease or version race; retry"
    retryable = True
