"""``room-service config check``: effective settings with secrets masked, inactive keys, load errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from roomservice.cli.config_cmd import MASK, config_app
from roomservice.config import INACTIVE_RULES, NOT_YET_AVAILABLE, inactive_keys, load_settings

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"

runner = CliRunner()
cli = typer.Typer(rich_markup_mode=None)  # as room-service mounts it (a lone command would collapse into its app)
cli.add_typer(config_app, name="config")


def inactive_section(output: str) -> list[str]:
    """The keys listed under "# inactive keys", one per line."""
    _, _, tail = output.partition("# inactive keys:")
    return [line.removeprefix("#     ") for line in tail.splitlines() if line.startswith("#     ")]


def test_check_of_the_packaged_default_prints_its_settings_and_inactive_keys(tmp_path: Path) -> None:
    result = runner.invoke(cli, ["config", "check", "--data-dir", str(tmp_path / "d")], env={})
    assert result.exit_code == 0, result.output
    printed = yaml.safe_load(result.stdout)  # the inactive keys are YAML comments
    expected = load_settings(env={}).with_data_dir(tmp_path / "d")
    assert printed == expected.model_dump(mode="json")
    assert printed["database"]["url"] == f"sqlite+aiosqlite:///{(tmp_path / 'd').resolve().as_posix()}/room.db"
    assert printed["gifts"][0] == {"id": "rose", "name": "Rose", "price": 10}
    listed = inactive_section(result.stdout)
    assert sorted(listed) == sorted(key for key, _ in inactive_keys(expected))
    assert "redis.url" in listed and "broker.nats.url" in listed and "lease.ttl" in listed
    assert "tencent_im.base_url" not in listed and "outbox_worker.batch_size" not in listed
    assert "# only" not in result.stdout  # every reason is printed once, above its keys
    assert "lease.driver is inprocess: in-process leases never expire" in result.stdout
    assert not (tmp_path / "d").exists()  # checking creates nothing


def test_check_reads_the_file_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        'outbox_worker: {enabled: false}\nwallet: {driver: http, url: "${WALLET_URL}"}\nroom: {seat_count: 12}\n',
        encoding="utf-8",
    )
    result = runner.invoke(cli, ["config", "check", "--config", str(path)], env={"WALLET_URL": "https://w.internal"})
    assert result.exit_code == 0, result.output
    printed = yaml.safe_load(result.stdout)
    assert printed["wallet"]["url"] == "https://w.internal"
    assert printed["room"]["seat_count"] == 12
    assert result.stdout.startswith(f"# room-service config check: {path}\n")
    listed = inactive_section(result.stdout)
    assert {"tencent_im.base_url", "activity.target", "outbox_worker.batch_size", "wallet.starting_balance"} <= set(
        listed
    )
    assert "wallet.url" not in listed and "outbox_worker.poll_interval" not in listed


def test_check_masks_every_secret(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        'database: {url: "mysql+asyncmy://room:db-pw-1@db:3306/room"}\n'
        'redis: {url: "redis://:redis-pw-2@cache:6379/0"}\n'
        'admin: {token: "admin-token-3"}\n'
        'wallet: {driver: http, url: "https://user:wallet-pw-4@wallet.internal/api", api_key: "wallet-key-5"}\n'
        'tencent_im: {base_url: "https://console.tim.qq.com", sdk_app_id: 1400000001, secret_key: "im-key-6"}\n'
        'rocketmq: {access_key: "rmq-access-7", secret_key: "rmq-secret-8"}\n',
        encoding="utf-8",
    )
    result = runner.invoke(cli, ["config", "check", "--config", str(path)], env={})
    assert result.exit_code == 0, result.output
    for secret in ["db-pw-1", "redis-pw-2", "admin-token-3", "wallet-pw-4", "wallet-key-5", "im-key-6", "rmq-"]:
        assert secret not in result.output
    printed = yaml.safe_load(result.stdout)
    assert printed["admin"]["token"] == MASK
    assert printed["database"]["password"] == MASK
    assert printed["wallet"]["url"] == f"https://user:{MASK}@wallet.internal/api"
    assert printed["database"]["url"] == "mysql+asyncmy://room@db:3306/room"
    assert printed["wallet"]["api_key"] == MASK


def test_check_of_the_docker_sample_loads_with_its_environment() -> None:
    env = {
        "ROOMSERVICE_ADMIN_TOKEN": "t",
        "ROOMSERVICE_GRPC_SHARED_SECRET": "peer-secret-1",
        "ROOMSERVICE_TENCENT_IM_SECRET_KEY": "im-key-1",
    }
    result = runner.invoke(cli, ["config", "check", "--config", str(CONFIGS / "docker.yaml")], env=env)
    assert result.exit_code == 0, result.output
    assert "peer-secret-1" not in result.output and "im-key-1" not in result.output
    printed = yaml.safe_load(result.stdout)  # the inactive keys are YAML comments
    assert printed["lease"]["driver"] == "redis"
    assert printed["grpc"]["shared_secret"] == MASK
    assert "grpc.shared_secret" not in inactive_section(result.stdout)


def test_check_of_the_docker_sample_without_the_peers_secret_names_it() -> None:
    result = runner.invoke(
        cli,
        ["config", "check", "--config", str(CONFIGS / "docker.yaml")],
        env={"ROOMSERVICE_ADMIN_TOKEN": "t", "ROOMSERVICE_TENCENT_IM_SECRET_KEY": "k"},
    )
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0] == f"config error in {CONFIGS / 'docker.yaml'}:"
    assert lines[1].startswith("  - grpc.shared_secret: environment variable ROOMSERVICE_GRPC_SHARED_SECRET is not set")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("room: {seat_cuont: 3}\n", "  - unknown key: room.seat_cuont"),
        (
            'activity: {target: "${NOPE_NOT_SET}"}\n',
            "  - activity.target: environment variable NOPE_NOT_SET is not set",
        ),
    ],
)
def test_check_of_an_invalid_file_lists_each_problem(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    result = runner.invoke(cli, ["config", "check", "--config", str(path)], env={})
    assert result.exit_code == 2
    assert any(line.startswith(expected) for line in result.stderr.splitlines()), result.stderr


def test_check_of_a_missing_file_fails(tmp_path: Path) -> None:
    result = runner.invoke(cli, ["config", "check", "--config", str(tmp_path / "nope.yaml")], env={})
    assert result.exit_code == 2
    assert "cannot read config file" in result.stderr


def test_help_says_what_is_not_available_and_what_is_inactive_when() -> None:
    result = runner.invoke(cli, ["config", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    text = result.stdout
    assert "docs/configuration.md" in text
    for row in NOT_YET_AVAILABLE:
        value = str(row.value).lower() if isinstance(row.value, bool) else row.value
        assert f"{row.key}: {value} ({row.missing})" in text
    flat = " ".join(text.split())  # long lines are wrapped
    for rule in INACTIVE_RULES:
        assert ", ".join(rule.keys) in flat
        assert rule.reason in flat


def test_room_service_has_the_config_command() -> None:
    from roomservice.cli.main import app

    result = runner.invoke(app, ["config", "check", "--help"])
    assert result.exit_code == 0, result.output
    assert "--config" in result.stdout and "inactive" in result.stdout
