"""State and request handling of the IM sandbox (no network I/O: the ASGI app in
:mod:`.app` feeds it requests; tests may also drive it directly). The state is in memory;
given a :class:`~.journal.SandboxJournal` it is also kept on disk and survives a restart
(see :mod:`.journal`).

It speaks the Tencent IM REST subset room-service uses, with Tencent's documented
semantics where they matter to us:

* every request is checked like Tencent does: ``sdkappid`` (60006/60012), ``identifier``
  and ``usersig`` present (60004), the UserSig verified with the app's key (expired 70001,
  undecodable 70003, bad signature 70009, other identifier 70013, other app 70014), the
  identifier an app admin (60010); then the per-API rate limit (60007) and the JSON body (60003);
* accounts must be imported before they own a group, send or receive (group APIs 10019,
  ``openim`` 20003); UserIDs are at most 32 bytes (70402);
* ``create_group``: custom ids are printable ASCII, at most 48 bytes, never ``@TGS#...``
  (Community: always ``@TGS#_...``); names at most 30 bytes; an existing id answers 10025
  when the requested owner owns it (usable as is) and 10021 otherwise — or 10021 either way
  with ``owned_group_answers_10021`` set (Tencent words 10025 for the *operator*, the app
  admin here, so the real one may answer 10021 for a group we made); an AVChatRoom takes
  no initial members (10007), and its owner is not a member (members join through the SDK);
* ``get_group_info``: every basic field and the member list (not for an AVChatRoom), or with
  a ``ResponseFilter`` just the basic fields of its ``GroupBaseInfoFilter``, and members only
  when it has a ``MemberInfoFilter``;
* AVChatRoom: ``add_group_member`` 10007, ``delete_group_member`` 10004 (ban or mute
  instead), system notifications only to everyone (10004);
* ``send_group_msg``: per-group ``MsgSeq`` from 1; the same ``Random`` from the same sender
  within 5 minutes is a duplicate: answered like the original (same MsgSeq), stored once;
  a muted sender gets 10017;
* a message body over 12 KB (:data:`MSG_BODY_MAX_BYTES`, counted as Tencent describes it: the
  sum of the lengths of its elements' fields, for a custom element the UTF-8 bytes of Data,
  Desc and Ext) is refused for good: ``send_group_msg`` 80002, ``openim/sendmsg`` 93000;
* ``openim/sendmsg``: duplicates are (sender, MsgSeq, MsgRandom, CRC32 of the body) within
  120 seconds, as Tencent documents for one-to-one messages (not the group's 5 minutes),
  answered like the original (same MsgTime and MsgKey) and stored once; a request without
  ``MsgSeq`` gets one from the backend (Tencent fills in a random number; here a number
  derived from the message counter, so a replay of the journal gives the same), so it
  never matches an earlier one; both accounts must be imported (20003);
* a missing or dismissed group answers 10010 (``get_group_info`` reports it per group);
  :meth:`SandboxState.dismiss_group` dismisses one the way Tencent may (console, inactivity).

Codes for malformed requests (10004 group APIs, 70402 account APIs, 90001/90002 openim)
follow Tencent's tables as closely as they are documented; nothing here depends on them.

The clock (``clock``, default :func:`time.time`, plus an adjustable offset) dates
messages, bans and UserSig checks; rate limiting uses the monotonic clock.
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeGuard

from roomservice.integrations.im_sandbox.journal import SandboxJournal
from roomservice.integrations.tencent_im.ratelimit import TokenBucket
from roomservice.integrations.tencent_im.usersig import SignedFor, UserSigError, check_usersig

__all__ = ["GROUP_TYPES", "OutageMode", "SandboxReply", "SandboxState"]

OutageMode = Literal["http_503", "reset"]
GROUP_TYPES = frozenset({"Private", "Public", "ChatRoom", "AVChatRoom", "Community", "Work", "Meeting"})
GROUP_DUPLICATE_WINDOW_S = 300.0
C2C_DUPLICATE_WINDOW_S = 120.0
MSG_BODY_MAX_BYTES = 12 * 1024
# the codes of a body over that, from Tencent's error code tables: 80002 (ERR_SVR_COMM_BODY_SIZE_LIMIT, "the
# message packet exceeds the length limit of 12 KB") for group messages, 93000 (ERR_SVR_MSG_BODY_SIZE_LIMIT,
# "the JSON packet exceeds 12 KB") for one-to-one messages
GROUP_MSG_TOO_LONG = 80002
C2C_MSG_TOO_LONG = 93000
_USERSIG_CODES = {"expired": 70001, "malformed": 70003, "bad_signature": 70009, "wrong_app": 70014}
_READ_ONLY = frozenset({("group_open_http_svc", "get_group_info")})  # every other handled call changes state
_CONTROL = "_sandbox"  # journal rows of controls that change state (service name no REST path has)


class _Fail(Exception):
    def __init__(self, code: int, info: str) -> None:
        super().__init__(info)
        self.code = code
        self.info = info


@dataclass(frozen=True, slots=True)
class SandboxReply:
    status: int
    body: dict[str, Any]


@dataclass(slots=True)
class Account:
    user_id: str
    nick: str | None
    face_url: str | None
    imported_at: float

    def to_json(self) -> dict[str, Any]:
        return {"user_id": self.user_id, "nick": self.nick, "face_url": self.face_url, "imported_at": self.imported_at}


def custom_data(msg_body: list[dict[str, Any]]) -> str | None:
    """``MsgContent.Data`` of a message body's first custom element (``TIMCustomElem``), if any."""
    for elem in msg_body:
        if elem.get("MsgType") == "TIMCustomElem":
            value = elem.get("MsgContent", {}).get("Data")
            return value if isinstance(value, str) else None
    return None


