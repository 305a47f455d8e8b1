"""``room-service broker …``: the consumer groups of this configuration, their lag and dead letters.

    room-service broker groups [--json]
    room-service broker dead-letters GROUP [--limit N] [--json]
    room-service broker show GROUP MESSAGE_ID [--json]
    room-service broker replay GROUP MESSAGE_ID... | --all [--json]

A replay sends a dead letter to its group only, with its key (the event id)
unchanged, so the group's deduplication still applies; it is audited
(``consumer_replay``, actor ``$USER``) as the console's are. ``show`` prints one
dead letter in full: the broker's record (delivery count, last error) and its
body decoded (the outbox envelope, or a treasure wake-up).

``groups`` shows what the broker holds per group (lag, in flight, dead
letters). What a consumer did (consumed, duplicates skipped, failures,
redeliveries) is counted in the consuming process's memory: it is on that
process's ``/metrics`` (``room_consumer_messages_total``,
``room_consumer_redeliveries_total``) and, beside the broker's figures, on its
``GET /admin/consumers``; no store keeps it, so this command, a process of its
own, cannot show it.

Exit codes: 0 done; 1 the broker or database did not answer (or has no schema), or
some ids were not dead letters of the group; 2 bad arguments (unknown group, no ids
and no --all, ids and --all). A bulk replay shows its progress on stderr; one that
fails part way audits what it replayed and says how far it got.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Annotated, Any, NoReturn, TextIO, TypeVar, cast

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from sqlalchemy.exc import SQLAlchemyError

from roomservice import errors
from roomservice.admin.dead_letters import DeadLetterAdmin, describe, group_row
from roomservice.admin.operations import OutboxAdmin
from roomservice.bootstrap.broker import GroupSpec, consumer_groups, open_broker
from roomservice.cli.options import (
    HELP_MARKUP,
    ConfigOpt,
    DataDirOpt,
    missing_schema_hint,
    private_files,
    settings_from_options,
)
from roomservice.clock import wall_clock_ms
from roomservice.config import Settings
from roomservice.observability.logging import configure_logging

T = TypeVar("T")

broker_app = typer.Typer(
    help="Consumer groups on the broker: lag, dead letters, replay.", no_args_is_help=True, rich_markup_mode=HELP_MARKUP
)
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")]


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


class _Stderr(io.TextIOBase):
    """Whatever ``sys.stderr`` is when a line is written (a test runner swaps it per invocation)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _actor() -> str:
    return os.environ.get("USER", "cli") or "cli"


def _run(config: Path | None, data_dir: Path, work: Callable[[DeadLetterAdmin], Awaitable[T]]) -> T:
    from roomservice.store.migrate import opened_database, sqlite_file

    private_files()
    settings: Settings = settings_from_options(config, data_dir.expanduser().resolve())
    # log lines (the broker opening) go to stderr: stdout is the answer (--json)
    configure_logging(level=settings.logging.level, json=settings.logging.json, file=cast(TextIO, _Stderr()))
    groups = consumer_groups(settings)
    url = settings.database.connect_url()
    path = sqlite_file(url)
    if settings.broker.driver == "embedded" and path is not None and not path.is_file():
        _fail(f"no database at {path}: the embedded broker lives there (give the service's --data-dir or --config)")

    async def main() -> T:
        async with (
            opened_database(url, migrate=False, pool_size=2, max_overflow=2) as db,
            AsyncExitStack() as stack,
        ):
            broker = await open_broker(settings, db=db, clock=wall_clock_ms, stack=stack)
            return await work(DeadLetterAdmin(broker, groups, audit=OutboxAdmin(db, clock=wall_clock_ms)))

    try:
        return asyncio.run(main())
    except (errors.RoomServiceError, SQLAlchemyError) as exc:  # one line, never a traceback
        _fail(str(exc) + missing_schema_hint(exc), 1)


def _group(groups: list[GroupSpec], name: str) -> GroupSpec:
    for spec in groups:
        if spec.group == name:
            return spec
    known = ", ".join(g.group for g in groups) or "none (no consumer group is enabled)"
    _fail(f"unknown consumer group {name!r}; this configuration runs: {known}")


