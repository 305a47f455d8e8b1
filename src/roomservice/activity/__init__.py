"""The reference activity service (SPEC §5): gift leaderboards and the treasure reward ledger over gRPC."""

from roomservice.activity.service import (
    ActivityServicer,
    RunningActivityService,
    running_activity_service,
    start_activity_service,
)
from roomservice.activity.store import ActivityStore

__all__ = [
    "ActivityServicer",
    "ActivityStore",
    "RunningActivityService",
    "running_activity_service",
    "start_activity_service",
]