@dataclass(slots=True)
class GroupMessage:
    msg_seq: int
    random: int
    from_account: str
    time: int
    msg_body: list[dict[str, Any]]
    sent_at: float

    @property
    def data(self) -> str | None:
        """``MsgContent.Data`` of the first custom element, if any."""
        return custom_data(self.msg_body)

    def to_json(self) -> dict[str, Any]:
        return {
            "msg_seq": self.msg_seq,
            "random": self.random,
            "from_account": self.from_account,
            "time": self.time,
            "data": self.data,
            "msg_body": self.msg_body,
        }


@dataclass(slots=True)
class C2CMessage:
    from_account: str
    to_account: str
    msg_random: int
    msg_seq: int
    time: int
    msg_key: str
    msg_body: list[dict[str, Any]]
    sent_at: float

    @property
    def data(self) -> str | None:
        """``MsgContent.Data`` of the first custom element, if any."""
        return custom_data(self.msg_body)

    def to_json(self) -> dict[str, Any]:
        return {
            "from_account": self.from_account,
            "to_account": self.to_account,
            "msg_random": self.msg_random,
            "msg_seq": self.msg_seq,
            "time": self.time,
            "msg_key": self.msg_key,
            "data": self.data,
            "msg_body": self.msg_body,
        }


@dataclass(slots=True)
class Group:
    group_id: str
    type: str
    name: str
    owner: str | None
    created_at: float
    members: dict[str, float] = field(default_factory=dict)  # account -> join time
    banned: dict[str, float] = field(default_factory=dict)  # account -> banned until
    muted: dict[str, float] = field(default_factory=dict)  # account -> muted until
    messages: list[GroupMessage] = field(default_factory=list)
    notifications: list[dict[str, Any]] = field(default_factory=list)
    next_seq: int = 1
    duplicates_absorbed: int = 0
    recent: dict[tuple[str, int], GroupMessage] = field(default_factory=dict)  # (sender, Random)
    destroyed_at: float | None = None

    def to_json(self, now: float) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "type": self.type,
            "name": self.name,
            "owner": self.owner,
            "created_at": self.created_at,
            "members": list(self.members),
            "banned": {m: until for m, until in self.banned.items() if until > now},
            "muted": {m: until for m, until in self.muted.items() if until > now},
            "message_count": len(self.messages),
            "notification_count": len(self.notifications),
            "duplicates_absorbed": self.duplicates_absorbed,
            "destroyed": self.destroyed_at is not None,
            "destroyed_at": self.destroyed_at,
        }


@dataclass(slots=True)
class InjectedError:
    command: str
    code: int
    info: str
    remaining: int | None  # None: until cleared
    service: str | None = None

    def matches(self, service: str, command: str) -> bool:
        return self.command in (command, "*") and self.service in (None, service)

    def to_json(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "service": self.service,
            "code": self.code,
            "info": self.info,
            "remaining": self.remaining,
        }


@dataclass(frozen=True, slots=True)
class RequestRecord:
    at: float  # sandbox clock
    monotonic: float
    service: str
    command: str
    identifier: str
    http_status: int
    error_code: int

    def to_json(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "monotonic": self.monotonic,
            "service": self.service,
            "command": self.command,
            "identifier": self.identifier,
            "http_status": self.http_status,
            "error_code": self.error_code,
        }


