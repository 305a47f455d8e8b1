"""The operators' web console under ``/console/`` (docs/console.md): server-rendered pages over the admin
operations, behind a login with the admin token."""

from roomservice.console.context import Console
from roomservice.console.routes import console_app, mount

__all__ = ["Console", "console_app", "mount"]
