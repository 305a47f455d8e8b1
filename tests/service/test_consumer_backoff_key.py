"""``consumers.initial_backoff`` / ``consumers.max_backoff`` / ``consumers.visibility_timeout`` reach every
group the process runs.

The runtime spaces a failed delivery's redelivery by its group's ``RetryPolicy`` and fetches with its
``visibility_s`` (tests/consumers/test_runtime.py shows what each does); here the keys must be what builds them.
"""

from __future__ import annotations

from pathlib import Path

from tests.service.conftest import make_settings

from roomservice.bootstrap import CONSUMERS, Process
from roomservice.config import inactive_keys


async def test_the_backoff_keys_space_every_groups_redeliveries(tmp_path: Path) -> None:
    settings = make_settings(
        f"sqlite+aiosqlite:///{tmp_path}/room.db",
        tmp_path,  # the embedded default: its four groups in the process
        **{"consumers.initial_backoff": "40ms", "consumers.max_backoff": "300ms"},
    )
    assert "consumers.initial_backoff" not in dict(inactive_keys(settings))
    async with Process.running(settings, roles=(CONSUMERS,), loops=False) as rt:
        assert rt.consumers is not None
        assert len(rt.consumers.runners) == 4
        for runner in rt.consumers.runners:
            policy = runner.options.backoff
            assert (policy.initial_backoff_ms, policy.max_backoff_ms) == (40, 300), runner.handler.group
            # the n-th failed delivery waits initial * 2**(n-1), capped (before the ±20 % jitter)
            assert [policy.base_backoff_ms(n) for n in (1, 2, 3, 4, 5)] == [40, 80, 160, 300, 300]


async def test_the_defaults_are_a_second_doubling_to_a_minute(tmp_path: Path) -> None:
    settings = make_settings(f"sqlite+aiosqlite:///{tmp_path}/room.db", tmp_path)
    async with Process.running(settings, roles=(CONSUMERS,), loops=False) as rt:
        assert rt.consumers is not None
        policies = {
            (r.options.backoff.initial_backoff_ms, r.options.backoff.max_backoff_ms)
            for r in rt.consumers.runners
        }
        assert policies == {(1000, 60_000)}


async def test_the_visibility_key_reaches_every_group_and_its_default_follows_the_publish_timeout(
    tmp_path: Path,
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path}/room.db"
    keyed = make_settings(url, tmp_path, **{"consumers.visibility_timeout": "1500ms"})
    assert "consumers.visibility_timeout" not in dict(inactive_keys(keyed))
    async with Process.running(keyed, roles=(CONSUMERS,), loops=False) as rt:
        assert rt.consumers is not None
        assert {r.options.visibility_s for r in rt.consumers.runners} == {1.5}
    derived = make_settings(url, tmp_path, **{"outbox_worker.publish_timeout": "4s"})
    async with Process.running(derived, roles=(CONSUMERS,), loops=False) as rt:
        assert rt.consumers is not None
        assert {r.options.visibility_s for r in rt.consumers.runners} == {8.0}
