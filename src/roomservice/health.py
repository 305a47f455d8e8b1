"""Readiness checks: each in-process part registers a ping; /readyz is 200 only if every critical one answers.

A non-critical check (the broker: commands still succeed while it is away,
seed row 3) reports ``degraded: …`` in the body without making the process
unready.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

Check = Callable[[], Awaitable[None]]


@dataclass(slots=True)
class HealthChecks:
    timeout_s: float = 2.0
    _checks: dict[str, tuple[Check, bool]] = field(default_factory=dict)

    def register(self, name: str, check: Check, *, critical: bool = True) -> None:
        self._checks[name] = (check, critical)

    async def run(self) -> tuple[bool, dict[str, str]]:
        """(every critical check ok, name -> "ok", "error: …" or "degraded: …"), concurrently, each with a timeout."""

        async def one(check: Check) -> str | None:
            try:
                async with asyncio.timeout(self.timeout_s):
                    await check()
            except Exception as exc:  # a failing check is an answer, not an error
                return repr(exc)[:200]
            return None

        names = list(self._checks)
        failures = await asyncio.gather(*(one(self._checks[n][0]) for n in names))
        report: dict[str, str] = {}
        ready = True
        for name, failure in zip(names, failures, strict=True):
            critical = self._checks[name][1]
            if failure is None:
                report[name] = "ok"
            elif critical:
                report[name] = f"error: {failure}"
                ready = False
            else:
                report[name] = f"degraded: {failure}"
        return ready, report
