"""Lease timing settings: renewal well before expiry, a safety margin inside the ttl."""

from __future__ import annotations

import warnings

import pytest
from redis.asyncio.retry import Retry as AsyncRetry

from roomservice.config import ConfigError, load_settings
from roomservice.leases.redis import redis_client


def test_defaults_renew_well_before_the_lease_could_expire() -> None:
    lease = load_settings().lease
    assert lease.renew_every < lease.ttl - lease.safety_margin
    assert lease.safety_margin < lease.ttl


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"lease.ttl": "10s", "lease.safety_margin": "10s"}, "lease.safety_margin"),
        ({"lease.ttl": "10s", "lease.safety_margin": "2s", "lease.renew_every": "8s"}, "lease.renew_every"),
        ({"lease.ttl": "3s", "lease.safety_margin": "1s", "lease.renew_every": "2500ms"}, "lease.renew_every"),
        ({"redis.socket_timeout": "0s"}, "redis.socket_timeout"),
    ],
)
def test_lease_timings_that_could_let_a_lease_lapse_are_refused(overrides: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_settings().with_overrides(overrides)


def test_a_consistent_short_lease_is_accepted() -> None:
    settings = load_settings().with_overrides(
        {"lease.ttl": "3s", "lease.safety_margin": "1s", "lease.renew_every": "1s", "redis.socket_timeout": "250ms"}
    )
    assert settings.lease.renew_every.total_seconds() == 1.0
    assert settings.redis.socket_timeout.total_seconds() == 0.25


def test_the_lease_client_gets_an_asyncio_retry_it_keeps_as_given() -> None:
    """redis-py converts a synchronous Retry given to its asyncio client with a warning that a custom
    retry is not kept: the client gets the asyncio one, with the one immediate retry we ask for."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        client = redis_client(load_settings().redis)
    retry = client.connection_pool.connection_kwargs["retry"]
    assert isinstance(retry, AsyncRetry)
    assert retry._retries == 1
