"""Our TLSSigAPIv2 UserSig against the official ``tls-sig-api-v2`` package, both ways.

The official package only generates (it has no verifier) and reads the wall clock, so
the tests pin ``time.time`` inside it; "ours verified by theirs" means decoding our sig
with the package's own base64 decoder and recomputing the HMAC with its private signer.
"""

from __future__ import annotations

import base64
import json
import os
import zlib
from typing import Any

import pytest

from roomservice.integrations.tencent_im.usersig import (
    UserSigError,
    decode_usersig,
    gen_usersig,
    tls_b64decode,
    tls_b64encode,
    verify_usersig,
)

try:
    import TLSSigAPIv2
except ImportError:  # a dev dependency: skip on a developer machine, fail in CI
    if os.environ.get("CI", "").strip().lower() in ("true", "1"):
        raise
    pytest.skip("the official package is missing: pip install tls-sig-api-v2", allow_module_level=True)

APP = 1400000000
KEY = "5bd2850fff3ecb11d7c805251c51ee463a25727bddc2385f3fa8bfee1bb93b5e"
NOW = 1_700_000_000
TTL = 86_400
IDENTIFIERS = ["administrator", "xiaojun", "user-1.2:3", "a" * 32, "用户"]


def official_sig(monkeypatch: pytest.MonkeyPatch, identifier: str, *, now: int = NOW, ttl: int = TTL, **kw: Any) -> str:
    monkeypatch.setattr(TLSSigAPIv2.time, "time", lambda: float(now))
    api = TLSSigAPIv2.TLSSigAPIv2(kw.get("app", APP), kw.get("key", KEY))
    if "userbuf" in kw:
        return str(api.gen_sig_with_userbuf(identifier, ttl, kw["userbuf"]))
    return str(api.gen_sig(identifier, ttl))


def official_verify(sig: str, *, app: int = APP, key: str = KEY) -> dict[str, Any]:
    """Verify with the official package's pieces: its decoder and its HMAC."""
    doc: dict[str, Any] = json.loads(zlib.decompress(TLSSigAPIv2.base64_decode_url(sig.encode())))
    api = TLSSigAPIv2.TLSSigAPIv2(app, key)
    expected = api._TLSSigAPIv2__hmacsha256(doc["TLS.identifier"], doc["TLS.time"], doc["TLS.expire"], None)
    assert expected.decode() == doc["TLS.sig"], "HMAC does not match the official computation"
    return doc


@pytest.mark.parametrize("identifier", IDENTIFIERS)
def test_theirs_verifies_with_ours(monkeypatch: pytest.MonkeyPatch, identifier: str) -> None:
    sig = official_sig(monkeypatch, identifier)
    assert verify_usersig(sig, APP, KEY, now_s=NOW + 10) == identifier


@pytest.mark.parametrize("identifier", IDENTIFIERS)
def test_ours_verifies_with_theirs(identifier: str) -> None:
    sig = gen_usersig(APP, KEY, identifier, TTL, NOW)
    doc = official_verify(sig)
    assert doc["TLS.ver"] == "2.0"
    assert doc["TLS.identifier"] == identifier
    assert doc["TLS.sdkappid"] == APP
    assert doc["TLS.time"] == NOW
    assert doc["TLS.expire"] == TTL


@pytest.mark.parametrize("identifier", IDENTIFIERS)
def test_same_inputs_give_the_same_bytes(monkeypatch: pytest.MonkeyPatch, identifier: str) -> None:
    assert gen_usersig(APP, KEY, identifier, TTL, NOW) == official_sig(monkeypatch, identifier)


def test_official_userbuf_variant_verifies(monkeypatch: pytest.MonkeyPatch) -> None:
    sig = official_sig(monkeypatch, "xiaojun", userbuf=b"abc")
    assert verify_usersig(sig, APP, KEY, now_s=NOW) == "xiaojun"


def test_base64_variant_is_not_urlsafe_b64() -> None:
    data = bytes(range(256)) * 3 + b"\xfb\xff"
    encoded = tls_b64encode(data)
    assert set(encoded) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789*-_")
    assert "*" in encoded and "-" in encoded and encoded.endswith("_")
    assert encoded != base64.urlsafe_b64encode(data).decode()
    assert encoded == TLSSigAPIv2.base64_encode_url(data)
    assert tls_b64decode(encoded) == data


