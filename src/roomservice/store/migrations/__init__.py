"""Alembic migrations of the room-service schema (run them with ``room-service db upgrade``)."""
