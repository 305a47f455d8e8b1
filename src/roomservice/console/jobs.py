"""Replays started from the console run as jobs in this process, so a bulk replay shows its progress.

A job calls :class:`~roomservice.admin.operations.OutboxAdmin` (one transaction
per batch, audited with the operator's name) and records ``done / total`` from
its progress callback; the job page polls ``/console/jobs/<id>.json``. Jobs
live in memory (the newest :data:`KEEP` are kept); what they did is in the
outbox rows and the audit, which outlive them.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

from roomservice import errors
from roomservice.admin.dead_letters import DeadLetterReplay
from roomservice.admin.operations import ReplayInterrupted, ReplayReport
from roomservice.observability.logging import get_logger

_log = get_logger("roomservice.console")

KEEP: Final = 50

Progress = Callable[[int, int], None]


@dataclass(slots=True)
class Job:
    id: str
    title: str
    operator: str
    started_at: float
    total: int = 0
    done: int = 0
    state: str = "running"  # running, done, failed
    error: str | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    finished_at: float | None = None
    kind: str = "outbox"  # "outbox": rows of the outbox; "consumers": dead letters of a consumer group

    def progress(self, done: int, total: int) -> None:
        self.done, self.total = done, total

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "operator": self.operator,
            "state": self.state,
            "done": self.done,
            "total": self.total,
            "error": self.error,
            "summary": self.summary,
            "kind": self.kind,
        }


class Jobs:
    def __init__(self) -> None:
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()

    def get(self, job_id: str) -> Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise errors.NotFound(f"no replay job {job_id[:40]!r} in this process (jobs are kept in memory)")
        return job

    def recent(self) -> list[Job]:
        return list(reversed(self._jobs.values()))

    def start(
        self,
        title: str,
        operator: str,
        work: Callable[[Progress], Awaitable[ReplayReport | DeadLetterReplay]],
        *,
        kind: str = "outbox",
    ) -> Job:
        job = Job(id=secrets.token_hex(8), title=title, operator=operator, started_at=time.time(), kind=kind)
        self._jobs[job.id] = job
        # the oldest finished ones go; a running job stays whatever its age (its page polls it)
        finished = [key for key, kept in self._jobs.items() if kept.state != "running"]
        for key in finished[: max(0, len(self._jobs) - KEEP)]:
            del self._jobs[key]
        task = asyncio.create_task(self._run(job, work), name=f"console-job-{job.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    async def _run(self, job: Job, work: Callable[[Progress], Awaitable[ReplayReport | DeadLetterReplay]]) -> None:
        try:
            report = await work(job.progress)
        except ReplayInterrupted as exc:  # later batch failed: show what the committed ones did
            job.state, job.error = "failed", str(exc)
            self._summarise(job, exc.report)
        except errors.RoomServiceError as exc:
            job.state, job.error = "failed", str(exc)
        except Exception as exc:
            _log.exception("console_job_failed", job=job.id)
            job.state, job.error = "failed", f"{type(exc).__name__}: {exc}"[:300]
        else:
            job.state = "done"
            self._summarise(job, report)
            job.done = job.total = max(job.total, job.summary["handled"])
        finally:
            job.finished_at = time.time()
            _log.info("console_job_finished", job=job.id, title=job.title, operator=job.operator, state=job.state)

    @staticmethod
    def _summarise(job: Job, report: ReplayReport | DeadLetterReplay) -> None:
        """The job's summary: the report's counts, how many it handled, and one line for its page."""
        if isinstance(report, DeadLetterReplay):
            replayed, gone = len(report.replayed), len(report.not_dead_letters)
            job.summary = {
                "replayed": replayed,
                "not_dead_letters": gone,
                "handled": replayed + gone,
                "text": f"replayed {replayed} dead letter(s) to {report.group}, {gone} no longer dead letters",
            }
            return
        job.summary = {k: v for k, v in report.to_dict().items() if k != "results"}
        job.summary["handled"] = len(report.outcomes)
        job.summary["messages"] = [o.message for o in report.outcomes if o.result != "replayed"][:20]
        job.summary["text"] = (
            f"replayed {report.replayed}, not failed {report.not_failed}, not found {report.not_found}, "
            f"undecodable {report.undecodable}, no targets {report.no_targets}, "
            f"already repaired {report.already_repaired}"
        )

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
