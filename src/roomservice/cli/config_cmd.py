"""``room-service config check``: what a config file means, before anything runs.

Prints the effective settings (YAML, secrets masked) and the keys that the
file's choices leave inactive, or every problem that stops the file from
loading (exit status 2). It reads the file and the environment only: no data
dir is created, no database opened.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import typer
import yaml

from roomservice.cli.options import ConfigOpt, DataDirOpt
from roomservice.config import (
    INACTIVE_RULES,
    NOT_YET_AVAILABLE,
    ConfigError,
    Settings,
    inactive_keys,
    load_settings,
)


def _epilog() -> str:
    """Both tables of config.py, so ``--help`` says what docs/configuration.md says."""
    # "\b" keeps click from re-wrapping the paragraph that follows it
    unavailable = [f"  {row.key}: {_yaml(row.value)} ({row.missing})" for row in NOT_YET_AVAILABLE]
    inactive = [
        textwrap.fill(", ".join(rule.keys), 100, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False)
        + "\n"
        + textwrap.fill(rule.reason, 100, initial_indent="      ", subsequent_indent="      ")
        for rule in INACTIVE_RULES
    ]
    return "\n\n".join(
        [
            "\b\nNot available yet (loading fails naming the key):\n" + "\n".join(unavailable),
            "\b\nInactive keys (allowed in a file, ignored) and when:\n" + "\n".join(inactive),
        ]
    )


def _yaml(value: object) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


config_app = typer.Typer(
    help=(
        "Inspect a configuration file. Every key takes effect, is inactive under the "
        "file's choices (allowed in a file, and ignored), or names a choice that is not "
        "available yet, which fails at load. docs/configuration.md describes every key."
    ),
    epilog=_epilog(),
    no_args_is_help=True,
    rich_markup_mode=None,
)

MASK = "**********"  # what pydantic shows for a set SecretStr
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/@:\s]*:)[^@/\s]+@")


@config_app.command("check")
def check(config: ConfigOpt = None, data_dir: DataDirOpt = Path("var")) -> None:
    """Load a config file (default: the packaged configs/local.yaml) with the environment,
    then print its effective settings, secrets masked, and the keys its choices leave
    inactive. A file that does not load prints every problem and exits with status 2."""
    source = str(config) if config is not None else "roomservice/configs/local.yaml (packaged)"
    try:
        settings = load_settings(config)
    except ConfigError as exc:
        typer.echo(f"config error in {exc.source or source}:", err=True)
        for problem in exc.problems:
            typer.echo(f"  - {problem}", err=True)
        raise typer.Exit(2) from None
    settings = settings.with_data_dir(data_dir)
    typer.echo(render(settings, source=source), nl=False)


def render(settings: Settings, *, source: str) -> str:
    """The report of :func:`check`: a YAML document of the effective settings, then the
    inactive keys as YAML comments grouped by reason."""
    lines = [
        f"# room-service config check: {source}",
        f"# effective settings; a secret that is set shows as {MASK}",
        yaml.safe_dump(_masked(settings.model_dump(mode="json")), sort_keys=False, allow_unicode=True).rstrip(),
    ]
    inactive = inactive_keys(settings)
    if inactive:
        lines.append("")
        lines.append("# inactive keys: allowed in a file, and ignored under these choices")
        by_reason: dict[str, list[str]] = {}
        for key, reason in inactive:
            by_reason.setdefault(reason, []).append(key)
        for reason, keys in by_reason.items():
            lines.append(f"#   {reason}:")
            lines.extend(f"#     {key}" for key in keys)
    else:
        lines.append("# inactive keys: none")
    return "\n".join(lines) + "\n"


def _masked(value: Any) -> Any:
    """Passwords inside URLs too (``scheme://user:pw@host``), wherever a string holds one."""
    if isinstance(value, dict):
        return {k: _masked(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_masked(v) for v in value]
    if isinstance(value, str):
        return _URL_PASSWORD.sub(lambda m: f"{m.group('head')}{MASK}@", value)
    return value
