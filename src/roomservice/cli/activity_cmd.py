"""``room-service activity leaderboard`` and ``rewards``: what the activity effects wrote, read from the database.

The activity group (mq mode) and the reference activity service (direct mode)
write the same tables, so this shows a gift reaching the leaderboard whichever
path carried it.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Literal

import typer

from roomservice.activity.store import ActivityStore
from roomservice.cli.options import ConfigOpt, DataDirOpt, private_files, settings_from_options
from roomservice.clock import wall_clock_ms
from roomservice.domain.state import utc_day


def leaderboard_command(
    app_code: Annotated[str, typer.Argument(metavar="APP", help="App code.")],
    room_id: Annotated[str, typer.Argument(metavar="ROOM", help="Room id.")],
    board: Annotated[
        Literal["sent", "received"], typer.Option(help="Senders (sent) or receivers (received).")
    ] = "received",
    day: Annotated[int | None, typer.Option(help="UTC day, as days since the epoch (default: today).")] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="At most this many entries.")] = 20,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = Path("var"),
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")] = False,
) -> None:
    """A room's gift leaderboard of one UTC day."""
    from roomservice.store.migrate import opened_database, sqlite_file

    private_files()
    settings = settings_from_options(config, data_dir.expanduser().resolve())
    url = settings.database.connect_url()
    path = sqlite_file(url)
    if path is not None and not path.is_file():
        typer.echo(f"error: no database at {path} (give the service's --data-dir or --config)", err=True)
        raise typer.Exit(2)
    the_day = day if day is not None else utc_day(wall_clock_ms())

    async def main() -> list[tuple[str, int]]:
        async with opened_database(url, migrate=False, pool_size=1, max_overflow=0) as db:
            entries = await ActivityStore(db).gift_leaderboard(
                app_code=app_code, room_id=room_id, day=the_day, board=board, limit=limit
            )
            return [(e.user_id, e.value) for e in entries]

    rows = asyncio.run(main())
    if as_json:
        typer.echo(json.dumps([{"user_id": u, "value": v} for u, v in rows]))
        return
    if not rows:
        typer.echo(f"no gifts {board} in {app_code}/{room_id} on {the_day}")
    for rank, (user, value) in enumerate(rows, start=1):
        typer.echo(f"{rank:>3}. {user}  {value}")
