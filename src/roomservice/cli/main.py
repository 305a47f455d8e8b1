"""room-service: serve the API, run workers and migrations, administer the outbox.

    room-service serve [--config FILE] [--host H] [--port P] [--data-dir DIR]
    room-service worker [--config FILE] [--data-dir DIR]
    room-service db upgrade [--config FILE] [--data-dir DIR]
    room-service outbox stats|list|show|replay ...
    room-service activity serve [--config FILE] [--data-dir DIR] [--host H] [--port P]
    room-service im-sandbox [--host H] [--port P] [--sdk-app-id N] [--secret-key-env VAR] [--state-dir DIR]

With no --config the packaged configs/local.yaml is used: SQLite at
<data-dir>/room.db (data dir ./var), everything in process. The data dir is
created 0700 and every file this process creates is 0600.

serve and worker stop gracefully on SIGTERM or SIGINT and exit 0: serve stops
accepting connections and lets the requests in flight answer (up to
HTTP_DRAIN_S); then the outbox worker finishes or hands back its claims. A stop
that takes longer than its deadline, or a second signal, exits 1 at once (see
roomservice.cli.shutdown).

Help texts here are shown by --help as written: plain words, no markup.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Final

import typer
import uvicorn

from roomservice.admin.broker_cli import broker_app
from roomservice.admin.cli import outbox_app
from roomservice.cli.activity_cmd import leaderboard_command
from roomservice.cli.collector import settle_after_start
from roomservice.cli.config_cmd import config_app
from roomservice.cli.options import (
    HELP_MARKUP,
    ConfigOpt,
    DataDirOpt,
    admin_token,
    prepare_data_dir,
    restrict_database_files,
    settings_from_options,
)
from roomservice.cli.shutdown import GracefulStop
from roomservice.config import Settings

if TYPE_CHECKING:
    from roomservice.bootstrap import Process
    from roomservice.console import Console

HTTP_DRAIN_S: Final = 10  # a stopping server lets requests in flight answer this long, then cancels them
STOP_MARGIN_S: Final = 10.0  # for the rest of a stop (loops, cells, database) beyond the drain and worker grace

app = typer.Typer(
    help="room-service: live voice-chat rooms with a transactional outbox.",
    no_args_is_help=True,
    rich_markup_mode=HELP_MARKUP,
)
db_app = typer.Typer(help="Database maintenance.", no_args_is_help=True, rich_markup_mode=HELP_MARKUP)
app.add_typer(db_app, name="db")
app.add_typer(outbox_app, name="outbox")
app.add_typer(config_app, name="config")
app.add_typer(broker_app, name="broker")
activity_app = typer.Typer(
    help="The reference activity service (gRPC).", no_args_is_help=True, rich_markup_mode=HELP_MARKUP
)
app.add_typer(activity_app, name="activity")
activity_app.command("leaderboard")(leaderboard_command)


@app.command()
def serve(
    config: ConfigOpt = None,
    host: Annotated[str | None, typer.Option(help="Bind address (overrides http.host).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (overrides http.port; 0 = any free port).")] = None,
    data_dir: DataDirOpt = Path("var"),
) -> None:

    """Run the HTTP API with Room Cells and every in-process part the config enables.

    The gRPC room API runs beside it on grpc.host and grpc.port (0 = any free
    port; the bound port is written to the file grpc-port in the data dir).

    SIGTERM or SIGINT stops it gracefully: no new connections, requests in flight
    answer, outbox claims are handed back, exit status 0.
    """
    data_dir = prepare_data_dir(data_dir)
    settings = settings_from_options(config, data_dir)
    from roomservice.observability.logging import configure_logging

    configure_logging(level=settings.logging.level, json=settings.logging.json)
    token = admin_token(settings, data_dir)
    asyncio.run(
        _serve(
            settings,
            host=host or settings.http.host,
            port=settings.http.port if port is None else port,
            token=token,
            data_dir=data_dir,
        )
    )


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: :class:`GracefulStop` owns SIGTERM/SIGINT.

    uvicorn's ``capture_signals`` re-raises a captured signal once ``serve()`` returns,
    which kills the process before the runtime stops (no claims handed back, exit 143).
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _stop_deadline_s(settings: Settings, *, http: bool) -> float:
    """How long a graceful stop may take before the process gives up and exits 1."""
    worker_grace = settings.outbox_worker.publish_timeout.total_seconds()
    return (HTTP_DRAIN_S if http else 0.0) + worker_grace + STOP_MARGIN_S


def _console(runtime: Process, token: str) -> Console | None:
    """The operators' console of this process (console.enabled), its chart sampled in the background."""
    if not runtime.settings.console.enabled:
        return None
    from roomservice.console import Console

    console = Console.from_process(runtime, admin_token=token)
    runtime.core.spawn("console-sampler", console.sample())
    runtime.core.stack.push_async_callback(console.jobs.aclose)
    return console


