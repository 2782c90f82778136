"""Daemon settings: precedence (flags > SHMCACHE_* env > config file > defaults) and validation."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from shmcache.service import DatasetSpec, SettingsError, load_settings
from shmcache.service.settings import is_loopback, parse_size

TOKEN = "0123456789abcdef0123"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1024", 1024),
        (4096, 4096),
        ("8GiB", 8 << 30),
        ("500M", 500 << 20),
        ("1.5G", 3 << 29),
        ("2 KiB", 2048),
        ("7B", 7),
    ],
)
def test_parse_size(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "-5", "1X", True, "", None])
def test_parse_size_refuses_nonsense(text: object) -> None:
    with pytest.raises(SettingsError, match="size such as"):
        parse_size(text)


def test_defaults(tmp_path: Path) -> None:
    settings = load_settings({"root": tmp_path}, env={})
    assert settings.root == tmp_path and settings.host is None and settings.load_workers == 2
    assert settings.socket_path == tmp_path / "daemon.sock" and settings.pid_path == tmp_path / "daemon.pid"
    assert settings.max_bytes is None and settings.budget_bytes(100) is None


def test_flags_beat_env_beat_config(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    config = tmp_path / "shmcache.toml"
    config.write_text(
        'root = "cache"\nmax_fraction = 0.25\nload_workers = 4\nallow_source = ["data"]\n'
        'log_level = "debug"\n'
        '[[datasets]]\nkey = "feats"\nsource = "data/feats"\npin = true\n'
    )
    from_file = load_settings({}, env={}, config_file=config)
    assert from_file.root == tmp_path / "cache"  # relative to the file
    assert from_file.budget_bytes(1000) == 250 and from_file.load_workers == 4
    assert from_file.allow_source == (data.resolve(),) and from_file.log_level == "debug"
    assert from_file.datasets == (DatasetSpec("feats", (data / "feats").resolve(), True),)

    env = {"SHMCACHE_MAX_BYTES": "1GiB", "SHMCACHE_LOAD_WORKERS": "3", "SHMCACHE_CONFIG": str(config)}
    from_env = load_settings({}, env=env)
    assert from_env.max_bytes == 1 << 30 and from_env.max_fraction is None  # env's budget replaces the file's
    assert from_env.load_workers == 3 and from_env.root == tmp_path / "cache"

    flags = load_settings({"max_fraction": 0.5, "load_workers": 1, "root": tmp_path / "r"}, env=env)
    assert flags.max_fraction == 0.5 and flags.max_bytes is None and flags.load_workers == 1
    assert flags.root == tmp_path / "r"


@pytest.mark.parametrize(
    ("cli", "message"),
    [
        ({"host": "0.0.0.0", "port": 0}, "without a token"),
        ({"host": "10.1.2.3", "port": 80, "token": TOKEN}, "--allow-source"),
        ({"host": "127.0.0.1", "port": 0}, "--allow-source"),
        ({"host": "127.0.0.1"}, "needs --port"),
        ({"port": 8000}, "needs --host"),
        ({"max_bytes": "1G", "max_fraction": 0.5}, "not both"),
        ({"max_fraction": 2.0}, "max_fraction"),
        ({"load_workers": 0}, "load_workers"),
        ({"log_level": "loud"}, "log_level"),
        ({"token": "short"}, "too short"),
        ({"allow_source": ["/no/such/dir"]}, "not a directory"),
    ],
)
def test_unsafe_or_contradictory_settings_are_refused(
    tmp_path: Path, cli: dict[str, object], message: str
) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings({"root": tmp_path, **cli}, env={})


def test_config_file_errors_name_the_problem(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("max_byte = 1\n")
    with pytest.raises(SettingsError, match="unknown setting"):
        load_settings({}, env={}, config_file=config)
    config.write_text("[[datasets]]\nkey = 'a'\n")
    with pytest.raises(SettingsError, match="needs key"):
        load_settings({}, env={}, config_file=config)
    config.write_text("not toml = = =\n")
    with pytest.raises(SettingsError, match="cannot read config"):
        load_settings({}, env={}, config_file=config)
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings({}, env={}, config_file=tmp_path / "missing.toml")


def test_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org") and not is_loopback("10.0.0.1")


def test_public_tcp_with_token_and_sources_is_accepted(tmp_path: Path) -> None:
    settings = load_settings(
        {"root": tmp_path, "host": "0.0.0.0", "port": 0, "allow_source": [tmp_path]},
        env={"SHMCACHE_TOKEN": TOKEN},
    )
    assert settings.token == TOKEN and settings.uses_tcp
