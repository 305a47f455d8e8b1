"""``log_context`` binds what every line logged inside it carries, and puts back exactly what was there."""

from __future__ import annotations

import pytest
from structlog.contextvars import bind_contextvars, clear_contextvars, get_contextvars

from roomservice.observability.logging import log_context


@pytest.fixture(autouse=True)
def empty_context() -> None:
    clear_contextvars()


def test_it_binds_inside_and_restores_the_values_and_absences_before() -> None:
    bind_contextvars(app_code="demo", event_id="outer")
    with log_context(event_id="inner", consumer_group="g"):
        assert get_contextvars() == {"app_code": "demo", "event_id": "inner", "consumer_group": "g"}
        with log_context(event_id="innermost"):
            assert get_contextvars()["event_id"] == "innermost"
        assert get_contextvars()["event_id"] == "inner"
    assert get_contextvars() == {"app_code": "demo", "event_id": "outer"}


def fail_inside(seen: list[dict[str, object]]) -> None:
    with log_context(command_id="c1"):
        seen.append(get_contextvars())
        raise RuntimeError("boom")


def test_it_restores_on_an_exception_too() -> None:
    seen: list[dict[str, object]] = []
    with pytest.raises(RuntimeError):
        fail_inside(seen)
    assert seen == [{"command_id": "c1"}]
    assert get_contextvars() == {}
