"""A started grpc.aio server, shared by every gRPC service we run (the room API, the activity service)."""

from __future__ import annotations

import grpc

from roomservice.observability.logging import get_logger

_log = get_logger("roomservice.grpc")


def format_target(host: str, port: int) -> str:
    """``host:port`` for a gRPC target (IPv6 literals bracketed)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


class RunningGrpcServer:
    """``target`` is what a client connects to (a wildcard bind answers on loopback)."""

    name = "grpc_server"  # the log event prefix: "<name>_stopped"

    def __init__(self, server: grpc.aio.Server, host: str, port: int) -> None:
        self.server = server
        self.host = host
        self.port = port
        self._stopped = False

    @property
    def target(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else "::1" if self.host == "::" else self.host
        return format_target(host, self.port)

    @property
    def serving(self) -> bool:
        return not self._stopped

    async def stop(self, grace: float | None = 5.0) -> None:
        """Stop accepting calls, let in-flight ones finish within ``grace`` seconds, then cancel them."""
        if self._stopped:
            return
        self._stopped = True
        await self.server.stop(grace)
        _log.info(f"{self.name}_stopped", target=self.target)

    async def wait(self) -> None:
        """Until the server terminates."""
        await self.server.wait_for_termination()
