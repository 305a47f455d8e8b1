"""``room-service outbox replay --as-repair --target …`` as a real subprocess (issue 7, item 1.4)."""

from __future__ import annotations

import json
import sqlite3

import pytest
from tests.e2e.test_outbox_cli import Env, assert_clear_error, cli  # noqa: F401  (cli: the fixture)

from roomservice import wire


def repair_row(env: Env, event_id: str) -> tuple[str, str | None]:
    """(targets_done, repair_of of the decoded envelope) of a repair row."""
    with sqlite3.connect(env.db_path) as conn:
        targets_done, payload = conn.execute(
            "SELECT targets_done, payload FROM room_outbox WHERE event_id = ?", (event_id,)
        ).fetchone()
    return targets_done, wire.decode_event(payload).repair_of


def total_rows(env: Env) -> int:
    return sum(env.statuses().values())


def test_a_default_repair_skips_the_targets_the_original_reached(cli: Env) -> None:  # noqa: F811
    result = cli.run("replay", "f-1", "--as-repair", "--json")  # f-1 had reached activity
    assert result.returncode == 0, result.stderr
    (outcome,) = json.loads(result.stdout)["results"]
    assert outcome["targets"] == ["broker", "im"]
    assert repair_row(cli, outcome["new_event_id"]) == ("activity", "f-1")


@pytest.mark.parametrize(
    "target_args",
    [("--target", "im", "--target", "activity"), ("--target", "activity,im"), ("-t", " im , activity ")],
    ids=["repeated", "comma-list", "short-spaced"],
)
def test_a_repair_to_named_targets(cli: Env, target_args: tuple[str, ...]) -> None:  # noqa: F811
    result = cli.run("replay", "f-1", "--as-repair", *target_args, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["targets"] == ["activity", "im"]
    (outcome,) = report["results"]
    assert (outcome["result"], outcome["targets"]) == ("replayed", ["activity", "im"])
    assert repair_row(cli, outcome["new_event_id"]) == ("broker", "f-1")
    detail = json.loads(cli.audit(outcome["new_event_id"])[0]["detail"])
    assert (detail["targets"], detail["targets_named"]) == (["activity", "im"], True)


def test_a_bulk_repair_to_a_named_target(cli: Env) -> None:  # noqa: F811
    result = cli.run("replay", "--status", "failed", "--room", "r9", "--as-repair", "--target", "activity", "--yes",
                     "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    outcomes = json.loads(result.stdout)["results"]
    assert len(outcomes) == 5
    assert {tuple(o["targets"]) for o in outcomes} == {("activity",)}
    for o in outcomes:
        assert repair_row(cli, o["new_event_id"]) == ("broker,im", o["event_id"])


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("f-1", "--as-repair", "--target", "sms"),
         "--target: unknown target 'sms'; expected one of im, activity, broker, treasure_wakeup"),
        (("f-1", "--as-repair", "--target", "im", "--target", "IM"), "unknown target 'IM'"),
        (("f-1", "--as-repair", "--target", ","), "--target: targets must name at least one of im"),
        (("f-1", "--target", "im"), "--target applies to --as-repair only"),
        (("--status", "failed", "--as-repair", "--target", "notice", "--yes"), "unknown target 'notice'"),
    ],
)  # fmt: skip
def test_bad_targets_fail_with_one_clear_line_and_write_nothing(
    cli: Env,  # noqa: F811
    args: tuple[str, ...],
    fragment: str,
) -> None:
    before = total_rows(cli)
    assert_clear_error(cli.run("replay", *args), fragment)
    assert total_rows(cli) == before
    assert cli.row("f-1")["status"] == "failed"
    assert cli.audit("f-1") == []
