"""Async Tencent IM REST client (httpx).

Every call is ``POST {base_url}/v4/{service}/{command}?sdkappid=&identifier=&usersig=&random=&contenttype=json``
with a JSON body, answered by HTTP 200 and ``{"ActionStatus", "ErrorCode", "ErrorInfo", ...}``
(a business error is still HTTP 200). What the client adds:

* **UserSig** of the admin identifier, generated with TLSSigAPIv2, cached and renewed once
  90% of its lifetime has passed; after an ErrorCode 70001 (expired) it is regenerated at
  once and the request retried one time; a second 70001 is :class:`ImSignatureError`.
* **Errors** classified in :mod:`.errors`: transport failures, timeouts, HTTP 5xx/429 and
  throttling codes are :class:`ImRetryableError`; the rest carries Tencent's code.
* **Rate limit** per API (token bucket, ``rate_limit_per_second``): a request waits for its
  slot, but never past its deadline.
* **Deadlines**: every call — its wait for a rate-limit slot, its request and the one retry
  after a 70001 — is bounded by ``request_timeout`` from its start and, when given, by
  ``deadline`` (event-loop time, ``loop.time()``), whichever comes first.

A transport that can also answer a REST call itself (:class:`DirectCalls`: the IM sandbox's
in-process transport) is called directly with the same path, query and body, skipping
httpx's request and response machinery (URL building and checking, a long UserSig in the
query, headers, cookies, redirects): everything above is the same either way.

Ids: :func:`group_id_for` maps a room to its custom group id, :func:`account_id_for` a
user id to an IM account id, :func:`random_for` an event id to the message ``Random``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, Self, runtime_checkable

import httpx

from roomservice.futures import within
from roomservice.integrations.tencent_im.errors import (
    USERSIG_EXPIRED,
    ImPermanentError,
    ImRetryableError,
    ImSignatureError,
    classify,
)
from roomservice.integrations.tencent_im.ratelimit import RateLimiter, RateLimitExceeded
from roomservice.integrations.tencent_im.usersig import gen_usersig
from roomservice.observability.logging import get_logger

if TYPE_CHECKING:
    from roomservice.config import TencentIMConfig

__all__ = [
    "GROUP_ID_MAX_BYTES",
    "GROUP_NAME_MAX_BYTES",
    "MSG_BODY_MAX_BYTES",
    "USER_ID_MAX_BYTES",
    "C2CMessageResult",
    "DirectCalls",
    "GroupInfo",
    "GroupMessageResult",
    "TencentImClient",
    "account_id_for",
    "group_id_for",
    "random_for",
]

log = get_logger("roomservice.integrations.tencent_im")

GROUP_ID_MAX_BYTES = 48  # custom group ids: printable ASCII, at most 48 bytes, never "@TGS#..."
GROUP_NAME_MAX_BYTES = 30
USER_ID_MAX_BYTES = 32
# Tencent refuses a group or one-to-one message whose body is over 12 KB (send_group_msg 80002, openim/sendmsg
# 93000): the sum of its elements' field lengths, for one TIMCustomElem the UTF-8 bytes of Data + Desc + Ext
MSG_BODY_MAX_BYTES = 12 * 1024
USERSIG_REFRESH_FRACTION = 0.9

LOGIN_SVC = "im_open_login_svc"
GROUP_SVC = "group_open_http_svc"
OPENIM_SVC = "openim"


# --------------------------------------------------------------------------- ids


def _digest(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode("utf-8")).hexdigest()


def group_id_for(app_code: str, room_id: str, *, group_type: str = "AVChatRoom") -> str:
    """The deterministic custom IM group id of room ``(app_code, room_id)``.

    ``room_<app_code>-<room_id>`` when that fits Tencent's 48 bytes. ``app_code`` never
    contains ``-`` (``[a-z0-9_]``), so the first ``-`` splits the two unambiguously (a
    ``_`` separator would not: app ``a_b`` + room ``c`` and app ``a`` + room ``b_c``
    would share ``room_a_b_c``). Longer pairs (app codes up to 32 and room ids up to 48
    characters give up to 86) use ``roomh_<40 hex of sha256(app_code NUL room_id)>``
    (46 bytes); ``roomh`` never starts the short form, so the two forms cannot meet.
    Custom ids must not start with ``@TGS#``, except that Community groups require the
    ``@TGS#_`` prefix, which is then prepended (hashing when needed to stay in 48 bytes).
    """
    prefix = "@TGS#_" if group_type == "Community" else ""
    plain = f"{prefix}room_{app_code}-{room_id}"
    if len(plain.encode("utf-8")) <= GROUP_ID_MAX_BYTES:
        return plain
    return f"{prefix}roomh_{_digest(app_code, room_id)[: 40 - len(prefix)]}"


_HASHED_ACCOUNT = re.compile(r"u_[0-9a-f]{30}")  # the form account_id_for gives a hashed user id


def account_id_for(user_id: str) -> str:
    """The IM account (UserID) of ``user_id``: itself when it fits Tencent's 32 bytes, else
    ``u_`` + 30 hex of its sha256 (our user ids may be 64 characters).

    A short id that has that hashed form itself (``u_`` + 30 lowercase hex) is hashed too: passed
    through, it could be the account of a user with a long id (whose kick notices and bans it would
    then get). So no id passes through as an account a hash can give, and every other short id
    keeps the account it always had."""
    if len(user_id.encode("utf-8")) <= USER_ID_MAX_BYTES and not _HASHED_ACCOUNT.fullmatch(user_id):
        return user_id
    return f"u_{_digest(user_id)[:30]}"


def random_for(key: str) -> int:
    """A 32-bit ``Random``/``MsgRandom`` derived from ``key`` (an event id): a re-send of
    the same event carries the same number, so Tencent's duplicate window absorbs it."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:4], "big")