async def _serve(settings: Settings, *, host: str, port: int, token: str, data_dir: Path) -> None:
    from roomservice.admin.dead_letters import DeadLetterAdmin
    from roomservice.api.app import ApiContext, create_app
    from roomservice.api.server import HTTP_PROTOCOL
    from roomservice.bootstrap import Process
    from roomservice.observability.logging import get_logger

    log = get_logger("roomservice.cli")
    stop = GracefulStop(deadline_s=_stop_deadline_s(settings, http=True)).install()
    async with Process.running(settings, room_api=True) as runtime:
        restrict_database_files(settings)
        assert runtime.commands is not None and runtime.room_api is not None
        (data_dir / "grpc-port").write_text(f"{runtime.room_api.port}\n")
        api = create_app(
            ApiContext(
                service=runtime.service,
                health=runtime.health,
                admin_token=token,
                outbox_admin=runtime.outbox_admin,
                metrics=settings.metrics.enabled,
                body_read_timeout_s=settings.http.body_read_timeout.total_seconds(),
                forwarder=runtime.commands.forwarder,
                console=_console(runtime, token),
                consumer_groups=DeadLetterAdmin.of_process(runtime),
                consumer_counts=runtime.consumers.counts if runtime.consumers is not None else None,
            )
        )
        server = _Server(
            uvicorn.Config(
                api,
                host=host,
                port=port,
                log_config=None,
                access_log=False,
                lifespan="off",
                http=HTTP_PROTOCOL,  # uvicorn's own 400s in the error shape
                timeout_graceful_shutdown=HTTP_DRAIN_S,
            )
        )
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done():  # noqa: ASYNC110 - uvicorn exposes only a flag
            await asyncio.sleep(0.05)
        if server.started:
            bound = [s.getsockname() for srv in server.servers for s in (srv.sockets or [])]
            actual_port = bound[0][1] if bound else port
            (data_dir / "http-port").write_text(f"{actual_port}\n")
            log.info("serving", host=host, port=actual_port, data_dir=str(data_dir))
            settle_after_start()
        stopping = asyncio.create_task(stop.requested.wait())
        try:
            await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        # close the listener, let the requests in flight answer (up to HTTP_DRAIN_S), then
        # leave the block: the runtime stops its loops and hands outbox claims back
        server.should_exit = True
        await serving
    stop.complete()


@app.command()
def worker(config: ConfigOpt = None, data_dir: DataDirOpt = Path("var")) -> None:
    """Run the outbox worker, the treasure timer and retention alone, without the HTTP API.

    Several worker processes may run against one database; SIGTERM or SIGINT stops
    one gracefully (its unfinished claims are handed back) with exit status 0. With
    lease.driver redis it serves the gRPC room API on grpc.host and grpc.port (the
    bound port is written to the file grpc-port in the data dir): the room leases
    its timers take name that address, and the other processes forward there.
    """
    data_dir = prepare_data_dir(data_dir)
    settings = settings_from_options(config, data_dir)
    if not settings.outbox_worker.enabled:
        typer.echo("config error: outbox_worker.enabled is false; nothing to run", err=True)
        raise typer.Exit(2)
    from roomservice.observability.logging import configure_logging

    configure_logging(level=settings.logging.level, json=settings.logging.json)
    asyncio.run(_work(settings, data_dir))


async def _work(settings: Settings, data_dir: Path) -> None:
    from roomservice.bootstrap import WORKER_ROLES, Process
    from roomservice.observability.logging import get_logger

    stop = GracefulStop(deadline_s=_stop_deadline_s(settings, http=False)).install()
    async with Process.running(settings, roles=WORKER_ROLES) as runtime:
        restrict_database_files(settings)
        _write_grpc_port(runtime, data_dir)
        get_logger("roomservice.cli").info("worker_running", publish_mode=settings.outbox_worker.publish_mode)
        settle_after_start()
        await stop.requested.wait()
    stop.complete()


