"""The HTTP wallet adapter: the wallet port over a wallet service's REST API.

REST contract (JSON bodies, ``Authorization: Bearer <api_key>`` when a key is
configured; ``{key}`` is one URL path segment, percent-escaped, so keys may
contain ``/``, ``?``, ``#``, spaces or ``:``)::

    POST /v1/debits                      {"key", "app_code", "user_id", "amount"}
        200 {"debit": Debit, "charged": bool}
                                         charged now (true), or the existing debit of this key
                                         (false: same key + same body = same debit); a key
                                         refunded earlier is charged again, net once (true).
                                         Without "charged", a charge is assumed (true)
        402 {"error": {"code": "insufficient_balance"}}   nothing debited
        409 {"error": {"code": "debit_key_conflict"}}     key used for another user/amount
    GET  /v1/debits/{key}
        200 {"debit": Debit} | 404 {"error": {"code": "debit_not_found"}}
    POST /v1/debits/{key}/refund         (idempotent)
        200 {"debit": Debit} (status "refunded") | 404 {"error": {"code": "debit_not_found"}}
    GET  /v1/balances/{app_code}/{user_id}
        200 {"app_code", "user_id", "balance": int}

    Debit = {"key": str, "app_code": str, "user_id": str, "amount": int, "status": "debited" | "refunded"}
    Errors = {"error": {"code": str, "message": str}}

How answers map onto the port's errors:

* 402 → :class:`InsufficientFunds`; 409 ``debit_key_conflict`` on a debit →
  :class:`DebitKeyConflict` (both are definitive: nothing was debited). A debit answered
  with any other status than ``debited`` is not one.
* 404 with code ``debit_not_found`` on lookup/refund → ``None``.
* Everything else is :class:`WalletUnavailable`, which the command path answers
  with ``503 unavailable`` and nothing committed: timeouts (the whole request is
  bounded by ``timeout_s``), connection errors, 5xx, 429, and also 401/403 (a
  wrong or missing ``wallet.api_key``), any other 4xx (a wrong ``wallet.url``
  answers 404 without our error code), and an unreadable or malformed body.
  A misconfigured wallet is an outage of a dependency, not a bug of the request:
  it must answer 503 (retry is safe with the same command_id) rather than 500,
  and the message names the likely cause so the log says what to fix.

The client never retries by itself: a debit is ambiguous after a timeout, and
the caller's retry with the same command_id reuses the same key, so it can
never charge twice.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx

from roomservice.wallet.port import (
    DEBITED,
    REFUNDED,
    Debit,
    DebitKeyConflict,
    InsufficientFunds,
    WalletUnavailable,
)

if TYPE_CHECKING:
    from roomservice.config import WalletConfig

NOT_FOUND_CODE = "debit_not_found"


def _segment(value: str) -> str:
    """One URL path segment: everything but unreserved characters is escaped (``/`` too).

    A segment of only dots is escaped as well, or ``.``/``..`` would be removed
    from the path as dot segments.
    """
    escaped = quote(value, safe="")
    return escaped.replace(".", "%2E") if escaped in (".", "..") else escaped


class HttpWallet:
    """A :class:`~roomservice.wallet.port.Wallet` backed by a remote wallet service."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str = "",
        timeout_s: float,
        transport: httpx.AsyncBaseTransport | None = None,
        max_connections: int = 100,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self._timeout_s = timeout_s
        headers = {"Accept": "application/json", "User-Agent": "room-service-wallet"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            transport=transport,
            follow_redirects=False,
        )

    @classmethod
    def from_config(cls, config: WalletConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> HttpWallet:
        """The adapter for ``wallet.driver: http`` (``wallet.url``, ``wallet.api_key``, ``wallet.timeout``)."""
        return cls(
            config.url,
            api_key=config.api_key.get_secret_value(),
            timeout_s=config.timeout.total_seconds(),
            transport=transport,
        )

    # ------------------------------------------------------------------ port

    async def debit(self, *, key: str, app_code: str, user_id: str, amount: int) -> Debit:
        body = {"key": key, "app_code": app_code, "user_id": user_id, "amount": amount}
        response = await self._request("POST", "/v1/debits", json=body)
        if response.status_code == 402:
            raise InsufficientFunds(f"wallet: balance of {user_id} does not cover {amount}")
        if response.status_code == 409 and _code(response) == "debit_key_conflict":
            raise DebitKeyConflict(key)  # (another 409, say "in progress", is no definitive answer: unavailable)
        data = self._ok_json(response)
        debit = self._debit_of(data)
        if (debit.key, debit.app_code, debit.user_id, debit.amount) != (key, app_code, user_id, amount):
            raise WalletUnavailable(f"wallet answered a debit that does not match the request for key {key!r}")
        if debit.status != DEBITED:  # a debit call answered "refunded": the gift would go unpaid
            raise WalletUnavailable(f"wallet answered a {debit.status} debit for key {key!r}, not a debited one")
        charged = data.get("charged", True)
        if not isinstance(charged, bool):
            raise WalletUnavailable(f"wallet answered a non-boolean 'charged' for key {key!r}")
        return debit if charged else replace(debit, charged=False)

    async def lookup(self, key: str) -> Debit | None:
        response = await self._request("GET", f"/v1/debits/{_segment(key)}")
        return self._debit_or_none(response, key)

    async def refund(self, key: str) -> Debit | None:
        response = await self._request("POST", f"/v1/debits/{_segment(key)}/refund")
        return self._debit_or_none(response, key)

    async def balance(self, app_code: str, user_id: str) -> int:
        response = await self._request("GET", f"/v1/balances/{_segment(app_code)}/{_segment(user_id)}")
        data = self._ok_json(response)
        value = data.get("balance")
        if type(value) is not int:
            raise WalletUnavailable(f"wallet answered a malformed balance: {value!r}")
        return value

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> HttpWallet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ plumbing

    async def _request(self, method: str, path: str, *, json: Any = None) -> httpx.Response:
        """One request bounded by ``timeout_s`` in total; transport trouble is WalletUnavailable."""
        try:
            async with asyncio.timeout(self._timeout_s):
                response = await self._client.request(method, path, json=json)
        except TimeoutError as exc:
            raise WalletUnavailable(f"wallet {method} {path}: no answer within {self._timeout_s}s") from exc
        except httpx.TimeoutException as exc:
            raise WalletUnavailable(f"wallet {method} {path}: timed out ({type(exc).__name__})") from exc
        except httpx.HTTPError as exc:  # connection refused/reset, protocol errors, ...
            raise WalletUnavailable(f"wallet {method} {path}: {type(exc).__name__}: {exc}") from exc
        status = response.status_code
        if status in (401, 403):
            raise WalletUnavailable(
                f"wallet {method} {path}: rejected our credentials ({status} {_code(response)}); check wallet.api_key"
            )
        if status == 429 or status >= 500:
            raise WalletUnavailable(f"wallet {method} {path}: unavailable ({status} {_code(response)})")
        return response

    @staticmethod
    def _ok_json(response: httpx.Response) -> dict[str, Any]:
        request = response.request
        where = f"wallet {request.method} {request.url.path}"
        if response.status_code != 200:
            raise WalletUnavailable(
                f"{where}: unexpected answer {response.status_code} {_code(response)}; check wallet.url"
            )
        try:
            data = response.json()
        except ValueError as exc:
            raise WalletUnavailable(f"{where}: answer is not JSON") from exc
        if not isinstance(data, dict):
            raise WalletUnavailable(f"{where}: answer is not a JSON object")
        return data

    def _debit_or_none(self, response: httpx.Response, key: str) -> Debit | None:
        if response.status_code == 404 and _code(response) == NOT_FOUND_CODE:
            return None
        debit = self._debit_of(self._ok_json(response))
        if debit.key != key:
            raise WalletUnavailable(f"wallet answered debit {debit.key!r} for key {key!r}")
        return debit

    @staticmethod
    def _debit_of(data: dict[str, Any]) -> Debit:
        raw = data.get("debit")
        if not isinstance(raw, dict):
            raise WalletUnavailable("wallet answer has no debit object")
        key, app_code, user_id, amount, status = (
            raw.get("key"),
            raw.get("app_code"),
            raw.get("user_id"),
            raw.get("amount"),
            raw.get("status"),
        )
        if not (
            isinstance(key, str)
            and isinstance(app_code, str)
            and isinstance(user_id, str)
            and type(amount) is int
            and status in (DEBITED, REFUNDED)
        ):
            raise WalletUnavailable(f"wallet answered a malformed debit: {raw!r}")
        assert isinstance(status, str)
        return Debit(key, app_code, user_id, amount, status)


def _code(response: httpx.Response) -> str:
    """The error code of an error answer, or "" when it has none (or is not JSON)."""
    try:
        data = response.json()
    except ValueError:
        return ""
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        code = data["error"].get("code")
        if isinstance(code, str):
            return code
    return ""
