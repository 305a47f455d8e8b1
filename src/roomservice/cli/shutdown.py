"""Graceful stop on SIGTERM/SIGINT for the long-running commands, with a bound.

The first SIGTERM or SIGINT sets :attr:`GracefulStop.requested`; the command
then stops in its own order (``serve``: stop accepting connections, let the
requests in flight finish, stop the runtime, which hands outbox claims back)
and calls :meth:`GracefulStop.complete`, which logs ``shutdown_complete``.

Two things bound the stop, because a stop that hangs (a database that does
not answer, say) is worse than one that gives up:

* a deadline, started by the first signal: when it passes, the process logs
  ``shutdown_deadline_exceeded`` and exits at once with status 1 (unfinished
  claims then come back to other workers after their lease);
* a second signal, which does the same without waiting.

The deadline runs on a timer thread so that it fires even if the event loop
is stuck.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time

from roomservice.observability.logging import get_logger

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_STOP_FAILED = 1

_log = get_logger("roomservice.cli")


class GracefulStop:
    """Owns SIGTERM/SIGINT for one ``asyncio.run``; see the module docstring."""

    def __init__(self, *, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self.requested = asyncio.Event()
        self.signal_name: str | None = None
        self._started: float | None = None
        self._timer: threading.Timer | None = None

    def install(self) -> GracefulStop:
        loop = asyncio.get_running_loop()
        for sig in HANDLED_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        return self

    def _on_signal(self, sig: signal.Signals) -> None:
        name = signal.Signals(sig).name
        if self.requested.is_set():
            self._give_up("shutdown_forced", signal=name)
            return
        self.signal_name = name
        self._started = time.monotonic()
        _log.info("shutdown_requested", signal=name, deadline_ms=round(self.deadline_s * 1000))
        self._timer = threading.Timer(self.deadline_s, self._give_up, args=("shutdown_deadline_exceeded",))
        self._timer.daemon = True
        self._timer.start()
        self.requested.set()

    def elapsed_ms(self) -> int:
        return 0 if self._started is None else round((time.monotonic() - self._started) * 1000)

    def complete(self) -> None:
        """The stop finished in time: cancel the deadline and log the one stop line."""
        if self._timer is not None:
            self._timer.cancel()
        _log.info("shutdown_complete", signal=self.signal_name, elapsed_ms=self.elapsed_ms())

    def _give_up(self, event: str, **fields: object) -> None:
        _log.error(event, elapsed_ms=self.elapsed_ms(), deadline_ms=round(self.deadline_s * 1000), **fields)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_STOP_FAILED)