def _truncate_utf8(text: str, max_bytes: int) -> str:
    raw = text.encode("utf-8")
    if len(raw) <= max_bytes:
        return text
    return raw[:max_bytes].decode("utf-8", errors="ignore")


def _chunks(items: Sequence[str], size: int) -> Iterator[list[str]]:
    for start in range(0, len(items), size):
        yield list(items[start : start + size])


def _check_random(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 0xFFFFFFFF:
        raise ValueError(f"{name} must be a 32-bit unsigned integer")
    return value


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class GroupInfo:
    group_id: str
    error_code: int = 0
    error_info: str = ""
    type: str | None = None
    name: str | None = None
    owner_account: str | None = None
    member_num: int | None = None
    members: tuple[str, ...] = ()
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @property
    def found(self) -> bool:
        return self.error_code == 0


@dataclass(frozen=True, slots=True)
class GroupMessageResult:
    msg_seq: int
    msg_time: int


@dataclass(frozen=True, slots=True)
class C2CMessageResult:
    msg_time: int
    msg_key: str


# --------------------------------------------------------------------------- client


@runtime_checkable
class DirectCalls(Protocol):
    """An httpx transport that also answers ``POST /v4/{service}/{command}`` itself: (status, body).
    Transport failures are raised as httpx's (:class:`httpx.TransportError`)."""

    async def rest_call(
        self, service: str, command: str, query: Mapping[str, str], body: bytes
    ) -> tuple[int, bytes]: ...


@dataclass(slots=True)
class _CachedSig:
    sig: str
    issued_at: float
    ttl_s: int

    def fresh(self, now: float) -> bool:
        return now < self.issued_at + self.ttl_s * USERSIG_REFRESH_FRACTION


class TencentImClient:
    def __init__(
        self,
        *,
        base_url: str,
        sdk_app_id: int,
        admin_identifier: str,
        secret_key: str,
        request_timeout: float = 3.0,
        rate_limit_per_second: float = 200.0,
        rate_limit_burst: float | None = None,
        usersig_ttl: int = 86_400,
        transport: httpx.AsyncBaseTransport | None = None,
        wall_clock: Callable[[], float] = time.time,
        loop_clock: Callable[[], float] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """``wall_clock`` (Unix seconds) dates UserSigs; ``loop_clock`` (default: the event
        loop's ``time()``) is the clock of deadlines and of the rate limiter."""
        if not base_url.startswith(("http://", "https://")):
            raise ValueError("base_url must be an http(s) URL")
        if not secret_key:
            raise ValueError("secret_key must be set")
        if request_timeout <= 0 or usersig_ttl <= 0:
            raise ValueError("request_timeout and usersig_ttl must be > 0")
        self.base_url = base_url.rstrip("/")
        self.sdk_app_id = sdk_app_id
        self.admin_identifier = admin_identifier
        self.request_timeout = float(request_timeout)
        self.usersig_ttl = int(usersig_ttl)
        self._secret_key = secret_key
        self._wall_clock = wall_clock
        self._loop_clock = loop_clock
        self._limiter = RateLimiter(rate_limit_per_second, burst=rate_limit_burst, clock=loop_clock, sleep=sleep)
        self._http = httpx.AsyncClient(transport=transport, timeout=self.request_timeout)
        self._direct = transport if isinstance(transport, DirectCalls) else None
        self._sig: _CachedSig | None = None
        self.usersig_generations = 0

    @classmethod
    def from_config(
        cls,
        config: TencentIMConfig,
        *,
        base_url: str | None = None,
        sdk_app_id: int | None = None,
        secret_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> TencentImClient:
        """A client for ``config``; the overrides serve the in-process sandbox (whose URL,
        app id and key are only known at start-up)."""
        return cls(
            base_url=base_url if base_url is not None else config.base_url,
            sdk_app_id=sdk_app_id if sdk_app_id is not None else config.sdk_app_id,
            admin_identifier=config.admin_identifier,
            secret_key=secret_key if secret_key is not None else config.secret_key.get_secret_value(),
            request_timeout=config.request_timeout.total_seconds(),
            rate_limit_per_second=config.rate_limit_per_second,
            usersig_ttl=int(config.usersig_ttl.total_seconds()),
            transport=transport,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # ----------------------------------------------------------------- plumbing

    def _now(self) -> float:
        return self._loop_clock() if self._loop_clock is not None else asyncio.get_running_loop().time()

    def usersig(self, *, force: bool = False, stale: str | None = None) -> str:
        """The admin UserSig, regenerated when 90% of its lifetime has passed, or when
        ``force`` is set and the cached one is still ``stale`` (the one a 70001 refused;
        a concurrent request may already have replaced it)."""
        now = self._wall_clock()
        cached = self._sig
        if cached is not None and cached.fresh(now) and not (force and (stale is None or cached.sig == stale)):
            return cached.sig
        sig = gen_usersig(self.sdk_app_id, self._secret_key, self.admin_identifier, self.usersig_ttl, int(now))
        self._sig = _CachedSig(sig, now, self.usersig_ttl)
        self.usersig_generations += 1
        return sig

    async def call(
        self, service: str, command: str, body: Mapping[str, Any], *, deadline: float | None = None
    ) -> dict[str, Any]:
        """One REST call; returns the response body (``ActionStatus`` OK) or raises :class:`ImError`."""
        bound = self._now() + self.request_timeout  # the whole call: rate-limit wait, request, 70001 retry
        deadline = bound if deadline is None else min(deadline, bound)
        sig = self.usersig()
        try:
            return await self._send(service, command, body, sig, deadline)
        except ImSignatureError as exc:
            if exc.code != USERSIG_EXPIRED:
                raise
        log.info("im_usersig_refresh", command=command, reason="70001")
        sig = self.usersig(force=True, stale=sig)
        return await self._send(service, command, body, sig, deadline)

    async def _send(
        self, service: str, command: str, body: Mapping[str, Any], sig: str, deadline: float | None
    ) -> dict[str, Any]:
        api = f"{service}/{command}"
        now = self._now()
        if deadline is not None and now >= deadline:
            raise ImRetryableError(f"{api}: deadline passed before sending", command=command)
        try:
            await self._limiter.acquire(api, deadline=deadline if deadline is not None else now + self.request_timeout)
        except RateLimitExceeded as exc:
            raise ImRetryableError(f"{api}: {exc}", command=command) from exc
        timeout = self.request_timeout
        if deadline is not None:
            timeout = min(timeout, deadline - self._now())
            if timeout <= 0:
                raise ImRetryableError(f"{api}: deadline passed while rate limited", command=command)
        params = {
            "sdkappid": str(self.sdk_app_id),
            "identifier": self.admin_identifier,
            "usersig": sig,
            "random": str(secrets.randbits(32)),
            "contenttype": "json",
        }
        content = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        try:
            if self._direct is not None:
                # the in-process sandbox answers without waiting: no timer armed for it (issue 12)
                status, answer = await within(self._direct.rest_call(service, command, params, content), timeout)
            else:
                async with asyncio.timeout(timeout):
                    response = await self._http.post(
                        f"{self.base_url}/v4/{service}/{command}",
                        params=params,
                        content=content,
                        headers={"content-type": "application/json"},
                        timeout=httpx.Timeout(timeout),
                    )
                    status, answer = response.status_code, response.content
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise ImRetryableError(f"{api}: timed out after {timeout:.3f}s", command=command) from exc
        except httpx.UnsupportedProtocol as exc:
            raise ImPermanentError(f"{api}: {exc}", command=command) from exc
        except httpx.TransportError as exc:
            raise ImRetryableError(f"{api}: {type(exc).__name__}: {exc}", command=command) from exc
        return self._read(api, command, status, answer)

    @staticmethod
    def _read(api: str, command: str, status: int, answer: bytes) -> dict[str, Any]:
        # (IM itself answers 200 with an ErrorCode: another status is a proxy's or a gateway's; of those a
        # timeout, "too early" and throttling are worth another try, as a 5xx is)
        if status in (408, 425, 429) or status >= 500:
            raise ImRetryableError(f"{api}: HTTP {status}", command=command, http_status=status)
        if status != 200:
            raise ImPermanentError(f"{api}: HTTP {status}", command=command, http_status=status)
        try:
            data = json.loads(answer)
        except ValueError as exc:
            raise ImRetryableError(f"{api}: response is not JSON", command=command, http_status=status) from exc
        if not isinstance(data, dict):
            raise ImRetryableError(f"{api}: response is not a JSON object", command=command, http_status=status)
        code = data.get("ErrorCode", 0)
        info = str(data.get("ErrorInfo", ""))
        if not isinstance(code, int) or isinstance(code, bool):
            raise ImRetryableError(f"{api}: ErrorCode is not an integer", command=command, http_status=status)
        if code == 0 and data.get("ActionStatus") == "OK":
            return data
        if code == 0:  # FAIL without a code: nothing to classify, assume transient
            raise ImRetryableError(f"{api}: ActionStatus {data.get('ActionStatus')!r}", command=command, info=info)
        error = classify(code, info, command=command)
        error.http_status = status
        raise error

    # ----------------------------------------------------------------- accounts

    async def account_import(
        self, identifier: str, nick: str | None = None, *, face_url: str | None = None, deadline: float | None = None
    ) -> None:
        """Import (or update) one account. Importing an existing account succeeds."""
        body: dict[str, Any] = {"UserID": identifier}
        if nick is not None:
            body["Nick"] = nick
        if face_url is not None:
            body["FaceUrl"] = face_url
        await self.call(LOGIN_SVC, "account_import", body, deadline=deadline)

    async def multiaccount_import(self, identifiers: Sequence[str], *, deadline: float | None = None) -> list[str]:
        """Import accounts (100 per request); returns the ones Tencent refused (``FailAccounts``)."""
        failed: list[str] = []
        for chunk in _chunks(list(dict.fromkeys(identifiers)), 100):
            data = await self.call(LOGIN_SVC, "multiaccount_import", {"Accounts": chunk}, deadline=deadline)
            failed.extend(str(a) for a in data.get("FailAccounts", []) or [])
        return failed

    # ----------------------------------------------------------------- groups

    async def create_group(
        self,
        group_id: str,
        owner: str | None,
        name: str,
        group_type: str,
        *,
        deadline: float | None = None,
    ) -> str:
        """Create a group with a custom id; returns its ``GroupId``. ``owner`` must be an
        imported account (or ``None``: no owner). ``name`` is cut to Tencent's 30 bytes.
        An existing id raises :class:`ImPermanentError` with code 10025 (you own it: usable)
        or 10021 (someone else's; Tencent words "you" as the operator, our admin, so a group of
        ours may get 10021 too: :meth:`get_group_info` tells its type and owner)."""
        body: dict[str, Any] = {
            "Type": group_type,
            "GroupId": group_id,
            "Name": _truncate_utf8(name, GROUP_NAME_MAX_BYTES),
        }
        if owner is not None:
            body["Owner_Account"] = owner
        data = await self.call(GROUP_SVC, "create_group", body, deadline=deadline)
        return str(data.get("GroupId", group_id))

    async def get_group_info(
        self, group_ids: Sequence[str], *, base_fields: Sequence[str] | None = None, deadline: float | None = None
    ) -> list[GroupInfo]:
        """Group details (50 per request); a missing group comes back with ``found`` False.
        ``base_fields`` (e.g. ``("Type", "Owner_Account")``): ask for just those of the group's basic
        information (``ResponseFilter.GroupBaseInfoFilter``) and no member list; ``None``: everything."""
        infos: list[GroupInfo] = []
        for chunk in _chunks(list(group_ids), 50):
            body: dict[str, Any] = {"GroupIdList": chunk}
            if base_fields is not None:
                body["ResponseFilter"] = {"GroupBaseInfoFilter": list(base_fields)}
            data = await self.call(GROUP_SVC, "get_group_info", body, deadline=deadline)
            for item in data.get("GroupInfo", []) or []:
                if not isinstance(item, dict):
                    continue
                members = tuple(
                    str(m.get("Member_Account")) for m in item.get("MemberList", []) or [] if isinstance(m, dict)
                )
                member_num = item.get("MemberNum")
                infos.append(
                    GroupInfo(
                        group_id=str(item.get("GroupId", "")),
                        error_code=int(item.get("ErrorCode", 0) or 0),
                        error_info=str(item.get("ErrorInfo", "")),
                        type=item.get("Type"),
                        name=item.get("Name"),
                        owner_account=item.get("Owner_Account"),
                        member_num=member_num if isinstance(member_num, int) else None,
                        members=members,
                        raw=item,
                    )
                )
        return infos

    async def add_group_member(
        self, group_id: str, members: Sequence[str], *, silence: bool = True, deadline: float | None = None
    ) -> dict[str, int]:
        """Add members (not on AVChatRoom: 10007). Returns ``Result`` per account:
        0 failed, 1 added, 2 already a member."""
        body = {
            "GroupId": group_id,
            "Silence": 1 if silence else 0,
            "MemberList": [{"Member_Account": m} for m in members],
        }
        data = await self.call(GROUP_SVC, "add_group_member", body, deadline=deadline)
        return {
            str(item.get("Member_Account")): int(item.get("Result", 0))
            for item in data.get("MemberList", []) or []
            if isinstance(item, dict)
        }

    async def delete_group_member(
        self,
        group_id: str,
        members: Sequence[str],
        silence: bool = True,
        *,
        reason: str | None = None,
        deadline: float | None = None,
    ) -> None:
        """Remove members (100 per request; not on AVChatRoom: 10004). Absent members are fine."""
        for chunk in _chunks(list(members), 100):
            body: dict[str, Any] = {"GroupId": group_id, "Silence": 1 if silence else 0, "MemberToDel_Account": chunk}
            if reason:
                body["Reason"] = reason
            await self.call(GROUP_SVC, "delete_group_member", body, deadline=deadline)

    async def ban_group_member(
        self,
        group_id: str,
        members: Sequence[str],
        duration_s: int,
        *,
        description: str | None = None,
        deadline: float | None = None,
    ) -> None:
        """Ban members for ``duration_s`` seconds (20 per request): they leave, receive nothing
        and cannot rejoin meanwhile. Needs the feature in the Tencent package (else 10059)."""
        if duration_s <= 0:
            raise ValueError("duration_s must be > 0")
        for chunk in _chunks(list(members), 20):
            body: dict[str, Any] = {"GroupId": group_id, "Members_Account": chunk, "Duration": int(duration_s)}
            if description:
                body["Description"] = description
            await self.call(GROUP_SVC, "ban_group_member", body, deadline=deadline)

    async def forbid_send_msg(
        self, group_id: str, members: Sequence[str], shutup_time_s: int, *, deadline: float | None = None
    ) -> None:
        """Mute members for ``shutup_time_s`` seconds (0 unmutes), 500 per request."""
        if shutup_time_s < 0:
            raise ValueError("shutup_time_s must be >= 0")
        for chunk in _chunks(list(members), 500):
            body = {"GroupId": group_id, "Members_Account": chunk, "ShutUpTime": int(shutup_time_s)}
            await self.call(GROUP_SVC, "forbid_send_msg", body, deadline=deadline)

    async def destroy_group(self, group_id: str, *, deadline: float | None = None) -> None:
        """Dismiss the group; a missing one raises code 10010 (see ``GROUP_NOT_FOUND_CODES``)."""
        await self.call(GROUP_SVC, "destroy_group", {"GroupId": group_id}, deadline=deadline)

    # ----------------------------------------------------------------- messages

    async def send_group_msg(
        self,
        group_id: str,
        data: str,
        *,
        random: int,
        from_account: str | None = None,
        desc: str = "",
        ext: str = "",
        deadline: float | None = None,
    ) -> GroupMessageResult:
        """Send one custom message (``TIMCustomElem`` with ``MsgContent.Data`` = ``data``).
        The same ``random`` from the same sender within 5 minutes is a duplicate Tencent drops.
        A body over :data:`MSG_BODY_MAX_BYTES` is refused for good (80002)."""
        body: dict[str, Any] = {
            "GroupId": group_id,
            "Random": _check_random(random, "random"),
            "MsgBody": [{"MsgType": "TIMCustomElem", "MsgContent": {"Data": data, "Desc": desc, "Ext": ext}}],
        }
        if from_account is not None:
            body["From_Account"] = from_account
        answer = await self.call(GROUP_SVC, "send_group_msg", body, deadline=deadline)
        return GroupMessageResult(msg_seq=int(answer.get("MsgSeq", 0)), msg_time=int(answer.get("MsgTime", 0)))

    async def send_group_system_notification(
        self,
        group_id: str,
        content: str,
        to_members: Sequence[str] | None = None,
        *,
        deadline: float | None = None,
    ) -> None:
        """An online-only system notification; AVChatRoom allows only everyone (no ``to_members``)."""
        body: dict[str, Any] = {"GroupId": group_id, "Content": content}
        if to_members:
            body["ToMembers_Account"] = list(to_members)
        await self.call(GROUP_SVC, "send_group_system_notification", body, deadline=deadline)

    async def send_c2c_msg(
        self,
        to_account: str,
        data: str,
        *,
        random: int,
        msg_seq: int | None = None,
        from_account: str | None = None,
        desc: str = "",
        ext: str = "",
        deadline: float | None = None,
    ) -> C2CMessageResult:
        """A one-to-one custom message (``openim/sendmsg``), not synced to the sender's devices.

        Tencent drops a one-to-one message as a duplicate when sender, ``MsgSeq``, ``MsgRandom``
        and the CRC32 of the body all match one sent in the last 120 seconds. ``MsgSeq`` is
        the caller's to choose; a re-send that must be absorbed passes the same ``msg_seq``
        (and ``random`` and body) as the first try: leaving it out lets Tencent pick one, and
        then nothing matches. A body over :data:`MSG_BODY_MAX_BYTES` is refused for good (93000)."""
        body: dict[str, Any] = {
            "SyncOtherMachine": 2,
            "To_Account": to_account,
            "MsgRandom": _check_random(random, "random"),
            "MsgBody": [{"MsgType": "TIMCustomElem", "MsgContent": {"Data": data, "Desc": desc, "Ext": ext}}],
        }
        if msg_seq is not None:
            body["MsgSeq"] = _check_random(msg_seq, "msg_seq")
        if from_account is not None:
            body["From_Account"] = from_account
        answer = await self.call(OPENIM_SVC, "sendmsg", body, deadline=deadline)
        return C2CMessageResult(msg_time=int(answer.get("MsgTime", 0)), msg_key=str(answer.get("MsgKey", "")))
