"""Durable room state: tables, migrations, the SaveMutation unit of work, snapshots, recovery."""
