"""Alembic environment: runs migrations on the connection handed over by ``roomservice.store.migrate``.

There is no alembic.ini and no URL here: :func:`roomservice.store.migrate.upgrade`
opens a write transaction on the service's own :class:`Database` and passes its
connection in ``config.attributes["connection"]``.
"""

from __future__ import annotations

from alembic import context

from roomservice.store.tables import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError(
        "run migrations through roomservice.store.migrate (`room-service db upgrade`), not the alembic command line"
    )

context.configure(connection=connection, target_metadata=metadata, compare_type=True)
with context.begin_transaction():
    context.run_migrations()
