"""Alembic revision scripts, one per schema change, applied in order by ``roomservice.store.migrate``."""