@broker_app.command("groups")
def groups_command(config: ConfigOpt = None, data_dir: DataDirOpt = Path("var"), as_json: JsonOpt = False) -> None:
    """Each enabled consumer group: its topic, lag, deliveries in flight and dead letters."""

    async def work(admin: DeadLetterAdmin) -> list[dict[str, Any]]:
        return [group_row(spec, await admin.broker.group_stats(spec.topic, spec.group)) for spec in admin.groups]

    rows = _run(config, data_dir, work)
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        typer.echo("no consumer group is enabled in this configuration")
    for r in rows:
        typer.echo(
            f"{r['group']}  topic={r['topic']}  lag={r['lag']}  in_flight={r['in_flight']}  "
            f"dead_letters={r['dead_letters']}  max_deliveries={r['max_deliveries']}"
        )


@broker_app.command("dead-letters")
def dead_letters_command(
    group: Annotated[str, typer.Argument(metavar="GROUP", help="Consumer group name.")],
    limit: Annotated[int, typer.Option(min=1, max=10_000, help="At most this many, oldest first.")] = 100,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = Path("var"),
    as_json: JsonOpt = False,
) -> None:
    """The dead letters of one group, oldest first."""

    async def work(admin: DeadLetterAdmin) -> list[dict[str, Any]]:
        spec = _group(admin.groups, group)
        letters = await admin.dead_letters(spec.group, limit=limit)
        return [
            {
                "message_id": d.message_id,
                "key": d.key,
                "tag": d.tag,
                "delivery_count": d.delivery_count,
                "dead_at_ms": d.dead_at_ms,
                "reason": d.reason,
            }
            for d in letters
        ]

    rows = _run(config, data_dir, work)
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        typer.echo(f"no dead letters in {group}")
    for r in rows:
        typer.echo(f"{r['message_id']}  {r['tag']}  key={r['key']}  deliveries={r['delivery_count']}  {r['reason']}")


@broker_app.command("show")
def show_command(
    group: Annotated[str, typer.Argument(metavar="GROUP", help="Consumer group name.")],
    message_id: Annotated[str, typer.Argument(metavar="MESSAGE_ID", help="A dead letter of the group.")],
    config: ConfigOpt = None,
    data_dir: DataDirOpt = Path("var"),
    as_json: JsonOpt = False,
) -> None:
    """One dead letter in full: delivery count, last error, and its body decoded."""

    async def work(admin: DeadLetterAdmin) -> dict[str, Any] | None:
        spec = _group(admin.groups, group)
        try:
            return describe(await admin.dead_letter(spec.group, message_id))
        except errors.NotFound:
            return None

    shown = _run(config, data_dir, work)
    if shown is None:
        _fail(f"not a dead letter of {group}: {message_id}", 1)
    if as_json:
        typer.echo(json.dumps(shown, indent=2))
        return
    for name, value in shown.items():
        if isinstance(value, dict):
            typer.echo(f"{name}:")
            for inner, item in value.items():
                typer.echo(f"  {inner}: {json.dumps(item) if isinstance(item, dict | list | tuple) else item}")
        else:
            typer.echo(f"{name}: {value}")


@broker_app.command("replay")
def replay_command(
    group: Annotated[str, typer.Argument(metavar="GROUP", help="Consumer group name.")],
    message_ids: Annotated[list[str] | None, typer.Argument(metavar="MESSAGE_ID...", help="Dead letters.")] = None,
    replay_all: Annotated[bool, typer.Option("--all", help="Every dead letter of the group.")] = False,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = Path("var"),
    as_json: JsonOpt = False,
) -> None:
    """Deliver dead letters to their group again (that group only, same key)."""
    if not message_ids and not replay_all:
        _fail("name the dead letters to replay, or give --all")
    if message_ids and replay_all:
        _fail("give either MESSAGE_ID... or --all, not both")

    async def work(admin: DeadLetterAdmin) -> dict[str, list[str]]:
        spec = _group(admin.groups, group)
        with Progress(
            TextColumn("replaying"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=Console(stderr=True),
        ) as bar:
            task = bar.add_task("replay", total=None)

            def progress(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            result = await admin.replay(
                spec.group, None if replay_all else list(message_ids or []), actor=_actor(), progress=progress
            )
        return {"replayed": list(result.replayed), "not_dead_letters": list(result.not_dead_letters)}

    report = _run(config, data_dir, work)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        typer.echo(f"replayed {len(report['replayed'])} dead letter(s) to {group}")
        for message_id in report["not_dead_letters"]:
            typer.echo(f"not a dead letter of {group}: {message_id}", err=True)
    if report["not_dead_letters"]:
        raise typer.Exit(1)
