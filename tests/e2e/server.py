"""Run ``room-service serve`` as a real child process for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

LOCAL_GIFTS = """
gifts:
  - {id: rose, name: Rose, price: 10}
  - {id: rocket, name: Rocket, price: 1000}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(path: Path, *, database_url: str | None = None, extra: str = "") -> Path:
    lines = ["logging: {level: warning, json: true}"]
    if database_url:
        lines.append(f'database: {{url: "{database_url}"}}')
    path.write_text("\n".join(lines) + LOCAL_GIFTS + extra)
    return path


class ServerProcess:
    """A ``room-service serve`` child; ``kill()`` is SIGKILL, no goodbyes."""

    def __init__(
        self,
        *,
        config: Path | None,
        data_dir: Path,
        port: int | None = None,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        wrapper: list[str] | None = None,
    ) -> None:
        self.config = config  # None: no --config and no --data-dir, exactly as a newcomer runs it (from cwd)
        self.cwd = cwd
        self.data_dir = data_dir
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir / "server.log"
        self.env = env or {}  # added to the environment of the child
        self.wrapper = wrapper or []  # put before the command line (bench: valgrind)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, timeout_s: float = 30.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        out = self.log.open("ab")
        args = [*self.wrapper, sys.executable, "-m", "roomservice.cli", "serve", "--port", str(self.port)]
        if self.config is not None:
            args += ["--config", str(self.config), "--data-dir", str(self.data_dir)]
        self.proc = subprocess.Popen(
            args,
            cwd=self.cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"server not ready after {timeout_s}s: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
