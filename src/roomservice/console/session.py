"""Console logins: the admin token checked once, then a signed, expiring session cookie with a CSRF token.

A login (POST of the admin token and the operator's name) is answered with a
cookie ``rs_console`` = ``<payload>.<signature>``: the payload (session id,
operator, expiry) is signed with HMAC-SHA256 under a key derived from the
admin token, so every process sharing the token accepts it, and changing the
token ends every session. The cookie is ``HttpOnly``, ``SameSite=Strict``,
``Path=/console/``, ``Max-Age`` = ``console.session_ttl``, and ``Secure`` when
the console is served over https.

Every POST carries the session's CSRF token (a form field or the
``X-CSRF-Token`` header): an HMAC of the session id, compared in constant
time, so a page of another site can neither read it nor forge it. The login
form itself is protected by a double-submit nonce (cookie ``rs_console_login``
and a form field). Logging out revokes the session id in this process (and
drops the cookie); the token is never put in a URL, a cookie or a log line.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

COOKIE: Final = "rs_console"
LOGIN_COOKIE: Final = "rs_console_login"
COOKIE_PATH: Final = "/console/"
CSRF_FIELD: Final = "csrf_token"
CSRF_HEADER: Final = "x-csrf-token"
OPERATOR_MAX: Final = 48  # audit actors are "console:<name>", 64 characters at most
_KEY_LABEL: Final = b"roomservice console session v1"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def valid_operator(name: str) -> str | None:
    """The operator's name as audited (stripped), or None when it is empty, too long or not printable."""
    name = name.strip()
    if not 1 <= len(name) <= OPERATOR_MAX or not name.isprintable():
        return None
    return name


@dataclass(frozen=True, slots=True)
class ConsoleSession:
    session_id: str
    operator: str
    expires_at: float  # epoch seconds
    csrf_token: str

    @property
    def actor(self) -> str:
        """The name audit rows carry for this operator's actions."""
        return f"console:{self.operator}"


class Sessions:
    """Issues and checks console sessions for one admin token (an empty token admits nobody)."""

    def __init__(self, admin_token: str, *, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        self._admin_token = admin_token.encode()
        self._key = hmac.new(self._admin_token, _KEY_LABEL, hashlib.sha256).digest()
        self.ttl_s = ttl_s
        self.clock = clock
        self._revoked: dict[str, float] = {}  # session id -> its expiry (forgotten after it)

    def token_ok(self, given: str) -> bool:
        """Is ``given`` the admin token? Constant time; an empty configured token admits nobody."""
        return bool(self._admin_token) and hmac.compare_digest(given.encode(), self._admin_token)

    def issue(self, operator: str) -> tuple[str, ConsoleSession]:
        """A new session for ``operator``: (cookie value, session)."""
        session_id = secrets.token_urlsafe(18)
        expires_at = self.clock() + self.ttl_s
        payload = _b64(json.dumps({"sid": session_id, "op": operator, "exp": expires_at}).encode())
        value = f"{payload}.{self._sign(payload)}"
        return value, ConsoleSession(session_id, operator, expires_at, self._csrf(session_id))

    def read(self, cookie: str | None) -> ConsoleSession | None:
        """The session a cookie value names, if it is signed by us, unexpired and not revoked."""
        if not cookie or cookie.count(".") != 1 or len(cookie) > 2048:
            return None
        if not cookie.isascii():  # ours never holds anything else (and compare_digest refuses non-ASCII str)
            return None
        payload, signature = cookie.split(".")
        if not hmac.compare_digest(signature, self._sign(payload)):
            return None
        try:
            data = json.loads(_unb64(payload))
            session_id, operator, expires_at = str(data["sid"]), str(data["op"]), float(data["exp"])
        except (ValueError, KeyError, TypeError):
            return None
        now = self.clock()
        if expires_at <= now or session_id in self._revoked:
            return None
        return ConsoleSession(session_id, operator, expires_at, self._csrf(session_id))

    def csrf_ok(self, session: ConsoleSession, given: str | None) -> bool:
        return bool(given) and hmac.compare_digest((given or "").encode(), session.csrf_token.encode())

    def revoke(self, session: ConsoleSession) -> None:
        now = self.clock()
        self._revoked = {sid: exp for sid, exp in self._revoked.items() if exp > now}
        self._revoked[session.session_id] = session.expires_at

    @staticmethod
    def login_nonce() -> str:
        return secrets.token_urlsafe(18)

    @staticmethod
    def login_nonce_ok(cookie: str | None, field: str | None) -> bool:
        return bool(cookie) and bool(field) and hmac.compare_digest((cookie or "").encode(), (field or "").encode())

    def _sign(self, payload: str) -> str:
        return _b64(hmac.new(self._key, b"session:" + payload.encode(), hashlib.sha256).digest())

    def _csrf(self, session_id: str) -> str:
        return _b64(hmac.new(self._key, b"csrf:" + session_id.encode(), hashlib.sha256).digest())
