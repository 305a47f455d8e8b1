"""What is answered before any route is matched: encoded slashes, and the admin token.

- A ``%2F`` in the path would be decoded into a ``/`` before routing, so
  ``/rooms/r1%2Fjoin`` would reach the join route of room ``r1``. No id may
  contain a slash: such a path names no route, ``404 not_found``.
- Under ``/admin`` a request without a valid bearer token is ``401
  unauthorized`` whatever its method and path, so that without a token the
  answers do not tell an existing admin route (405) from a missing one (404).
  The routes check the token again (``require_admin``).
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from roomservice import errors
from roomservice.api.errors import error_response

ADMIN_PREFIX = "/admin"


def token_ok(authorization: str | None, admin_token: str) -> bool:
    """Is ``authorization`` ``Bearer <admin_token>``? (An empty configured token admits nobody.)

    Compared as bytes: ``hmac.compare_digest`` raises TypeError for a str with a non-ASCII
    character, so ``Bearer \xe9t\xe9`` answered 500 instead of 401. ASGI servers and Starlette
    decode header values as latin-1, which encoding undoes exactly (the bytes the client sent);
    the configured token is UTF-8, so a non-ASCII token sent as UTF-8 still matches.
    """
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not admin_token:
        return False
    try:
        given = token.encode("latin-1")
    except UnicodeEncodeError:  # not a decoded header value: no client could have sent it
        return False
    return hmac.compare_digest(given, admin_token.encode())


def _is_admin(path: str) -> bool:
    return path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/")


class Edge:
    def __init__(self, app: ASGIApp, *, admin_token: str) -> None:
        self.app = app
        self.admin_token = admin_token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal: errors.RoomServiceError | None = None
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        if b"%2f" in raw_path.partition(b"?")[0].lower():  # some servers leave the query on raw_path
            refusal = errors.NotFound("no such route (an id never contains '/', encoded or not)")
        elif _is_admin(scope["path"]):
            authorization = None
            for name, value in scope["headers"]:
                if name == b"authorization":
                    authorization = value.decode("latin-1")
                    break
            if not token_ok(authorization, self.admin_token):
                refusal = errors.Unauthorized()
        if refusal is None:
            await self.app(scope, receive, send)
            return
        await error_response(refusal)(scope, receive, send)
