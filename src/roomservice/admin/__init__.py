"""Operator tools: outbox dead-letter operations, their HTTP routes and their CLI."""
