"""``--help`` of every ``room-service`` command: flags shown as flags, help texts in plain words."""

from __future__ import annotations

from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from roomservice.cli.main import app


def command_paths() -> list[tuple[str, ...]]:
    root = typer.main.get_command(app)
    paths: list[tuple[str, ...]] = [()]

    def walk(command: Any, path: tuple[str, ...]) -> None:
        # typer 0.29 vendors click: groups are recognised by their commands, not by class
        for name, sub in getattr(command, "commands", {}).items():
            paths.append((*path, name))
            walk(sub, (*path, name))

    walk(root, ())
    return paths


PATHS = command_paths()


def help_text(path: tuple[str, ...]) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "120", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.output


def test_every_command_is_covered() -> None:
    assert {("serve",), ("worker",), ("db", "upgrade"), ("activity", "serve"), ("outbox", "stats")} <= set(PATHS)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "room-service")
def test_help_shows_flags_without_a_value_type(path: tuple[str, ...]) -> None:
    text = help_text(path)
    assert "<bool>" not in text
    assert "--help" in text
    for line in text.splitlines():
        if line.strip().startswith("--help"):
            assert line.split()[:2] == ["--help", "Show"], line


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "room-service")
def test_help_texts_are_plain_words(path: tuple[str, ...]) -> None:
    text = help_text(path)
    assert "``" not in text  # reStructuredText literals, shown raw
    assert ":class:" not in text and ":func:" not in text


def test_flags_and_valued_options_read_as_such() -> None:
    stats = help_text(("outbox", "stats"))
    json_line = next(line for line in stats.splitlines() if line.strip().startswith("--json"))
    assert json_line.split()[:2] == ["--json", "Machine-readable"]
    assert "--data-dir <path>" in stats
    replay = help_text(("outbox", "replay"))
    assert "--as-repair  " in replay and "-y, --yes  " in replay
    activity = help_text(("activity", "serve"))
    assert "activity-port" in activity