def _is_uint32(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 0xFFFFFFFF


def _printable_ascii(text: str) -> bool:
    return all(0x20 <= ord(c) <= 0x7E for c in text)


def _str_list(value: object, *, code: int, what: str, max_len: int) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise _Fail(code, f"{what} must be a non-empty list of UserIDs")
    if len(value) > max_len:
        raise _Fail(code, f"{what} takes at most {max_len} accounts")
    return list(dict.fromkeys(value))


def _msg_body(value: object, code: int) -> list[dict[str, Any]]:
    if (
        not isinstance(value, list)
        or not value
        or not all(
            isinstance(e, dict) and isinstance(e.get("MsgType"), str) and isinstance(e.get("MsgContent"), dict)
            for e in value
        )
    ):
        raise _Fail(code, "MsgBody must be a non-empty list of {MsgType, MsgContent} elements")
    return value


def msg_body_bytes(msg_body: list[dict[str, Any]]) -> int:
    """The length Tencent holds against :data:`MSG_BODY_MAX_BYTES`: the sum over the elements of
    their ``MsgContent`` fields, a text field as its UTF-8 bytes, any other as its JSON text."""
    total = 0
    for elem in msg_body:
        for value in elem["MsgContent"].values():
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"))
            total += len(text.encode("utf-8"))
    return total


def _check_size(msg_body: list[dict[str, Any]], code: int) -> None:
    size = msg_body_bytes(msg_body)
    if size > MSG_BODY_MAX_BYTES:
        raise _Fail(code, f"message body is {size} bytes, over the {MSG_BODY_MAX_BYTES} bytes a message may have")


class SandboxState:
    """One IM app (``sdk_app_id`` + ``secret_key``) with its accounts, groups, messages,
    injected faults and request log."""

    def __init__(
        self,
        sdk_app_id: int,
        secret_key: str,
        *,
        admin_identifiers: Iterable[str] = ("administrator",),
        rate_limit_per_second: float | None = 200.0,
        clock: Callable[[], float] = time.time,
        max_log: int = 100_000,
        journal: SandboxJournal | None = None,
    ) -> None:
        """``journal``: keep the state there too (replayed now, appended to per change)."""
        self.sdk_app_id = sdk_app_id
        self.secret_key = secret_key
        self.admin_identifiers = frozenset(admin_identifiers)
        self.rate_limit_per_second = rate_limit_per_second
        self.max_log = max_log
        self._clock = clock
        self.clock_offset = 0.0
        self.stopping = asyncio.Event()  # set while the server shuts down: injected latency ends early
        self._pinned_now: float | None = None  # the clock while one call is handled or replayed
        self.journal = journal
        self.journal_error: str | None = None  # the last failure to write the journal, if any
        self.replayed = 0
        self.replay_failures = 0
        # the last UserSig whose signature checked out, with its app and key: a client sends the same
        # one until it renews it, and checking it (base64, zlib, JSON, HMAC) cost more than most calls
        self._signed: tuple[str, int, str, SignedFor] | None = None
        self._forget()
        if journal is not None:
            self._replay(journal)

    # ----------------------------------------------------------------- control

    def reset(self) -> None:
        """Forget all accounts, groups, messages, faults and the request log (on disk too)."""
        if self.journal is not None:
            self.journal.clear()
        self._forget()

    def _forget(self) -> None:
        self.accounts: dict[str, Account] = {}
        self.groups: dict[str, Group] = {}
        self.destroyed: list[Group] = []
        self.c2c: list[C2CMessage] = []
        self._c2c_recent: dict[tuple[str, int, int, int], C2CMessage] = {}
        self.c2c_duplicates_absorbed = 0
        self.requests: list[RequestRecord] = []
        self.outage: OutageMode | None = None
        self.errors: list[InjectedError] = []
        self.latency_s: dict[str, float] = {}  # command (or "*") -> seconds
        self.usersig_expiry_remaining = 0
        self.ban_enabled = True
        self.owned_group_answers_10021 = False  # create_group of an existing id the owner owns: 10021, not 10025
        self.lost_answers: dict[str, int] = {}  # command -> how many of its next calls apply, then answer 503
        self._buckets: dict[str, TokenBucket] = {}
        self._group_counter = 0
        self._c2c_counter = 0

    def now(self) -> float:
        if self._pinned_now is not None:
            return self._pinned_now
        return self._clock() + self.clock_offset

    def advance_clock(self, seconds: float) -> float:
        self.clock_offset += seconds
        return self.now()

    def set_outage(self, mode: OutageMode | None) -> None:
        """``http_503``: every REST call answers HTTP 503; ``reset``: the connection is
        closed before a complete answer; ``None``: healthy. The control API stays up."""
        if mode not in (None, "http_503", "reset"):
            raise ValueError("outage mode must be http_503, reset or None")
        self.outage = mode

    def inject_error(
        self, command: str, code: int, info: str = "", *, count: int | None = None, service: str | None = None
    ) -> InjectedError:
        """Answer ``code`` to the next ``count`` calls of ``command`` (``*``: any; ``None``
        count: until cleared). Applied after the signature check and rate limit."""
        if count is not None and count <= 0:
            raise ValueError("count must be > 0 or None")
        injected = InjectedError(command, int(code), info or f"injected error {code}", count, service)
        self.errors.append(injected)
        return injected

    def lose_answers(self, command: str, count: int = 1) -> None:
        """The next ``count`` calls of ``command`` are applied, then answered HTTP 503, as when Tencent did
        the work and its answer was lost on the way (the caller cannot tell it from a refused call)."""
        if count <= 0:
            raise ValueError("count must be > 0")
        self.lost_answers[command] = count

    def answer_lost(self, command: str) -> bool:
        """Whether the answer of this call of ``command`` (already applied) is to be lost."""
        left = self.lost_answers.get(command, 0)
        if left <= 0:
            return False
        if left == 1:
            del self.lost_answers[command]
        else:
            self.lost_answers[command] = left - 1
        return True

    def clear_errors(self, command: str | None = None) -> None:
        self.errors = [e for e in self.errors if command is not None and e.command != command]

    def set_latency(self, seconds: float, command: str | None = None) -> None:
        """Delay answers to ``command`` (or every command) by ``seconds``; 0 removes it."""
        key = command or "*"
        if seconds > 0:
            self.latency_s[key] = float(seconds)
        else:
            self.latency_s.pop(key, None)

    def clear_latency(self) -> None:
        self.latency_s.clear()

    def latency_for(self, command: str) -> float:
        return self.latency_s.get(command, self.latency_s.get("*", 0.0))

    def force_usersig_expiry(self, count: int) -> None:
        """Answer 70001 (UserSig expired) to the next ``count`` calls, whatever the sig."""
        self.usersig_expiry_remaining = max(0, int(count))

    def set_rate_limit(self, per_second: float | None) -> None:
        self.rate_limit_per_second = per_second
        self._buckets.clear()

    def dismiss_group(self, group_id: str) -> Group:
        """Dismiss a live group as Tencent may do on its own (from the console, or an idle
        AVChatRoom): it is gone for every API (10010), as after ``destroy_group``.
        Raises ``KeyError`` when there is no such live group."""
        if group_id not in self.groups:
            raise KeyError(f"no live group {group_id}")
        self._apply(_CONTROL, "dismiss_group", "", {"GroupId": group_id})
        return self.destroyed[-1]

    def _dismiss(self, req: dict[str, Any], _identifier: str) -> dict[str, Any]:
        return self._destroy_group(req, _identifier)

    # ----------------------------------------------------------------- views

    def group(self, group_id: str) -> Group | None:
        """The live group, else the most recently destroyed one with that id."""
        live = self.groups.get(group_id)
        if live is not None:
            return live
        for group in reversed(self.destroyed):
            if group.group_id == group_id:
                return group
        return None

    def messages(self, group_id: str) -> list[GroupMessage]:
        group = self.group(group_id)
        return list(group.messages) if group is not None else []

    def c2c_messages(self, to_account: str | None = None) -> list[C2CMessage]:
        return [m for m in self.c2c if to_account is None or m.to_account == to_account]

    def request_counts(self, *, errors_only: bool = False) -> dict[str, int]:
        return dict(
            Counter(r.command for r in self.requests if not errors_only or r.error_code != 0 or r.http_status != 200)
        )

    def summary(self) -> dict[str, Any]:
        now = self.now()
        return {
            "sdk_app_id": self.sdk_app_id,
            "admin_identifiers": sorted(self.admin_identifiers),
            "now": now,
            "accounts": len(self.accounts),
            "groups": [g.to_json(now) for g in self.groups.values()],
            "destroyed_groups": [g.to_json(now) for g in self.destroyed],
            "c2c_messages": len(self.c2c),
            "c2c_duplicates_absorbed": self.c2c_duplicates_absorbed,
            "persistence": self.persistence(),
            "faults": self.faults(),
            "request_counts": self.request_counts(),
        }

    def persistence(self) -> dict[str, Any]:
        """Where the state is kept: ``path`` None means memory only (lost when the process ends)."""
        return {
            "path": None if self.journal is None else str(self.journal.path),
            "replayed": self.replayed,
            "replay_failures": self.replay_failures,
            "error": self.journal_error,
        }

    def faults(self) -> dict[str, Any]:
        return {
            "outage": self.outage,
            "errors": [e.to_json() for e in self.errors],
            "latency_s": dict(self.latency_s),
            "usersig_expiry_remaining": self.usersig_expiry_remaining,
            "rate_limit_per_second": self.rate_limit_per_second,
            "ban_enabled": self.ban_enabled,
            "owned_group_answers_10021": self.owned_group_answers_10021,
            "lost_answers": dict(self.lost_answers),
            "clock_offset": self.clock_offset,
        }

    # ----------------------------------------------------------------- requests

    def record(self, service: str, command: str, identifier: str, http_status: int, error_code: int) -> None:
        self.requests.append(
            RequestRecord(self.now(), time.monotonic(), service, command, identifier, http_status, error_code)
        )
        if len(self.requests) > self.max_log:
            del self.requests[: len(self.requests) - self.max_log]

    def handle(self, service: str, command: str, query: Mapping[str, str], body: bytes) -> SandboxReply:
        """Answer one REST request (outage and latency are the transport's business)."""
        identifier = query.get("identifier", "")
        try:
            self._authenticate(query)
            self._throttle(service, command)
            self._injected(service, command)
            try:
                request = json.loads(body or b"{}")
            except (ValueError, UnicodeDecodeError, RecursionError) as exc:
                raise _Fail(60003, f"request body is not JSON: {exc}") from exc
            if not isinstance(request, dict):
                raise _Fail(60003, "request body must be a JSON object")
            if (service, command) not in self._handlers():
                raise _Fail(60009, f"no such API: {service}/{command}")
            result = self._apply(service, command, identifier, request)
        except _Fail as fail:
            self.record(service, command, identifier, 200, fail.code)
            return SandboxReply(200, {"ActionStatus": "FAIL", "ErrorCode": fail.code, "ErrorInfo": fail.info})
        self.record(service, command, identifier, 200, 0)
        return SandboxReply(200, {"ActionStatus": "OK", "ErrorCode": 0, "ErrorInfo": "", **result})

    def _apply(self, service: str, command: str, identifier: str, request: dict[str, Any]) -> dict[str, Any]:
        """Run one handler with the clock pinned; journal the call if it changed the state."""
        key = (service, command)
        handler = self._handlers()[key] if service != _CONTROL else self._controls()[command]
        self._pinned_now = at = self.now()
        try:
            result = handler(request, identifier)
        finally:
            self._pinned_now = None
        if self.journal is not None and key not in _READ_ONLY:
            try:
                self.journal.append(at, service, command, identifier, request)
            except Exception as exc:  # disk full, file removed...: the change would not survive a restart
                self.journal_error = f"{type(exc).__name__}: {exc}"
                raise _Fail(10002, f"internal error: the sandbox could not save its state ({exc})") from exc
            self.journal_error = None
        return result

    def _replay(self, journal: SandboxJournal) -> None:
        """Rebuild the state from the journal: every row through its handler, at its time."""
        handlers, controls = self._handlers(), self._controls()
        for entry in journal.entries():
            key = (entry.service, entry.command)
            handler = controls.get(entry.command) if entry.service == _CONTROL else handlers.get(key)
            self._pinned_now = entry.at
            try:
                if handler is None:
                    raise _Fail(60009, f"no such API: {entry.service}/{entry.command}")
                handler(entry.request, entry.identifier)
                self.replayed += 1
            except _Fail:  # answered OK once, refused now: the handlers changed since (counted, shown in summary)
                self.replay_failures += 1
            finally:
                self._pinned_now = None

    def _authenticate(self, query: Mapping[str, str]) -> None:
        app = query.get("sdkappid")
        if not app:
            raise _Fail(60012, "sdkappid is required")
        if not app.isdigit() or int(app) != self.sdk_app_id:
            raise _Fail(60006, f"unknown sdkappid {app}")
        identifier, sig = query.get("identifier", ""), query.get("usersig", "")
        if not identifier or not sig:
            raise _Fail(60004, "identifier and usersig are required")
        try:
            signed_for = self._checked(sig).valid_at(int(self.now()))
        except UserSigError as exc:
            raise _Fail(_USERSIG_CODES.get(exc.reason, 70003), str(exc)) from exc
        if signed_for != identifier:
            raise _Fail(70013, "identifier differs from the UserSig's identifier")
        if identifier not in self.admin_identifiers:
            raise _Fail(60010, "this API requires an app admin identifier")
        if self.usersig_expiry_remaining > 0:
            self.usersig_expiry_remaining -= 1
            raise _Fail(70001, "UserSig expired (injected)")

    def _checked(self, sig: str) -> SignedFor:
        """``check_usersig`` of ``sig`` for this app and key, kept for the next call with the same."""
        cached = self._signed
        if cached is not None and cached[:3] == (sig, self.sdk_app_id, self.secret_key):
            return cached[3]
        signed = check_usersig(sig, self.sdk_app_id, self.secret_key)
        self._signed = (sig, self.sdk_app_id, self.secret_key, signed)
        return signed

    def _throttle(self, service: str, command: str) -> None:
        rate = self.rate_limit_per_second
        if rate is None:
            return
        key = f"{service}/{command}"
        now = time.monotonic()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(rate, max(1.0, rate), now=now)
        if bucket.reserve(now, latest=now) is None:
            raise _Fail(60007, f"REST API {key} exceeded {rate:g} requests per second")

    def _injected(self, service: str, command: str) -> None:
        for injected in self.errors:
            if injected.matches(service, command):
                if injected.remaining is not None:
                    injected.remaining -= 1
                    if injected.remaining <= 0:
                        self.errors.remove(injected)
                raise _Fail(injected.code, injected.info)

    def _handlers(self) -> dict[tuple[str, str], Callable[[dict[str, Any], str], dict[str, Any]]]:
        return {
            ("im_open_login_svc", "account_import"): self._account_import,
            ("im_open_login_svc", "multiaccount_import"): self._multiaccount_import,
            ("group_open_http_svc", "create_group"): self._create_group,
            ("group_open_http_svc", "get_group_info"): self._get_group_info,
            ("group_open_http_svc", "send_group_msg"): self._send_group_msg,
            ("group_open_http_svc", "send_group_system_notification"): self._send_group_system_notification,
            ("group_open_http_svc", "add_group_member"): self._add_group_member,
            ("group_open_http_svc", "delete_group_member"): self._delete_group_member,
            ("group_open_http_svc", "ban_group_member"): self._ban_group_member,
            ("group_open_http_svc", "forbid_send_msg"): self._forbid_send_msg,
            ("group_open_http_svc", "destroy_group"): self._destroy_group,
            ("openim", "sendmsg"): self._sendmsg,
        }

    def _controls(self) -> dict[str, Callable[[dict[str, Any], str], dict[str, Any]]]:
        return {"dismiss_group": self._dismiss}

    # ----------------------------------------------------------------- accounts

    @staticmethod
    def _valid_user_id(value: object) -> bool:
        return isinstance(value, str) and 0 < len(value.encode("utf-8")) <= 32 and _printable_ascii(value)

    def _import(self, user_id: str, nick: str | None = None, face_url: str | None = None) -> None:
        existing = self.accounts.get(user_id)
        if existing is None:
            self.accounts[user_id] = Account(user_id, nick, face_url, self.now())
        else:
            existing.nick = nick if nick is not None else existing.nick
            existing.face_url = face_url if face_url is not None else existing.face_url

    def _account_import(self, req: dict[str, Any], _identifier: str) -> dict[str, Any]:
        user_id = req.get("UserID", req.get("Identifier"))
        if not self._valid_user_id(user_id):
            raise _Fail(70402, "UserID must be 1-32 bytes of printable ASCII")
        nick, face = req.get("Nick"), req.get("FaceUrl")
        self._import(str(user_id), nick if isinstance(nick, str) else None, face if isinstance(face, str) else None)
        return {}

    def _multiaccount_import(self, req: dict[str, Any], _identifier: str) -> dict[str, Any]:
        accounts = req.get("Accounts")
        if not isinstance(accounts, list) or not accounts or len(accounts) > 100:
            raise _Fail(70402, "Accounts must be a list of 1-100 UserIDs")
        failed: list[Any] = []
        for user_id in accounts:
            if self._valid_user_id(user_id):
                self._import(str(user_id))
            else:
                failed.append(user_id)
        return {"FailAccounts": failed}

    def _require_accounts(self, accounts: Iterable[str], code: int = 10019) -> None:
        missing = [a for a in accounts if a not in self.accounts]
        if missing:
            raise _Fail(code, f"accounts not imported: {', '.join(missing)}")

    # ----------------------------------------------------------------- groups

    def _live_group(self, req: dict[str, Any]) -> Group:
        group_id = req.get("GroupId")
        if not isinstance(group_id, str) or not group_id:
            raise _Fail(10004, "GroupId is required")
        group = self.groups.get(group_id)
        if group is None:
            raise _Fail(10010, f"group {group_id} does not exist or was dismissed")
        return group

    def _create_group(self, req: dict[str, Any], identifier: str) -> dict[str, Any]:
        group_type, name = req.get("Type"), req.get("Name")
        if group_type not in GROUP_TYPES:
            raise _Fail(10004, f"Type must be one of {sorted(GROUP_TYPES)}")
        if not isinstance(name, str) or not name or len(name.encode("utf-8")) > 30:
            raise _Fail(10004, "Name is required, at most 30 bytes")
        owner = req.get("Owner_Account")
        if owner is not None and not isinstance(owner, str):
            raise _Fail(10004, "Owner_Account must be a string")
        member_list = req.get("MemberList") or []
        if not isinstance(member_list, list) or not all(
            isinstance(m, dict) and isinstance(m.get("Member_Account"), str) for m in member_list
        ):
            raise _Fail(10004, "MemberList must be a list of {Member_Account}")
        initial = [str(m["Member_Account"]) for m in member_list]
        group_id = req.get("GroupId")
        if group_id is None:
            self._group_counter += 1
            group_id = f"@TGS#{'a' if group_type == 'AVChatRoom' else '_' if group_type == 'Community' else '2'}"
            group_id += f"SBX{self._group_counter:06d}"
        elif not isinstance(group_id, str) or not group_id:
            raise _Fail(10004, "GroupId must be a non-empty string")
        else:
            self._check_custom_group_id(group_id, str(group_type))
        if owner is not None:
            self._require_accounts([owner])
        if group_type == "AVChatRoom" and initial:
            raise _Fail(10007, "an AVChatRoom takes no members at creation; users join through the SDK")
        self._require_accounts(initial)
        existing = self.groups.get(group_id)
        if existing is not None:
            if existing.owner == owner and not self.owned_group_answers_10021:
                raise _Fail(10025, f"group id {group_id} is already used and you are its owner")
            raise _Fail(10021, f"group id {group_id} is already used by someone else")
        now = self.now()
        group = Group(group_id, str(group_type), name, owner, now)
        if group_type != "AVChatRoom":
            for account in ([owner] if owner else []) + initial:
                group.members.setdefault(account, now)
        self.groups[group_id] = group
        return {"GroupId": group_id}

    @staticmethod
    def _check_custom_group_id(group_id: str, group_type: str) -> None:
        if len(group_id.encode("utf-8")) > 48 or not _printable_ascii(group_id):
            raise _Fail(10004, "a custom GroupId is printable ASCII, at most 48 bytes")
        if group_type == "Community":
            if not group_id.startswith("@TGS#_"):
                raise _Fail(10004, "a Community GroupId must start with @TGS#_")
        elif group_id.startswith("@TGS#"):
            raise _Fail(10004, "a custom GroupId must not start with @TGS#")

    def _get_group_info(self, req: dict[str, Any], _identifier: str) -> dict[str, Any]:
        ids = req.get("GroupIdList")
        if not isinstance(ids, list) or not ids or len(ids) > 50 or not all(isinstance(g, str) for g in ids):
            raise _Fail(10004, "GroupIdList must list 1-50 group ids")
        base_filter, member_filter = self._response_filter(req)
        infos: list[dict[str, Any]] = []
        for group_id in ids:
            group = self.groups.get(group_id)
            if group is None:
                infos.append({"GroupId": group_id, "ErrorCode": 10010, "ErrorInfo": "group does not exist"})
                continue
            info: dict[str, Any] = {
                "GroupId": group.group_id,
                "ErrorCode": 0,
                "ErrorInfo": "",
                "Type": group.type,
                "Name": group.name,
                "CreateTime": int(group.created_at),
                "NextMsgSeq": group.next_seq,
            }
            if group.owner is not None:
                info["Owner_Account"] = group.owner
            if group.type != "AVChatRoom":  # member count and list are not available for AVChatRoom
                info["MemberNum"] = len(group.members)
            if base_filter is not None:
                info = {k: v for k, v in info.items() if k in ("GroupId", "ErrorCode", "ErrorInfo") or k in base_filter}
            if group.type != "AVChatRoom" and (base_filter is None or member_filter is not None):
                members = [
                    {"Member_Account": m, "Role": "Owner" if m == group.owner else "Member", "JoinTime": int(t)}
                    for m, t in group.members.items()
                ]
                if member_filter is not None:
                    wanted = member_filter | {"Member_Account"}
                    members = [{k: v for k, v in m.items() if k in wanted} for m in members]
                info["MemberList"] = members
            infos.append(info)
        return {"GroupInfo": infos}

    @staticmethod
    def _response_filter(req: dict[str, Any]) -> tuple[frozenset[str] | None, frozenset[str] | None]:
        """``get_group_info``'s ``ResponseFilter``: (basic fields, member fields) to answer; (None, None)
        without one (everything). With one, only the basic fields it lists, and members only if it asks."""
        response_filter = req.get("ResponseFilter")
        if response_filter is None:
            return None, None
        if not isinstance(response_filter, dict):
            raise _Fail(10004, "ResponseFilter must be an object")
        fields: list[frozenset[str]] = []
        for key in ("GroupBaseInfoFilter", "MemberInfoFilter"):
            names = response_filter.get(key, [])
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise _Fail(10004, f"ResponseFilter.{key} must be a list of field names")
            fields.append(frozenset(names))
        return fields[0], (fields[1] if "MemberInfoFilter" in response_filter else None)

    def _add_group_member(self, req: dict[str, Any], _identifier: str) -> dict[str, Any]:
        group = self._live_group(req)
        if group.type == "AVChatRoom":
            raise _Fail(10007, "AVChatRoom does not support add_group_member; users join through the SDK")
        member_list = req.get("MemberList")
        if (
            not isinstance(member_list, list)
            or not member_list
            or len(member_list) > 300
            or not all(isinstance(m, dict) and isinstance(m.get("Member_Account"), str) for m in member_list)
        ):
            raise _Fail(10004, "MemberList must list 1-300 {Member_Account}")
        accounts = list(dict.fromkeys(str(m["Member_Account"]) for m in member_list))
        self._require_accounts(accounts)
        now = self.now()
        results = []
        for account in accounts:
            if group.banned.get(account, 0.0) > now:
                result = 0
            elif account in group.members:
                result = 2
            else:
                group.members[account] = now
                result = 1
            results.append({"Member_Account": account, "Result": result})
        return {"MemberList": results}

    def _delete_group_member(self, req: dict[str, Any], _identifier: str) -> dict[str, Any]:
        group = self._live_group(req)
        if group.type == "AVChatRoom":
            raise _Fail(
                10004, "AVChatRoom does not support delete_group_member; use ban_group_member or forbid_send_msg"
            )
        accounts = _str_list(req.get("MemberToDel_Account"), code=10004, what="MemberToDel_Account", max_len=100)
        if group.owner is not None and group.owner in accounts:
            raise _Fail(10004, "the group owner cannot be deleted")
        for account in accounts:
            group.members.pop(account, None)  # absent members are not an error
        return {}

    def _ban_group_member(self, req: dict[str, Any], _identifier: str) -> dict[str, Any]:
        group = self._live_group(req)
        if not self.ban_enabled:
            raise _Fail(10059, "ban_group_member is not enabled for this app's package")
        accounts = _str_list(req.get("Members_Account"), code=10004, what="Members_Account", max_len=20)
        duration = req.get("Duration")
        if not _is_uint32(duration) or duration == 0:
            raise _Fail(10004, "Duration must be a positive 32-bit integer (seconds)")
        until = self.now() + float(duration)
        for account in accounts:
            group.banned[account] = until
            group.members.pop(account, None)
        return {}

    def _forbid_send_msg(self, req: dict[str, Any], _identifier: str) -> dict[str, Any]:
        group = self._live_group(req)
        accounts = _str_list(req.get("Members_Account"), code=10004, what="Members_Account", max_len=500)
        shut_up = req.get("ShutUpTime")
        if not _is_uint32(shut_up):
            raise _Fail(10004, "ShutUpTime must be a 32-bit integer (seconds; 0 unmutes)")
        now = self.now()
        for account in accounts:
            if shut_up:
                group.muted[account] = now + float(shut_up)
            else:
                group.muted.pop(account, None)
        return {}

    def _destroy_group(self, req: dict[str, Any], _identifier: str) -> dict[str, Any]:
        group = self._live_group(req)
        group.destroyed_at = self.now()
        del self.groups[group.group_id]
        self.destroyed.append(group)
        return {}

    # ----------------------------------------------------------------- messages

    def _send_group_msg(self, req: dict[str, Any], identifier: str) -> dict[str, Any]:
        group = self._live_group(req)
        random = req.get("Random")
        if not _is_uint32(random):
            raise _Fail(10004, "Random must be a 32-bit unsigned integer")
        body = _msg_body(req.get("MsgBody"), 10004)
        _check_size(body, GROUP_MSG_TOO_LONG)
        sender = req.get("From_Account")
        if sender is not None:
            if not isinstance(sender, str) or not sender:
                raise _Fail(10004, "From_Account must be a UserID")
            self._require_accounts([sender])
        sender = sender or identifier
        now = self.now()
        if group.muted.get(sender, 0.0) > now:
            raise _Fail(10017, f"{sender} is muted in {group.group_id}")
        key = (sender, int(random))
        previous = group.recent.get(key)
        if previous is not None and now - previous.sent_at < GROUP_DUPLICATE_WINDOW_S:
            group.duplicates_absorbed += 1
            return {"MsgTime": previous.time, "MsgSeq": previous.msg_seq}
        message = GroupMessage(group.next_seq, int(random), sender, int(now), body, now)
        group.next_seq += 1
        group.messages.append(message)
        group.recent[key] = message
        if len(group.recent) > 10_000:  # keep the duplicate index bounded
            group.recent = {k: m for k, m in group.recent.items() if now - m.sent_at < GROUP_DUPLICATE_WINDOW_S}
        return {"MsgTime": message.time, "MsgSeq": message.msg_seq}

    def _send_group_system_notification(self, req: dict[str, Any], _identifier: str) -> dict[str, Any]:
        group = self._live_group(req)
        content = req.get("Content")
        if not isinstance(content, str) or not content:
            raise _Fail(10004, "Content is required")
        to_members = req.get("ToMembers_Account") or []
        if not isinstance(to_members, list) or not all(isinstance(m, str) for m in to_members):
            raise _Fail(10004, "ToMembers_Account must be a list of UserIDs")
        if to_members and group.type == "AVChatRoom":
            raise _Fail(10004, "AVChatRoom system notifications go to every member; ToMembers_Account is not allowed")
        group.notifications.append({"content": content, "to_members": to_members, "time": int(self.now())})
        return {}

    def _sendmsg(self, req: dict[str, Any], identifier: str) -> dict[str, Any]:
        to_account = req.get("To_Account")
        if not isinstance(to_account, str) or not to_account:
            raise _Fail(90001, "To_Account is required")
        random = req.get("MsgRandom")
        if not _is_uint32(random):
            raise _Fail(90001, "MsgRandom must be a 32-bit unsigned integer")
        msg_seq = req.get("MsgSeq")
        if msg_seq is not None and not _is_uint32(msg_seq):
            raise _Fail(90001, "MsgSeq must be a 32-bit unsigned integer")
        body = _msg_body(req.get("MsgBody"), 90002)
        _check_size(body, C2C_MSG_TOO_LONG)
        sender = req.get("From_Account")
        if sender is not None and (not isinstance(sender, str) or not sender):
            raise _Fail(90001, "From_Account must be a UserID")
        self._require_accounts([to_account] + ([sender] if sender else []), code=20003)
        sender = sender or identifier
        now = self.now()
        crc = zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8"))
        if msg_seq is not None:
            previous = self._c2c_recent.get((sender, msg_seq, int(random), crc))
            if previous is not None and now - previous.sent_at < C2C_DUPLICATE_WINDOW_S:
                self.c2c_duplicates_absorbed += 1
                return {"MsgTime": previous.time, "MsgKey": previous.msg_key}
        self._c2c_counter += 1
        if msg_seq is None:  # the backend's own number: a re-send without MsgSeq is a new message
            msg_seq = (self._c2c_counter * 2_654_435_761) & 0xFFFFFFFF
        key = (sender, msg_seq, int(random), crc)
        msg_key = f"{self._c2c_counter}_{random}_{int(now)}"
        message = C2CMessage(sender, to_account, int(random), msg_seq, int(now), msg_key, body, now)
        self.c2c.append(message)
        self._c2c_recent[key] = message
        if len(self._c2c_recent) > 10_000:
            self._c2c_recent = {k: m for k, m in self._c2c_recent.items() if now - m.sent_at < C2C_DUPLICATE_WINDOW_S}
        return {"MsgTime": message.time, "MsgKey": msg_key}
