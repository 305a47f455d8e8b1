"""The shipped Grafana dashboard and Prometheus alert rules reference only metrics a real process exports.

A process with the api, outbox, consumers and maintenance roles runs mq mode on the embedded broker; a
few commands make the labelled series exist; then GET /metrics (the real app, through ASGI) must
contain every metric name the dashboard's and the rules' PromQL expressions use.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tests.service.conftest import make_settings
from tests.service.helpers import APP, run
from tests.service.test_mq_mode import all_delivered, eventually

from roomservice import errors
from roomservice.api.app import ApiContext, create_app
from roomservice.bootstrap import Process
from roomservice.bootstrap.process import API, CONSUMERS, MAINTENANCE, OUTBOX
from roomservice.domain import commands as c
from roomservice.leases.inprocess import InProcessLeases
from roomservice.observability.metrics import REGISTRY, STAGES

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "room-service.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"

MQ = {
    "outbox_worker.publish_mode": "mq",
    "rocketmq.room_outbox.enabled": True,
    "consumers.activity.enabled": True,
    "consumers.notice.enabled": True,
    "metrics.enabled": True,
}

_PROMQL_WORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right"}
    | {"inf", "nan"}
)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords, labels and durations left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors and subqueries
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)  # label lists
    text = re.sub(r"\$\{?\w+\}?", "", text)  # Grafana variables
    names = set()
    for match in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)(\s*\()?", text):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in _PROMQL_WORDS:
            continue
        names.add(name)
    return names


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    def panels(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for panel in items:
            out.append(panel)
            out.extend(panels(panel.get("panels", [])))
        return out

    return [t["expr"] for p in panels(dashboard["panels"]) for t in p.get("targets", [])]


def alert_rules(rules: dict[str, Any]) -> list[dict[str, Any]]:
    return [rule for group in rules["groups"] for rule in group["rules"]]


def test_the_metric_name_parser_finds_names_and_only_names() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (command, le) "
        '(rate(room_command_seconds_bucket{stage!="total"}[$__rate_interval])))'
        " / ignoring(stage) group_left sum(room_x_total) and on(instance) up == 0 or vector(1)"
    )
    assert metric_names(expr) == {"room_command_seconds_bucket", "room_x_total", "up"}


def test_the_dashboard_and_the_rules_parse_and_are_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "room-service" and dashboard["panels"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    exprs = dashboard_exprs(dashboard)
    assert exprs and all(metric_names(e) for e in exprs), "every query selects a metric"

    rules = alert_rules(yaml.safe_load(ALERTS.read_text()))
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"]
        assert metric_names(str(rule["expr"])), rule["alert"]
    # the rules the issue asks for
    assert {
        "RoomOutboxBacklogAgeHigh",
        "RoomOutboxDeadLettersRising",
        "RoomConsumerDeadLettersRising",
        "RoomConsumerLagHigh",
        "RoomOutboxNoWorkerClaiming",
        "RoomBrokerDown",
    } <= set(names)


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def _missing(referenced: set[str], exported: set[str]) -> set[str]:
    # a histogram's base name resolves through its _bucket series
    return {n for n in referenced if n not in exported and f"{n}_bucket" not in exported}


def _value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return sum(v for lbl, v in samples.get(name, []) if all(lbl.get(k) == want for k, want in labels.items()))


async def test_every_metric_the_dashboard_and_the_alerts_use_is_exported(tmp_path: Path) -> None:
    referenced = set()
    for expr in dashboard_exprs(json.loads(DASHBOARD.read_text())):
        referenced |= metric_names(expr)
    for rule in alert_rules(yaml.safe_load(ALERTS.read_text())):
        referenced |= metric_names(str(rule["expr"]))
    assert all(n.startswith("room_") for n in referenced), sorted(referenced)  # ours, and parsed right

    settings = make_settings(f"sqlite+aiosqlite:///{tmp_path}/room.db", tmp_path, **MQ)
    async with Process.running(settings, roles=(API, OUTBOX, CONSUMERS, MAINTENANCE)) as rt:
        app = create_app(
            ApiContext(
                service=rt.service,
                health=rt.health,
                admin_token="t" * 32,
                outbox_admin=rt.outbox_admin,
                metrics=settings.metrics.enabled,
            )
        )
        await run(rt, "m1", "c1", c.CreateRoom(owner_id="alice", title="metrics"))
        await run(rt, "m1", "c2", c.JoinRoom(user_id="bob"))
        await run(rt, "m1", "c3", c.SendGift(sender_id="bob", receiver_id="alice", gift_id="rose", count=2))
        await run(rt, "m1", "c4", c.KickUser(operator_id="alice", target_id="bob"))
        await eventually(lambda: all_delivered(rt), what="rows delivered to the broker")
        assert rt.consumers is not None
        await rt.consumers.sample_stats()  # the 15 s sampler's pass, now

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.get("/readyz")).status_code == 200  # pings the broker: room_broker_up

            scraped: dict[str, list[tuple[dict[str, str], float]]] = {}

            async def everything_exported() -> bool:
                nonlocal scraped
                response = await client.get("/metrics")
                assert response.status_code == 200
                scraped = _samples(response.text)
                return not _missing(referenced, set(scraped))

            with contextlib.suppress(AssertionError):  # reported below, with the names
                await eventually(everything_exported, what="the maintenance sampler's first pass")
            assert _missing(referenced, set(scraped)) == set()

    # the new series carry what happened, not just a name
    assert _value(scraped, "room_broker_up") == 1
    for stage in ("idempotency", "lease", "wallet_debit", "save_mutation", "projection", "total"):
        assert stage in STAGES
        assert _value(scraped, "room_command_stage_seconds_count", command="SendGift", stage=stage) >= 1, stage
    assert _value(scraped, "room_command_stage_seconds_count", command="JoinRoom", stage="wallet_debit") == 0
    assert _value(scraped, "room_lease_acquisitions_total", result="acquired") >= 1
    assert _value(scraped, "room_db_pool_size") > 0
    assert _value(scraped, "room_outbox_deliveries_total", target="broker", outcome="ok") >= 4
    assert {lbl["group"] for lbl, _ in scraped["room_consumer_redeliveries_total"]} >= {
        "hyapp-activity-room-outbox",
        "hyapp-notice-room-outbox",
    }


async def test_lease_acquisitions_and_losses_are_counted(tmp_path: Path) -> None:
    settings = make_settings(f"sqlite+aiosqlite:///{tmp_path}/room.db", tmp_path)

    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    async with Process.running(settings, roles=(API,), loops=False) as rt:
        acquired = value("room_lease_acquisitions_total", result="acquired")
        ensure = value("room_lease_losses_total", reason="ensure")
        on_lost = value("room_lease_losses_total", reason="on_lost")
        await run(rt, "l1", "c1", c.CreateRoom(owner_id="alice", title="leases"))
        assert value("room_lease_acquisitions_total", result="acquired") == acquired + 1

        leases = rt.leases
        assert isinstance(leases, InProcessLeases)
        leases.revoke(APP, "l1")  # as if another process took the room
        with pytest.raises(errors.Retry):
            await run(rt, "l1", "c2", c.JoinRoom(user_id="bob"))
        assert value("room_lease_losses_total", reason="ensure") == ensure + 1
        assert rt.registry.peek(APP, "l1") is None

        await run(rt, "l1", "c2", c.JoinRoom(user_id="bob"))  # reloads under a new lease
        assert value("room_lease_acquisitions_total", result="acquired") == acquired + 2
        await rt.registry.on_lease_lost(APP, "l1")  # the renewal loop's report
        await rt.registry.on_lease_lost(APP, "l1")  # no cell any more: not counted twice
        assert rt.registry.peek(APP, "l1") is None
        assert value("room_lease_losses_total", reason="on_lost") == on_lost + 1
