"""Options and settings loading shared by every ``room-service`` subcommand."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Annotated, Final

import typer

from roomservice.config import ConfigError, Settings, load_settings

HELP_MARKUP: Final = None
"""``rich_markup_mode`` of every Typer app: plain click help. typer 0.29's Rich help panel
prints a type column for flags too (``--json <bool>``, ``--help <bool>``); the plain
formatter shows flags as flags. Help texts are therefore plain words, no markup."""

ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="YAML config file (default: the packaged configs/local.yaml)."),
]
DataDirOpt = Annotated[Path, typer.Option("--data-dir", help="Where the embedded mode keeps its files.")]

PRIVATE_UMASK = 0o077  # files 0600, directories 0700: the data dir holds the database and the admin token


def private_files() -> None:
    """Create every later file of this process readable by its owner only (room.db, its
    -wal and -shm, admin-token, the port files)."""
    os.umask(PRIVATE_UMASK)


def prepare_data_dir(data_dir: Path) -> Path:
    """The absolute data dir, created 0700 if missing; files created from now on are 0600.

    An existing directory keeps its mode (it may be shared on purpose); the database files
    in it are tightened by :func:`restrict_database_files` once the database is open.
    """
    private_files()
    data_dir = data_dir.expanduser().resolve()
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    return data_dir


def restrict_database_files(settings: Settings) -> None:
    """chmod 0600 the SQLite database and its -wal/-shm, which older versions created 0644.

    SQLite creates -wal and -shm with the database file's mode, so this holds for them
    as they come and go."""
    from roomservice.store.migrate import sqlite_file

    path = sqlite_file(settings.database.connect_url())
    if path is None:
        return
    for candidate in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        with contextlib.suppress(FileNotFoundError):
            if candidate.stat().st_mode & 0o077:
                candidate.chmod(0o600)


def settings_from_options(config: Path | None, data_dir: Path) -> Settings:
    if config is not None and not config.is_file():
        raise typer.BadParameter(f"no such file: {config}", param_hint="--config")
    try:
        return load_settings(config).with_data_dir(data_dir)
    except ConfigError as exc:
        typer.echo(f"config error: {exc}", err=True)
        raise typer.Exit(2) from exc


def admin_token(settings: Settings, data_dir: Path) -> str:
    """The configured token, else the one in ``<data-dir>/admin-token``, generated on first start."""
    configured = settings.admin.token.get_secret_value()
    if configured:
        return configured
    path = data_dir / "admin-token"
    if path.is_file():
        token = path.read_text().strip()
        if token:
            return token
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def missing_schema_hint(exc: BaseException) -> str:
    """A hint when the database under the error has no schema (an empty file, a database never migrated)."""
    seen: BaseException | None = exc
    while seen is not None:
        text = str(getattr(seen, "orig", None) or seen)
        if "no such table" in text or "doesn't exist" in text or "1146" in text:
            return f" ({text[:160]}: is the database migrated? room-service db upgrade)"
        seen = seen.__cause__ or seen.__context__
    return ""
