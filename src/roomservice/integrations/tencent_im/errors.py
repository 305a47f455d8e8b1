"""Tencent IM errors, classified by what the caller should do about them.

    ImError (code, info, command)
    ├── ImRetryableError   try again later: network errors, timeouts, HTTP 5xx/429,
    │                      throttling and "internal error, retry" codes
    ├── ImSignatureError   the UserSig was refused even after a fresh one was generated
    │                      (70001 twice) or cannot verify at all (wrong key/app: 70003,
    │                      70009, 70013, 70014, 70016, 70020). A configuration or clock
    │                      problem: ``retryable`` is True so rows wait for the fix (the
    │                      outbox's max_retry_count still bounds them)
    ├── ImConfigurationError  the app or account is not set up to be served, for a while:
    │                      SDKAppID invalid or disabled (60006, 60016), the package expired
    │                      (60020: served again minutes after it is renewed), the caller's IP
    │                      not on the allow list (60021), the identifier not an app admin
    │                      (60010), the URL's account or signature refused (60004, 60005),
    │                      the AVChatRoom quota used up (10036). Fixed by an operator, not by
    │                      changing the request: retryable as a signature error is
    └── ImPermanentError   everything else: the request will never succeed as sent

``code`` is Tencent's ``ErrorCode`` (0 for transport failures, where ``http_status`` may
say more), ``info`` its ``ErrorInfo``. Callers that treat particular answers as success
compare ``code`` with the constants below (e.g. ``GROUP_ID_USED_BY_YOU``).
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "ACCOUNT_NOT_FOUND",
    "C2C_ACCOUNT_INVALID",
    "CONFIGURATION_CODES",
    "FEATURE_NOT_ENABLED",
    "GROUP_ID_NOT_FOUND",
    "GROUP_ID_TAKEN",
    "GROUP_ID_USED_BY_YOU",
    "GROUP_NOT_FOUND",
    "GROUP_NOT_FOUND_CODES",
    "INVALID_PARAMETER",
    "NO_PERMISSION",
    "REST_RATE_LIMITED",
    "RETRYABLE_CODES",
    "SENDER_MUTED",
    "SIGNATURE_CODES",
    "USERSIG_EXPIRED",
    "ImConfigurationError",
    "ImError",
    "ImPermanentError",
    "ImRetryableError",
    "ImSignatureError",
    "classify",
]

# --- codes with a meaning for callers (Tencent's public error code tables)
INVALID_PARAMETER = 10004  # also: delete_group_member on an AVChatRoom
NO_PERMISSION = 10007  # also: add_group_member / members at creation on an AVChatRoom
GROUP_NOT_FOUND = 10010  # the group does not exist, or existed and was dismissed
GROUP_ID_NOT_FOUND = 10015  # no group with that id
GROUP_NOT_FOUND_CODES = frozenset({GROUP_NOT_FOUND, GROUP_ID_NOT_FOUND})
SENDER_MUTED = 10017
ACCOUNT_NOT_FOUND = 10019  # group APIs: a requested UserID was never imported
GROUP_ID_TAKEN = 10021  # the custom group id is used by someone else
GROUP_ID_USED_BY_YOU = 10025  # the custom group id exists and the operator owns it: usable
FEATURE_NOT_ENABLED = 10059  # the package lacks the feature (e.g. ban_group_member)
C2C_ACCOUNT_INVALID = 20003  # openim: sender or receiver invalid or not imported
REST_RATE_LIMITED = 60007
USERSIG_EXPIRED = 70001

RETRYABLE_CODES: frozenset[int] = frozenset(
    {
        10002,  # internal server error, retry
        10008,  # invalid request (a transient failure on Tencent's side): retry
        10006,  # operation frequency limit
        10023,  # message frequency limit
        20004,  # openim: network error, retry
        20005,  # openim: internal server error, retry
        60007,  # REST API call frequency limit
        60008,  # service timeout
        60011,  # SDKAppID request frequency limit
        60014,  # account exchange timeout
        60018,  # too many requests
        60019,  # too many requests
        70050,  # UserSig check failed and rate-limited: retry after a minute
        70169,  # account service internal timeout
        70500,  # account service internal error, retry
        90994,  # openim: internal error, retry
    }
)

SIGNATURE_CODES: frozenset[int] = frozenset({USERSIG_EXPIRED, 70003, 70009, 70013, 70014, 70016, 70020})

CONFIGURATION_CODES: frozenset[int] = frozenset({60004, 60005, 60006, 60010, 60016, 60020, 60021, 10036})


class ImError(Exception):
    retryable: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        code: int = 0,
        info: str = "",
        command: str = "",
        http_status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.info = info
        self.command = command
        self.http_status = http_status

    def __repr__(self) -> str:
        return f"{type(self).__name__}(command={self.command!r}, code={self.code}, info={self.info!r})"


class ImRetryableError(ImError):
    retryable = True


class ImSignatureError(ImError):
    retryable = True


class ImConfigurationError(ImError):
    retryable = True


class ImPermanentError(ImError):
    retryable = False


def classify(code: int, info: str, *, command: str = "") -> ImError:
    """The exception for a non-zero ``ErrorCode`` (a 70001 the caller could not cure by
    refreshing the UserSig counts as a signature error)."""
    message = f"Tencent IM {command or 'request'} failed: ErrorCode {code}: {info}"
    kind: type[ImError]
    if code in RETRYABLE_CODES:
        kind = ImRetryableError
    elif code in SIGNATURE_CODES:
        kind = ImSignatureError
    elif code in CONFIGURATION_CODES:
        kind = ImConfigurationError
    else:
        kind = ImPermanentError
    return kind(message, code=code, info=info, command=command)