def test_every_padding_length_round_trips() -> None:
    for n in range(1, 40):
        data = bytes((i * 37 + n) % 256 for i in range(n))
        assert tls_b64decode(tls_b64encode(data)) == data
        assert TLSSigAPIv2.base64_decode_url(tls_b64encode(data).encode()) == data


def test_expired_sig_is_rejected() -> None:
    sig = gen_usersig(APP, KEY, "administrator", 60, NOW)
    assert verify_usersig(sig, APP, KEY, now_s=NOW + 60) == "administrator"  # last valid second
    with pytest.raises(UserSigError) as err:
        verify_usersig(sig, APP, KEY, now_s=NOW + 61)
    assert err.value.reason == "expired"


def test_official_sig_expires_too(monkeypatch: pytest.MonkeyPatch) -> None:
    sig = official_sig(monkeypatch, "administrator", ttl=100)
    with pytest.raises(UserSigError, match="expired"):
        verify_usersig(sig, APP, KEY, now_s=NOW + 101)


def test_wrong_key_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    sig = official_sig(monkeypatch, "administrator", key="another-key")
    with pytest.raises(UserSigError) as err:
        verify_usersig(sig, APP, KEY, now_s=NOW)
    assert err.value.reason == "bad_signature"


def test_wrong_app_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    sig = official_sig(monkeypatch, "administrator", app=APP + 1)
    with pytest.raises(UserSigError) as err:
        verify_usersig(sig, APP, KEY, now_s=NOW)
    assert err.value.reason == "wrong_app"


def _reencode(doc: dict[str, Any]) -> str:
    return tls_b64encode(zlib.compress(json.dumps(doc).encode()))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("TLS.identifier", "someone-else"),
        ("TLS.expire", TTL * 10),
        ("TLS.time", NOW + 1000),
        ("TLS.sdkappid", APP + 1),
    ],
)
def test_tampered_fields_are_rejected(field: str, value: object) -> None:
    doc = decode_usersig(gen_usersig(APP, KEY, "administrator", TTL, NOW))
    doc[field] = value
    with pytest.raises(UserSigError) as err:
        verify_usersig(_reencode(doc), APP, KEY, now_s=NOW)
    assert err.value.reason == "bad_signature"


def test_tampered_signature_is_rejected() -> None:
    doc = decode_usersig(gen_usersig(APP, KEY, "administrator", TTL, NOW))
    raw = bytearray(base64.b64decode(doc["TLS.sig"]))
    raw[0] ^= 1
    doc["TLS.sig"] = base64.b64encode(bytes(raw)).decode()
    with pytest.raises(UserSigError, match="does not verify"):
        verify_usersig(_reencode(doc), APP, KEY, now_s=NOW)


@pytest.mark.parametrize(
    "sig",
    [
        "",
        "not base64!",
        tls_b64encode(b"not zlib"),
        tls_b64encode(zlib.compress(b"not json")),
        tls_b64encode(zlib.compress(b"[1, 2]")),
        _reencode({"TLS.ver": "2.0", "TLS.identifier": "x"}),
        _reencode(
            {
                "TLS.ver": "2.0",
                "TLS.identifier": "x",
                "TLS.sdkappid": str(APP),
                "TLS.expire": TTL,
                "TLS.time": NOW,
                "TLS.sig": "AAAA",
            }
        ),
    ],
)
def test_malformed_sigs_are_rejected(sig: str) -> None:
    with pytest.raises(UserSigError) as err:
        verify_usersig(sig, APP, KEY, now_s=NOW)
    assert err.value.reason == "malformed"


def test_truncated_sig_is_rejected() -> None:
    sig = gen_usersig(APP, KEY, "administrator", TTL, NOW)
    with pytest.raises(UserSigError):
        verify_usersig(sig[: len(sig) // 2], APP, KEY, now_s=NOW)


def test_ttl_must_be_positive() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        gen_usersig(APP, KEY, "administrator", 0, NOW)
