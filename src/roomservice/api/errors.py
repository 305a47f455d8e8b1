"""The HTTP face of the error tree: which status code each error code answers with (SPEC §8)."""

from __future__ import annotations

from typing import Final

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from roomservice import errors

HTTP_STATUS: Final[dict[str, int]] = {
    "invalid_argument": 400,
    "unknown_gift": 400,
    "unauthorized": 401,
    "insufficient_balance": 402,
    "not_member": 403,
    "not_allowed": 403,
    "user_banned": 403,
    "room_not_found": 404,
    "not_found": 404,
    "method_not_allowed": 405,
    "room_exists": 409,
    "seat_taken": 409,
    "room_closed": 409,
    "command_id_reused": 409,
    "too_early": 409,
    "payload_too_large": 413,
    "unavailable": 503,
    "retry": 503,
}


def http_status(exc: errors.RoomServiceError) -> int:
    """The status for ``exc``: by its code; anything else retryable is 503, the rest 500."""
    status = HTTP_STATUS.get(exc.code)
    if status is not None:
        return status
    return 503 if exc.retryable else 500


def error_response(exc: errors.RoomServiceError, *, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(exc.to_body(), status_code=http_status(exc), headers=headers)


def from_http_exception(exc: HTTPException) -> errors.RoomServiceError:
    """The error of the tree that a Starlette/FastAPI HTTPException (routing, body parsing) stands for."""
    if exc.status_code == 404:
        return errors.NotFound()
    if exc.status_code == 405:
        return errors.MethodNotAllowed()
    if exc.status_code == 413:
        return errors.PayloadTooLarge()
    if exc.status_code == 401:
        return errors.Unauthorized()
    return errors.InvalidArgument(str(exc.detail))
