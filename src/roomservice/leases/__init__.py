"""Leases: who owns a room's cell right now (port, in-process adapter, fencing epochs)."""
