"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from tests.tcp_proxy import TcpProxy


@pytest.fixture
def proxy(mariadb_server_url: sa.URL) -> Iterator[TcpProxy]:
    """A TCP proxy in front of the shared MariaDB server: blackhole it to hang the database for real."""
    with TcpProxy(mariadb_server_url.host or "127.0.0.1", mariadb_server_url.port or 3306) as running:
        yield running
