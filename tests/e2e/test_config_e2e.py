"""Configuration that takes effect in a real ``room-service serve``: metrics.enabled."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from tests.e2e.server import ServerProcess, write_config

pytestmark = pytest.mark.slow


def test_metrics_disabled_answers_404_in_the_error_shape(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.yaml", extra="metrics: {enabled: false}\n")
    server = ServerProcess(config=config, data_dir=tmp_path / "data")
    server.start()
    try:
        response = httpx.get(f"{server.url}/metrics")
        assert response.status_code == 404
        assert response.headers["content-type"].startswith("application/json")
        assert response.json()["error"]["code"] == "not_found"
        assert httpx.get(f"{server.url}/readyz").status_code == 200  # the rest serves as usual
    finally:
        server.stop()


def test_metrics_enabled_serves_prometheus_text(tmp_path: Path) -> None:
    server = ServerProcess(config=write_config(tmp_path / "c.yaml"), data_dir=tmp_path / "data")
    server.start()
    try:
        response = httpx.get(f"{server.url}/metrics")
        assert response.status_code == 200
        assert "room_outbox_rows" in response.text
    finally:
        server.stop()