@app.command()
def consume(
    group: Annotated[
        list[str] | None,
        typer.Option("--group", "-g", metavar="GROUP", help="Run only this enabled group (repeat for several)."),
    ] = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = Path("var"),
) -> None:
    """Run the broker's consumer groups that the configuration enables, without HTTP or the outbox worker.

    Several consume processes may run the same groups: the broker shares a
    group's messages between them. SIGTERM or SIGINT lets the deliveries in
    flight finish; the rest come back after their visibility timeout. With
    lease.driver redis, a process running the treasure-open group serves the gRPC
    room API as worker does (its room leases name that address).
    """
    from roomservice.bootstrap.broker import consumer_groups

    data_dir = prepare_data_dir(data_dir)
    settings = settings_from_options(config, data_dir)
    enabled = [spec.group for spec in consumer_groups(settings)]
    if not enabled:
        typer.echo("config error: no consumer group is enabled in this configuration; nothing to run", err=True)
        raise typer.Exit(2)
    unknown = sorted(set(group or ()) - set(enabled))
    if unknown:
        typer.echo(f"error: not an enabled group: {', '.join(unknown)} (enabled: {', '.join(enabled)})", err=True)
        raise typer.Exit(2)
    from roomservice.observability.logging import configure_logging

    configure_logging(level=settings.logging.level, json=settings.logging.json)
    asyncio.run(_consume(settings, frozenset(group or enabled), data_dir))


async def _consume(settings: Settings, groups: frozenset[str], data_dir: Path) -> None:
    from roomservice.bootstrap import CONSUME_ROLES, Process
    from roomservice.observability.logging import get_logger

    stop = GracefulStop(deadline_s=_stop_deadline_s(settings, http=False)).install()
    async with Process.running(settings, roles=CONSUME_ROLES, groups=groups) as runtime:
        restrict_database_files(settings)
        _write_grpc_port(runtime, data_dir)
        get_logger("roomservice.cli").info("consumer_running", groups=sorted(groups))
        settle_after_start()
        await stop.requested.wait()
    stop.complete()


def _write_grpc_port(runtime: Process, data_dir: Path) -> None:
    """A worker or consumer on Redis leases serves the room API (see Process): say where, as serve does."""
    if runtime.room_api is not None:
        (data_dir / "grpc-port").write_text(f"{runtime.room_api.port}\n")


@activity_app.command("serve")
def activity_serve(
    config: ConfigOpt = None,
    host: Annotated[
        str | None, typer.Option(help="Bind address (default: the host of activity.target, else 127.0.0.1).")
    ] = None,
    port: Annotated[
        int | None, typer.Option(help="Port (default: activity.target's port, else 0 = any free port).")
    ] = None,
    data_dir: DataDirOpt = Path("var"),
) -> None:
    """Run the reference activity service alone on the configured database.

    The bound port is written to the file activity-port in the data dir.
    SIGTERM or SIGINT stops it gracefully.
    """
    data_dir = prepare_data_dir(data_dir)
    settings = settings_from_options(config, data_dir)
    target_host, _, target_port = settings.activity.target.rpartition(":")
    if host is None:
        host = target_host.strip("[]") or "127.0.0.1"
    if port is None:
        port = int(target_port) if target_port.isdigit() else 0
    from roomservice.observability.logging import configure_logging

    configure_logging(level=settings.logging.level, json=settings.logging.json)
    try:
        asyncio.run(_activity_serve(settings, host=host, port=port, data_dir=data_dir))
    except OSError as exc:  # the address is taken or cannot be bound
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc


async def _activity_serve(settings: Settings, *, host: str, port: int, data_dir: Path) -> None:
    from roomservice.activity.service import running_activity_service
    from roomservice.clock import wall_clock_ms
    from roomservice.consumers.dedup_retention import activity_purges, dedup_sweeper
    from roomservice.leases.maintenance import DatabaseMaintenanceLock
    from roomservice.observability.logging import get_logger
    from roomservice.store.migrate import opened_database

    stop = GracefulStop(deadline_s=STOP_MARGIN_S).install()
    database = settings.database
    async with (
        opened_database(
            database.connect_url(),
            migrate=database.auto_migrate,
            pool_size=database.pool_size,
            max_overflow=database.max_overflow,
        ) as db,
        running_activity_service(db, host=host, port=port) as service,
    ):
        restrict_database_files(settings)
        (data_dir / "activity-port").write_text(f"{service.port}\n")
        get_logger("roomservice.cli").info("activity_serving", target=service.target, database=db.dialect_name)
        # the processed-event record forgets old ids, as the maintenance role's does
        sweeper = dedup_sweeper(DatabaseMaintenanceLock(db), activity_purges(db), settings, clock=wall_clock_ms)
        sweeping = asyncio.create_task(sweeper.run(interval_s=60.0), name="activity-dedup-retention")
        try:
            await stop.requested.wait()
        finally:
            sweeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeping
    stop.complete()


