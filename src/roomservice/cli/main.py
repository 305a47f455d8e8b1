"""``room-service``: serve the API, run migrations.

    room-service serve [--config FILE] [--host H] [--port P] [--data-dir DIR]
    room-service worker [--config FILE] [--data-dir DIR]
    room-service db upgrade [--config FILE] [--data-dir DIR]
    room-service outbox stats|list|show|replay ...
    room-service activity serve [--config FILE] [--data-dir DIR] [--host H] [--port P]
    room-service im-sandbox [--host H] [--port P] [--sdk-app-id N] [--secret-key-env VAR]

With no ``--config`` the packaged ``configs/local.yaml`` is used: SQLite at
``<data-dir>/room.db`` (data dir ``./var``), everything in process.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Annotated

import typer
import uvicorn

from roomservice.admin.cli import outbox_app
from roomservice.cli.config_cmd import config_app
from roomservice.cli.options import ConfigOpt, DataDirOpt, admin_token, settings_from_options
from roomservice.config import Settings

app = typer.Typer(help="room-service: live voice-chat rooms with a transactional outbox.", no_args_is_help=True)
db_app = typer.Typer(help="Database maintenance.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(outbox_app, name="outbox")
app.add_typer(config_app, name="config")
activity_app = typer.Typer(help="The reference activity service (gRPC).", no_args_is_help=True)
app.add_typer(activity_app, name="activity")


@app.command()
def serve(
    config: ConfigOpt = None,
    host: Annotated[str | None, typer.Option(help="Bind address (overrides http.host).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (overrides http.port; 0 = any free port).")] = None,
    data_dir: DataDirOpt = Path("var"),
) -> None:
    """Run the HTTP API with Room Cells and every in-process part the config enables."""
    data_dir = data_dir.expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
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


async def _serve(settings: Settings, *, host: str, port: int, token: str, data_dir: Path) -> None:
    from roomservice.api.app import ApiContext, create_app
    from roomservice.observability.logging import get_logger
    from roomservice.bootstrap import Process

    log = get_logger("roomservice.cli")
    async with Process.running(settings) as runtime:
        api = create_app(
            ApiContext(
                service=runtime.service,
                health=runtime.health,
                admin_token=token,
                outbox_admin=runtime.outbox_admin,
                metrics=settings.metrics.enabled,
            )
        )
        server = uvicorn.Server(
            uvicorn.Config(api, host=host, port=port, log_config=None, access_log=False, lifespan="off")
        )
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done():  # noqa: ASYNC110 - uvicorn exposes only a flag
            await asyncio.sleep(0.05)
        if server.started:
            bound = [s.getsockname() for srv in server.servers for s in (srv.sockets or [])]
            actual_port = bound[0][1] if bound else port
            (data_dir / "http-port").write_text(f"{actual_port}\n")
            log.info("serving", host=host, port=actual_port, data_dir=str(data_dir))
        await serving


@app.command()
def worker(config: ConfigOpt = None, data_dir: DataDirOpt = Path("var")) -> None:
    """Run the outbox worker, the treasure timer and retention alone, without the HTTP API.

    Several worker processes may run against one database; SIGTERM stops one
    gracefully and hands its unfinished claims back.
    """
    data_dir = data_dir.expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    settings = settings_from_options(config, data_dir)
    if not settings.outbox_worker.enabled:
        typer.echo("config error: outbox_worker.enabled is false; nothing to run", err=True)
        raise typer.Exit(2)
    from roomservice.observability.logging import configure_logging

    configure_logging(level=settings.logging.level, json=settings.logging.json)
    asyncio.run(_work(settings))


async def _work(settings: Settings) -> None:
    import signal

    from roomservice.observability.logging import get_logger
    from roomservice.bootstrap import WORKER_ROLES, Process

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with Process.running(settings, roles=WORKER_ROLES):
        get_logger("roomservice.cli").info("worker_running", publish_mode=settings.outbox_worker.publish_mode)
        await stop.wait()


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

    The bound port is written to ``<data-dir>/activity-port``; SIGTERM/SIGINT stop it gracefully.
    """
    data_dir = data_dir.expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
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
    import signal

    from roomservice.activity.service import running_activity_service
    from roomservice.observability.logging import get_logger
    from roomservice.store.migrate import opened_database

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
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
        (data_dir / "activity-port").write_text(f"{service.port}\n")
        get_logger("roomservice.cli").info("activity_serving", target=service.target, database=db.dialect_name)
        await stop.wait()


@app.command("im-sandbox")
def im_sandbox(
    host: Annotated[str, typer.Option(help="Bind address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0 = any free port).")] = 0,
    sdk_app_id: Annotated[int, typer.Option("--sdk-app-id", help="The SDKAppID the sandbox serves.")] = 1400000000,
    secret_key_env: Annotated[
        str, typer.Option("--secret-key-env", help="Environment variable holding the app's secret key.")
    ] = "TENCENT_IM_SECRET_KEY",
    admin_identifier: Annotated[
        list[str] | None, typer.Option("--admin-identifier", help="App admin identifier (repeatable).")
    ] = None,
) -> None:
    """Run the Tencent IM sandbox alone: the REST subset room-service uses, plus /_sandbox/ controls.

    UserSigs are checked with the secret key read from the environment (never from the
    command line). Prints the base URL once listening; SIGTERM/SIGINT stop it.
    """
    secret_key = os.environ.get(secret_key_env, "")
    if not secret_key:
        typer.echo(f"error: environment variable {secret_key_env} is not set (the IM app's secret key)", err=True)
        raise typer.Exit(2)
    from roomservice.observability.logging import configure_logging

    configure_logging()
    admins = tuple(admin_identifier or ["administrator"])
    try:
        asyncio.run(_im_sandbox(host=host, port=port, sdk_app_id=sdk_app_id, secret_key=secret_key, admins=admins))
    except OSError as exc:  # the address is taken or cannot be bound
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc


async def _im_sandbox(host: str, port: int, sdk_app_id: int, secret_key: str, admins: tuple[str, ...]) -> None:
    import signal

    from roomservice.integrations.im_sandbox import RunningSandbox, run_sandbox
    from roomservice.observability.logging import get_logger

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def started(sandbox: RunningSandbox) -> None:
        typer.echo(sandbox.base_url)
        get_logger("roomservice.cli").info(
            "im_sandbox_serving", base_url=sandbox.base_url, sdk_app_id=sdk_app_id, admins=list(admins)
        )

    await run_sandbox(
        host,
        port,
        sdk_app_id=sdk_app_id,
        secret_key=secret_key,
        admin_identifiers=admins,
        stop=stop,
        on_started=started,
    )


@db_app.command("upgrade")
def db_upgrade(config: ConfigOpt = None, data_dir: DataDirOpt = Path("var")) -> None:
    """Apply all database migrations."""
    from roomservice.store.migrate import upgrade_url

    data_dir = data_dir.expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    settings = settings_from_options(config, data_dir)
    upgrade_url(settings.database.connect_url())
    typer.echo("database is up to date")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
