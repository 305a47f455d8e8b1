"""Logs, command timing and metrics."""
