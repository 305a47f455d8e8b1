"""How Tencent IM answers are classified: what an operator fixes waits for the fix, as a signature error does."""

from __future__ import annotations

import pytest

from roomservice.integrations.tencent_im.errors import (
    CONFIGURATION_CODES,
    ImConfigurationError,
    ImPermanentError,
    ImRetryableError,
    classify,
)


@pytest.mark.parametrize("code", sorted(CONFIGURATION_CODES))
def test_the_app_not_set_up_to_be_served_waits_for_an_operator(code: int) -> None:
    """An expired package (60020), an IP not on the allow list (60021), a disabled app (60016), a used-up
    AVChatRoom quota (10036)...: every row in flight would otherwise fail for good at once."""
    error = classify(code, "not now", command="send_group_msg")
    assert isinstance(error, ImConfigurationError) and error.retryable
    assert (error.code, error.command) == (code, "send_group_msg")


def test_a_transient_invalid_request_is_retried_and_a_refused_request_is_not() -> None:
    assert isinstance(classify(10008, "invalid request, retry"), ImRetryableError)
    refused = classify(10004, "invalid parameter")
    assert isinstance(refused, ImPermanentError) and not refused.retryable
