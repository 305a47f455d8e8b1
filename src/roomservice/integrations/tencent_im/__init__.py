"""Tencent Cloud IM: REST client, UserSig (TLSSigAPIv2), error classes, rate limiter."""

from roomservice.integrations.tencent_im.client import (
    C2CMessageResult,
    GroupInfo,
    GroupMessageResult,
    TencentImClient,
    account_id_for,
    group_id_for,
    random_for,
)
from roomservice.integrations.tencent_im.errors import (
    GROUP_ID_TAKEN,
    GROUP_ID_USED_BY_YOU,
    GROUP_NOT_FOUND,
    GROUP_NOT_FOUND_CODES,
    ImError,
    ImPermanentError,
    ImRetryableError,
    ImSignatureError,
)
from roomservice.integrations.tencent_im.ratelimit import RateLimiter, RateLimitExceeded, TokenBucket
from roomservice.integrations.tencent_im.usersig import UserSigError, gen_usersig, verify_usersig

__all__ = [
    "GROUP_ID_TAKEN",
    "GROUP_ID_USED_BY_YOU",
    "GROUP_NOT_FOUND",
    "GROUP_NOT_FOUND_CODES",
    "C2CMessageResult",
    "GroupInfo",
    "GroupMessageResult",
    "ImError",
    "ImPermanentError",
    "ImRetryableError",
    "ImSignatureError",
    "RateLimitExceeded",
    "RateLimiter",
    "TencentImClient",
    "TokenBucket",
    "UserSigError",
    "account_id_for",
    "gen_usersig",
    "group_id_for",
    "random_for",
    "verify_usersig",
]