@app.command("im-sandbox")
def im_sandbox(
    host: Annotated[str, typer.Option(help="Bind address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0 = any free port).")] = 0,
    sdk_app_id: Annotated[int, typer.Option("--sdk-app-id", help="The SDKAppID the sandbox serves.")] = 1400000000,
    secret_key_env: Annotated[
        str, typer.Option("--secret-key-env", help="Environment variable holding the app's secret key.")
    ] = "TENCENT_IM_SECRET_KEY",
    admin_identifier: Annotated[
        list[str] | None, typer.Option("--admin-identifier", metavar="ID", help="App admin identifier (repeatable).")
    ] = None,
    state_dir: Annotated[
        Path | None,
        typer.Option(
            "--state-dir",
            metavar="DIR",
            help="Keep accounts, groups and messages here across restarts (default: memory).",
        ),
    ] = None,
) -> None:
    """Run the Tencent IM sandbox alone: the REST subset room-service uses, plus /_sandbox/ controls.

    UserSigs are checked with the secret key read from the environment (never from the
    command line). Prints the base URL once listening; SIGTERM/SIGINT stop it. With
    --state-dir the state is kept in DIR/im-sandbox-SDKAPPID.sqlite3 (one process at a time).
    """
    secret_key = os.environ.get(secret_key_env, "")
    if not secret_key:
        typer.echo(f"error: environment variable {secret_key_env} is not set (the IM app's secret key)", err=True)
        raise typer.Exit(2)
    from roomservice.observability.logging import configure_logging

    configure_logging()
    admins = tuple(admin_identifier or ["administrator"])
    from roomservice.integrations.im_sandbox import SandboxStateInUse

    try:
        asyncio.run(
            _im_sandbox(
                host=host, port=port, sdk_app_id=sdk_app_id, secret_key=secret_key, admins=admins, state_dir=state_dir
            )
        )
    except (OSError, SandboxStateInUse, ValueError) as exc:  # address taken, state in use or of another app
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc


async def _im_sandbox(
    host: str, port: int, sdk_app_id: int, secret_key: str, admins: tuple[str, ...], state_dir: Path | None
) -> None:
    from roomservice.integrations.im_sandbox import RunningSandbox, run_sandbox
    from roomservice.observability.logging import get_logger

    stop = GracefulStop(deadline_s=STOP_MARGIN_S).install()

    def started(sandbox: RunningSandbox) -> None:
        typer.echo(sandbox.base_url)
        get_logger("roomservice.cli").info(
            "im_sandbox_serving",
            base_url=sandbox.base_url,
            sdk_app_id=sdk_app_id,
            admins=list(admins),
            state=sandbox.state.persistence()["path"] or "memory",
        )

    await run_sandbox(
        host,
        port,
        sdk_app_id=sdk_app_id,
        secret_key=secret_key,
        admin_identifiers=admins,
        stop=stop.requested,
        on_started=started,
        state_dir=state_dir,
    )
    stop.complete()


@db_app.command("upgrade")
def db_upgrade(config: ConfigOpt = None, data_dir: DataDirOpt = Path("var")) -> None:
    """Apply the database migrations not applied yet, and say which."""
    from roomservice.store.migrate import upgrade_url

    data_dir = prepare_data_dir(data_dir)
    settings = settings_from_options(config, data_dir)
    url = settings.database.connect_url()
    report = upgrade_url(url)
    restrict_database_files(settings)
    for applied in report.applied:
        typer.echo(f"applied {applied.revision}: {applied.message}")
    if report.applied:
        typer.echo(f"database is now at {report.current} (head)")
    else:
        typer.echo(f"already at {report.current} (head): nothing to apply")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
