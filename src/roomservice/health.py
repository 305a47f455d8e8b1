"""Readiness checks: each in-process part registers a ping; /readyz is 200 only if all answer."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

Check = Callable[[], Awaitable[None]]


@dataclass(slots=True)
class HealthChecks:
    timeout_s: float = 2.0
    _checks: dict[str, Check] = field(default_factory=dict)

    def register(self, name: str, check: Check) -> None:
        self._checks[name] = check

    async def run(self) -> tuple[bool, dict[str, str]]:
        """(all ok, name -> "ok" or the failure) — checks run concurrently, each with a timeout."""

        async def one(check: Check) -> str:
            try:
                async with asyncio.timeout(self.timeout_s):
                    await check()
            except Exception as exc:  # a failing check is an answer, not an error
                return f"error: {exc!r}"[:200]
            return "ok"

        names = list(self._checks)
        results = await asyncio.gather(*(one(self._checks[n]) for n in names))
        report = dict(zip(names, results, strict=True))
        return all(r == "ok" for r in results), report
