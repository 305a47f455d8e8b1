"""Delivery targets of the outbox worker that talk to other services (SPEC §5)."""

from roomservice.publishers.activity import ActivityPublisher

__all__ = ["ActivityPublisher"]
