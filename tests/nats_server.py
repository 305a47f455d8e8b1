"""A NATS JetStream server of the test's own (``nats-server -js`` on a free port, temporary store), to stop and start.

Tests that stop the broker use this, never the shared server on 4222. Tests on the shared server use a stream
of their own and drop it afterwards (:func:`drop_streams`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import nats

NATS_SERVER = shutil.which("nats-server") or "/usr/sbin/nats-server"
DEADLINE = 10.0
SHARED_URL = "nats://127.0.0.1:4222"


def drop_streams(stream: str, url: str = SHARED_URL) -> None:
    """Delete ``stream`` and its dead-letter stream (``<stream>_dlq``), whichever exist (a test's cleanup)."""

    async def drop() -> None:
        nc = await nats.connect(url)
        try:
            for name in (stream, f"{stream}_dlq"):
                with contextlib.suppress(Exception):
                    await nc.jetstream().delete_stream(name)
        finally:
            await nc.close()

    asyncio.run(drop())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OwnNatsServer:
    """``nats-server -js`` on a free port with its own store dir; stop (SIGKILL) and start it at will."""

    def __init__(self, store: Path) -> None:
        self.port = free_port()
        self.store = store
        self.url = f"nats://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert self.process is None
        self.process = subprocess.Popen(
            [NATS_SERVER, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        end = time.monotonic() + DEADLINE
        while time.monotonic() < end:
            assert self.process.poll() is None, "nats-server exited at start"
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise AssertionError("nats-server did not listen in time")

    def kill(self) -> None:
        """A crash: SIGKILL, no shutdown."""
        if self.process is not None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.process = None
