"""TLSSigAPIv2 UserSig: generate and verify the signature Tencent IM REST calls carry.

A UserSig is ``base64url*(zlib(json(doc)))`` where ``doc`` is::

    {"TLS.ver": "2.0", "TLS.identifier": id, "TLS.sdkappid": n,
     "TLS.expire": ttl_s, "TLS.time": issued_at_s, "TLS.sig": base64(HMAC-SHA256(key, content))}

and ``content`` is the newline-terminated lines ``TLS.identifier:<id>``,
``TLS.sdkappid:<n>``, ``TLS.time:<t>``, ``TLS.expire:<ttl>`` (plus ``TLS.userbuf:<b64>``
when a user buffer is present). The key is the app's secret key, used as UTF-8 bytes.

The outer base64 is Tencent's own URL-safe variant: standard base64, then
``+``→``*``, ``/``→``-``, ``=``→``_``. This is *not* :func:`base64.urlsafe_b64encode`
(which maps to ``-``/``_`` and keeps ``=``). ``tests/unit/test_usersig.py`` checks both
directions against the official ``tls-sig-api-v2`` package.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import zlib
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SignedFor",
    "UserSigError",
    "check_usersig",
    "decode_usersig",
    "gen_usersig",
    "tls_b64decode",
    "tls_b64encode",
    "verify_usersig",
]

_ENCODE = str.maketrans({"+": "*", "/": "-", "=": "_"})
_DECODE = str.maketrans({"*": "+", "-": "/", "_": "="})


class UserSigError(ValueError):
    """A UserSig that does not verify. ``reason`` is one of ``malformed``, ``bad_signature``,
    ``expired``, ``wrong_app`` (the Tencent codes are 70003, 70009, 70001, 70014)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def tls_b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii").translate(_ENCODE)


def tls_b64decode(text: str) -> bytes:
    return base64.b64decode(text.translate(_DECODE).encode("ascii"), validate=True)


def _content(identifier: str, sdk_app_id: int, issued_at: int, ttl_s: int, userbuf: str | None) -> bytes:
    text = f"TLS.identifier:{identifier}\nTLS.sdkappid:{sdk_app_id}\nTLS.time:{issued_at}\nTLS.expire:{ttl_s}\n"
    if userbuf is not None:
        text += f"TLS.userbuf:{userbuf}\n"
    return text.encode("utf-8")


def _hmac_b64(key: str, content: bytes) -> str:
    return base64.b64encode(hmac.new(key.encode("utf-8"), content, hashlib.sha256).digest()).decode("ascii")


def gen_usersig(sdk_app_id: int, key: str, identifier: str, ttl_s: int, now_s: int) -> str:
    """The UserSig of ``identifier``, issued at ``now_s`` (Unix seconds), valid ``ttl_s`` seconds."""
    if ttl_s <= 0:
        raise ValueError("ttl_s must be > 0")
    doc: dict[str, Any] = {
        "TLS.ver": "2.0",
        "TLS.identifier": str(identifier),
        "TLS.sdkappid": int(sdk_app_id),
        "TLS.expire": int(ttl_s),
        "TLS.time": int(now_s),
    }
    doc["TLS.sig"] = _hmac_b64(key, _content(identifier, sdk_app_id, int(now_s), int(ttl_s), None))
    # json.dumps defaults and this key order reproduce the official generator byte for byte
    return tls_b64encode(zlib.compress(json.dumps(doc).encode("utf-8")))


def decode_usersig(sig: str) -> dict[str, Any]:
    """The signed document inside ``sig``, NOT verified. Raises :class:`UserSigError` (malformed)."""
    try:
        raw = zlib.decompress(tls_b64decode(sig))
        doc = json.loads(raw)
    except (binascii.Error, ValueError, zlib.error, UnicodeError) as exc:
        raise UserSigError("malformed", f"UserSig cannot be decoded: {exc}") from exc
    if not isinstance(doc, dict):
        raise UserSigError("malformed", "UserSig is not a JSON object")
    return doc


@dataclass(frozen=True, slots=True)
class SignedFor:
    """What a UserSig whose signature checked out says: who it is for, and until when."""

    identifier: str
    expires_at_s: int  # TLS.time + TLS.expire

    def valid_at(self, now_s: int) -> str:
        """The identifier, or :class:`UserSigError` (expired) once ``now_s`` is past the expiry."""
        if self.expires_at_s < now_s:
            raise UserSigError("expired", f"UserSig expired at {self.expires_at_s} (now {now_s})")
        return self.identifier


def check_usersig(sig: str, sdk_app_id: int, key: str) -> SignedFor:
    """Check ``sig``'s signature with ``key`` and that it was issued for app ``sdk_app_id``; its
    expiry is the caller's to check (:meth:`SignedFor.valid_at`). The same ``sig``, app and key
    always give the same answer, so a verifier may keep it. Raises :class:`UserSigError`."""
    doc = decode_usersig(sig)
    try:
        identifier = doc["TLS.identifier"]
        app = doc["TLS.sdkappid"]
        issued_at = doc["TLS.time"]
        ttl = doc["TLS.expire"]
        signature = doc["TLS.sig"]
        userbuf = doc.get("TLS.userbuf")
    except KeyError as exc:
        raise UserSigError("malformed", f"UserSig lacks {exc.args[0]}") from exc
    if (
        not isinstance(identifier, str)
        or not isinstance(signature, str)
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in (app, issued_at, ttl))
        or (userbuf is not None and not isinstance(userbuf, str))
    ):
        raise UserSigError("malformed", "UserSig fields have wrong types")
    expected = _hmac_b64(key, _content(identifier, app, issued_at, ttl, userbuf))
    if not hmac.compare_digest(expected.encode("ascii"), signature.encode("ascii", "replace")):
        raise UserSigError("bad_signature", "UserSig signature does not verify")
    if app != sdk_app_id:
        raise UserSigError("wrong_app", f"UserSig was issued for sdkappid {app}, not {sdk_app_id}")
    return SignedFor(identifier, issued_at + ttl)


def verify_usersig(sig: str, sdk_app_id: int, key: str, *, now_s: int) -> str:
    """Check ``sig`` for app ``sdk_app_id`` with ``key`` at ``now_s``; return its identifier.

    Raises :class:`UserSigError` when it is malformed, signed with another key, issued
    for another app, or expired (``TLS.time + TLS.expire < now_s``).
    """
    return check_usersig(sig, sdk_app_id, key).valid_at(now_s)
