"""``room-service outbox …``: dead-letter administration from the command line.

    room-service outbox stats [--json]
    room-service outbox list [--status S]... [--type T] [--app A] [--room R]
                             [--older-than 10m] [--newer-than 1h] [--error TEXT]
                             [--limit N] [--after-id ID] [--json]
    room-service outbox show EVENT_ID [--json]
    room-service outbox replay EVENT_ID... [--as-repair [--target T]...] [--json]
    room-service outbox replay --status failed [filters] [--as-repair [--target T]...] [--yes] [--json]

Every command takes --config and --data-dir like serve and opens the
configured database itself (never migrating it: ``room-service db upgrade`` does).
They work on rows that exist, so they never create a database: a SQLite file
that does not exist (the wrong --data-dir or working directory, usually) is an
error naming the path, and nothing is created. Durations are Go strings
("10m", "1h30m").

Exit codes: 0 done; 1 some rows were not replayed (not in status failed, or unknown
ids beside rows that were replayed), the confirmation was declined or the database is
unavailable; 2 bad arguments (unknown event ids and nothing replayed, bad duration or
status, nothing to replay, no database at the configured path) with a one-line
message on stderr.

An EVENT_ID, --type, --app or --room outside the domain's patterns
(``domain/limits.py``) is a bad argument too, refused before the database is
opened: MariaDB cannot compare it with its ascii_bin column and failed the
query, which read as "database unavailable" (exit 1).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console, JustifyMethod
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from sqlalchemy.exc import SQLAlchemyError

from roomservice import errors
from roomservice.admin.operations import (
    LEGACY_STATUSES,
    OutboxAdmin,
    OutboxFilter,
    OutboxRowDetail,
    OutboxRowView,
    OutboxStats,
    ReplayInterrupted,
    ReplayReport,
    check_event_ids,
    repair_targets,
)
from roomservice.cli.options import (
    HELP_MARKUP,
    ConfigOpt,
    DataDirOpt,
    missing_schema_hint,
    private_files,
    settings_from_options,
)
from roomservice.clock import wall_clock_ms
from roomservice.durations import format_duration

T = TypeVar("T")

outbox_app = typer.Typer(
    help="Outbox dead letters: stats, list, show and replay rows of room_outbox.",
    no_args_is_help=True,
    rich_markup_mode=HELP_MARKUP,
)

JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")]
StatusOpt = Annotated[
    list[str] | None,
    typer.Option("--status", "-s", help="Status word (repeat, or comma-separate, for several)."),
]
TypeOpt = Annotated[str | None, typer.Option("--type", help="Event type, e.g. RoomGiftSent.")]
AppOpt = Annotated[str | None, typer.Option("--app", help="App code.")]
RoomOpt = Annotated[str | None, typer.Option("--room", help="Room id.")]
OlderOpt = Annotated[str | None, typer.Option("--older-than", help='Created at least this long ago ("10m").')]
NewerOpt = Annotated[str | None, typer.Option("--newer-than", help='Created at most this long ago ("1h").')]
ErrorOpt = Annotated[str | None, typer.Option("--error", help="Text in last_error (case-insensitive).")]

_WIDE = 200  # table width when stdout is not a terminal (pipes, logs, tests)


def _console(*, stderr: bool = False) -> Console:
    console = Console(stderr=stderr)
    if not console.is_terminal:
        console = Console(stderr=stderr, width=_WIDE)
    return console


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _actor() -> str:
    return os.environ.get("USER", "cli") or "cli"


def _run(config: Path | None, data_dir: Path, work: Callable[[OutboxAdmin], Awaitable[T]]) -> T:
    """Open the configured database, run ``work`` against an :class:`OutboxAdmin`, close it."""
    from roomservice.config import ConfigError
    from roomservice.store.migrate import opened_database, sqlite_file
    from roomservice.store.port import StoreUnavailable

    private_files()
    settings = settings_from_options(config, data_dir.expanduser().resolve())
    try:
        url = settings.database.connect_url()
    except ConfigError as exc:
        _fail(f"config error: {exc}")
    path = sqlite_file(url)
    if path is not None and not path.is_file():  # opening would create it, empty, and its directory
        _fail(
            f"no database at {path}: nothing to read (run from the service's directory, "
            "or give its --data-dir or --config)"
        )

    async def main() -> T:
        # never migrated from here: an admin command of a newer release must not upgrade the schema under
        # the servers that run on it (room-service db upgrade does that, on purpose)
        async with opened_database(url, migrate=False, pool_size=2, max_overflow=2) as db:
            return await work(OutboxAdmin(db, clock=wall_clock_ms))

    try:
        return asyncio.run(main())
    except (errors.NotFound, errors.InvalidArgument) as exc:
        _fail(exc.message)
    except ConfigError as exc:
        _fail(f"config error: {exc}")
    except (StoreUnavailable, errors.Unavailable, errors.Retry, SQLAlchemyError) as exc:
        _fail(str(exc) + missing_schema_hint(exc), 1)


def _filter(
    statuses: list[str] | None,
    event_type: str | None,
    app: str | None,
    room: str | None,
    older_than: str | None,
    newer_than: str | None,
    error: str | None,
) -> OutboxFilter:
    try:
        return OutboxFilter.parse(
            statuses=statuses or [],
            event_type=event_type,
            app_code=app,
            room_id=room,
            older_than=older_than,
            newer_than=newer_than,
            error_contains=error,
            names={
                "older_than": "--older-than",
                "newer_than": "--newer-than",
                "event_type": "--type",
                "app_code": "--app",
                "room_id": "--room",
            },
        )
    except errors.InvalidArgument as exc:
        _fail(exc.message)


def _event_ids(event_ids: list[str]) -> None:
    """Fail (exit 2) on an EVENT_ID no row can have, before opening the database (module docstring)."""
    try:
        check_event_ids(event_ids, name="EVENT_ID")
    except errors.InvalidArgument as exc:
        _fail(exc.message)


def _echo_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2, ensure_ascii=False))


def _age(ms: int | None) -> str:
    if ms is None:
        return "-"
    if ms < 1000:
        return f"{ms}ms"
    return format_duration(timedelta(seconds=ms // 1000))


def _clip(text: str | None, width: int = 60) -> str:
    if not text:
        return ""
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


# --------------------------------------------------------------------------- commands


@outbox_app.command("stats")
def stats_command(config: ConfigOpt = None, data_dir: DataDirOpt = Path("var"), as_json: JsonOpt = False) -> None:
    """Rows per status and the age of the oldest pending (and retryable) row."""
    result = _run(config, data_dir, lambda admin: admin.stats())
    if as_json:
        _echo_json(result.to_dict())
        return
    _print_stats(result)


@outbox_app.command("list")
def list_command(
    status: StatusOpt = None,
    event_type: TypeOpt = None,
    app: AppOpt = None,
    room: RoomOpt = None,
    older_than: OlderOpt = None,
    newer_than: NewerOpt = None,
    error: ErrorOpt = None,
    limit: Annotated[int, typer.Option("--limit", "-n", help="Rows per page (1..1000).")] = 50,
    after_id: Annotated[int | None, typer.Option("--after-id", help="Next page: rows after this id.")] = None,
    as_json: JsonOpt = False,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = Path("var"),
) -> None:
    """Rows matching every given filter, oldest id first."""
    flt = _filter(status, event_type, app, room, older_than, newer_than, error)
    rows = _run(config, data_dir, lambda admin: admin.list(flt, limit=limit, after_id=after_id))
    if as_json:
        _echo_json([r.to_dict() for r in rows])
        return
    _print_rows(rows, limit)


@outbox_app.command("show")
def show_command(
    event_id: Annotated[str, typer.Argument(help="The event_id of the row.")],
    as_json: JsonOpt = False,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = Path("var"),
) -> None:
    """Every column of one row, its decoded event and its audit trail."""
    _event_ids([event_id])
    detail = _run(config, data_dir, lambda admin: admin.show(event_id))
    if as_json:
        _echo_json(detail.to_dict())
        return
    _print_detail(detail)


@outbox_app.command("replay")
def replay_command(
    event_ids: Annotated[
        list[str] | None, typer.Argument(metavar="EVENT_ID", help="event_ids of failed rows.", show_default=False)
    ] = None,
    status: Annotated[
        str | None, typer.Option("--status", "-s", help="Bulk replay: must be 'failed'; combine with filters.")
    ] = None,
    event_type: TypeOpt = None,
    app: AppOpt = None,
    room: RoomOpt = None,
    older_than: OlderOpt = None,
    newer_than: NewerOpt = None,
    error: ErrorOpt = None,
    as_repair: Annotated[
        bool, typer.Option("--as-repair", help="Write a new repair event (new event_id) instead of requeuing.")
    ] = False,
    targets: Annotated[
        list[str] | None,
        typer.Option(
            "--target",
            "-t",
            metavar="TARGET",
            help="With --as-repair: send the repair to this target only (repeat, or comma-separate): "
            "im, activity, broker, treasure_wakeup. Default: the targets the original had not reached.",
            show_default=False,
        ),
    ] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Bulk replay without asking.")] = False,
    as_json: JsonOpt = False,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = Path("var"),
) -> None:
    """Requeue failed rows under their own event_id (or, with --as-repair, as new repair events)."""
    has_filters = any(v is not None for v in (event_type, app, room, older_than, newer_than, error))
    if targets and not as_repair:
        _fail("--target applies to --as-repair only: a plain replay sends what the row has not delivered")
    try:
        chosen = repair_targets(targets, as_repair=as_repair)
    except errors.InvalidArgument as exc:
        _fail(f"--target: {exc.message}")
    if event_ids:
        if status is not None or has_filters:
            _fail("give either EVENT_ID... or --status failed with filters, not both")
        _event_ids(event_ids)
        report, stopped = _run(
            config,
            data_dir,
            lambda admin: _partial(admin.replay(event_ids, actor=_actor(), as_repair=as_repair, targets=chosen)),
        )
        _finish_replay(report, as_json=as_json, bulk=False, stopped=stopped)
        return
    if status is None:
        _fail("nothing to replay: give EVENT_ID... or --status failed [filters]")
    if status.strip() != "failed":
        _fail(f"replay takes only --status failed (dead letters), not {status!r}")
    flt = _filter(["failed"], event_type, app, room, older_than, newer_than, error)
    report, stopped = _run(
        config,
        data_dir,
        lambda admin: _partial(_bulk_replay(admin, flt, as_repair=as_repair, targets=chosen, yes=yes)),
    )
    _finish_replay(report, as_json=as_json, bulk=True, stopped=stopped)


async def _partial(work: Awaitable[ReplayReport]) -> tuple[ReplayReport, ReplayInterrupted | None]:
    """The replay's report; when a later batch failed, the committed batches' report and why it stopped."""
    try:
        return await work, None
    except ReplayInterrupted as exc:
        return exc.report, exc


async def _bulk_replay(
    admin: OutboxAdmin, flt: OutboxFilter, *, as_repair: bool, targets: frozenset[str] | None, yes: bool
) -> ReplayReport:
    matching = await admin.count(flt)
    if matching == 0:
        return ReplayReport(as_repair=as_repair, targets=targets)
    if not yes:
        what = "write repair events for" if as_repair else "replay"
        if targets is not None:
            what += f" (to {', '.join(sorted(targets))} only)"
        if not typer.confirm(f"{what} {matching} failed row(s)?", default=False, err=True):
            _fail("aborted: nothing was replayed", 1)
    with Progress(
        TextColumn("replaying"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=_console(stderr=True),
    ) as bar:
        task = bar.add_task("replay", total=matching)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        return await admin.replay_matching(flt, actor=_actor(), as_repair=as_repair, targets=targets, progress=progress)


# --------------------------------------------------------------------------- output


def _print_stats(stats: OutboxStats) -> None:
    console = _console()
    table = Table(title=f"room_outbox: {stats.total} row(s)")
    table.add_column("status")
    table.add_column("rows", justify="right")
    for status, count in stats.counts.items():
        label = f"{status} (legacy)" if status in LEGACY_STATUSES else status
        table.add_row(label, str(count))
    console.print(table)
    console.print(f"oldest pending: {_age(stats.oldest_pending_age_ms)}")
    console.print(f"oldest retryable: {_age(stats.oldest_retryable_age_ms)}")


def _print_rows(rows: list[OutboxRowView], limit: int) -> None:
    console = _console()
    if not rows:
        console.print("no matching rows")
        return
    table = Table()
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("id", "right"),
        ("event_id", "left"),
        ("status", "left"),
        ("type", "left"),
        ("app", "left"),
        ("room", "left"),
        ("ver", "right"),
        ("retries", "right"),
        ("replays", "right"),
        ("age", "right"),
        ("last_error", "left"),
    )
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=name != "last_error")
    for r in rows:
        table.add_row(
            str(r.id),
            r.event_id,
            r.status,
            r.event_type,
            r.app_code,
            r.room_id,
            str(r.room_version),
            str(r.retry_count),
            str(r.replay_count),
            _age(r.age_ms),
            escape(_clip(r.last_error)),
        )
    console.print(table)
    console.print(f"{len(rows)} row(s)")
    if len(rows) == limit:
        console.print(f"more may follow: --after-id {rows[-1].id}")


def _print_detail(detail: OutboxRowDetail) -> None:
    console = _console()
    table = Table(title=f"outbox row {detail.row.event_id}", show_header=False)
    table.add_column("column", style="bold")
    table.add_column("value")
    for key, value in detail.row.to_dict().items():
        if key == "targets_done":
            value = ",".join(value)
        table.add_row(key, escape("" if value is None else str(value)))
    table.add_row("payload", f"{len(detail.payload)} bytes")
    console.print(table)
    if detail.event is not None:
        console.print("event:")
        console.print_json(json.dumps(detail.event, ensure_ascii=False))
    else:
        console.print(f"event: payload does not decode ({escape(detail.decode_error or '?')})")
    if not detail.audit:
        console.print("audit: none")
        return
    audit = Table(title="audit")
    for name in ("at_ms", "action", "actor", "detail"):
        audit.add_column(name)
    for a in detail.audit:
        audit.add_row(str(a.created_at_ms), a.action, escape(a.actor), escape(a.detail or ""))
    console.print(audit)


def _finish_replay(
    report: ReplayReport, *, as_json: bool, bulk: bool, stopped: ReplayInterrupted | None = None
) -> None:
    if as_json:
        body = report.to_dict()
        if stopped is not None:  # what was done, and why it stopped (the error shape of SPEC §8)
            body["error"] = stopped.to_body()["error"]
        _echo_json(body)
    else:
        console = _console()
        if bulk:
            if not report.outcomes:
                console.print("no failed rows match: nothing to replay")
            verb = "repaired" if report.as_repair else "replayed"
            if report.outcomes:
                console.print(f"{verb} {report.replayed} of {len(report.outcomes)} failed row(s)")
            for o in report.outcomes:
                if o.result != "replayed" or o.new_event_id:
                    console.print(escape(o.message))
        else:
            for o in report.outcomes:
                console.print(f"{o.result}: {escape(o.message)}")
    if stopped is not None:
        _fail(stopped.message, 1)
    if report.not_found:
        missing = ", ".join(o.event_id for o in report.outcomes if o.result == "not_found")
        if report.replayed:  # the others were replayed: a partial outcome, not an argument refused as a whole
            _fail(f"replayed {report.replayed}; no outbox row with event_id {missing}", 1)
        _fail(f"no outbox row with event_id {missing}")
    if report.replayed != len(report.outcomes):
        raise typer.Exit(1)
