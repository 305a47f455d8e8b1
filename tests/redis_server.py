"""A ``redis-server`` of the test's own (free port, no persistence), to stop, pause and start.

Tests that take Redis away use this, never the shared server on 6379.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
DEADLINE = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OwnRedisServer:
    """``redis-server --port N --save "" --appendonly no``: a restart loses every key, as a real outage may."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert self.process is None
        self.process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        end = time.monotonic() + DEADLINE
        while time.monotonic() < end:
            assert self.process.poll() is None, "redis-server exited at start"
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.02)
        raise AssertionError("redis-server did not listen in time")

    def kill(self) -> None:
        """A crash: SIGKILL; the keys are gone."""
        if self.process is not None:
            self.resume()
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.process = None

    def pause(self) -> None:
        """A hung server: SIGSTOP (connections stay open, nothing answers)."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None:
            os.kill(self.process.pid, signal.SIGCONT)
