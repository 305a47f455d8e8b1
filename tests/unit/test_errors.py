"""The error tree: one root, codes and retryability; HTTP statuses live in api/errors.py."""

from __future__ import annotations

import inspect

import pytest

from roomservice import errors
from roomservice.api.errors import HTTP_STATUS, http_status
from roomservice.leases.port import LeaseUnavailable
from roomservice.publishers.port import PermanentError, PublishError, RetryableError
from roomservice.store.port import CommandIdTaken, StoreConflict, StoreUnavailable
from roomservice.wallet.port import DebitKeyConflict, InsufficientFunds, WalletUnavailable

PUBLIC = [
    cls
    for _, cls in inspect.getmembers(errors, inspect.isclass)
    if issubclass(cls, errors.RoomServiceError) and cls.code != "internal" and cls is not errors.TreasureTooEarly
]


def test_every_error_of_the_http_contract_has_a_status() -> None:
    for cls in PUBLIC:
        assert cls.code in HTTP_STATUS, cls


def test_domain_errors_carry_no_http_status() -> None:
    assert not hasattr(errors.NotMember(), "status")


@pytest.mark.parametrize(
    ("exc", "code", "retryable", "status"),
    [
        (StoreUnavailable("db"), "unavailable", True, 503),
        (StoreConflict("race"), "retry", True, 503),
        (CommandIdTaken("taken"), "retry", True, 503),
        (LeaseUnavailable("held"), "retry", True, 503),
        (WalletUnavailable("down"), "unavailable", True, 503),
        (RetryableError("im down"), "publish_retryable", True, 503),
        (PermanentError("rejected"), "publish_rejected", False, 500),
        (InsufficientFunds("poor"), "wallet_error", False, 500),
        (DebitKeyConflict("k"), "wallet_error", False, 500),
        (errors.NotMember(), "not_member", False, 403),
        (errors.TreasureTooEarly(1), "too_early", True, 409),
    ],
)
def test_port_errors_join_the_one_tree(exc: errors.RoomServiceError, code: str, retryable: bool, status: int) -> None:
    assert isinstance(exc, errors.RoomServiceError)
    assert (exc.code, exc.retryable, http_status(exc)) == (code, retryable, status)


def test_publish_errors_say_whether_to_retry_in_one_way() -> None:
    assert issubclass(RetryableError, PublishError) and issubclass(PermanentError, PublishError)
    assert RetryableError.retryable and not PermanentError.retryable
