"""Options and settings loading shared by every ``room-service`` subcommand."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Annotated

import typer

from roomservice.config import ConfigError, Settings, load_settings

ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="YAML config file (default: the packaged configs/local.yaml)."),
]
DataDirOpt = Annotated[Path, typer.Option("--data-dir", help="Where the embedded mode keeps its files.")]


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
