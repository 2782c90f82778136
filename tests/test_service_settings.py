"""Daemon settings: one table of fields, from which come the config-file keys, the
environment variables and the ``shmcache serve`` flags; precedence (flags > SHMCACHE_* env >
config file > defaults) and validation, with errors that name the setting as it was given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pydantic_settings")

from shmcache.service import DatasetSpec, Settings, SettingsError, load_settings
from shmcache.service.settings import env_name, flag_name, given, is_loopback, parse_size
from typer.testing import CliRunner

from shmcache._disk.layout import ENV_CONFIG, ENV_PREFIX, ENV_ROOT, ENV_SOCKET, ENV_TOKEN, Layout
from shmcache.cli import app

TOKEN = "0123456789abcdef0123"
CLI = [sys.executable, "-c", "from shmcache.cli import main; main()"]


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
    assert settings.socket_path == Layout(tmp_path).socket and settings.pid_path == Layout(tmp_path).pid_file
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
        ({"max_bytes": "1G", "max_fraction": 0.5}, "--max-bytes or --max-fraction, not both"),
        ({"max_fraction": 2.0}, r"--max-fraction must be in \(0, 1\], got 2.0"),
        ({"max_fraction": 0}, r"--max-fraction must be in \(0, 1\], got 0"),
        ({"load_workers": 0}, "--load-workers must be >= 1, got 0"),
        ({"port": 70000, "host": "127.0.0.1"}, "--port must be in 0..65535"),
        ({"max_load_rate": 0}, "--max-load-rate must be > 0"),
        ({"request_timeout": 0}, "--request-timeout must be > 0"),
        ({"log_level": "loud"}, "--log-level must be one of 'debug', 'info', 'warning' or 'error'"),
        ({"token": "short"}, "--token is too short"),
        ({"allow_source": ["/no/such/dir"]}, "/no/such/dir, which is not a directory"),
        ({"allow_host": ["cache.example"]}, "--allow-host needs --host"),
        ({"host": "127.0.0.1", "port": 0, "allow_host": ["cache.example:8765"]}, "without a port"),
        ({"host": "127.0.0.1", "port": 0, "allow_host": ["http://x.example"]}, "without a port or scheme"),
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
    with pytest.raises(SettingsError, match=r"unknown setting\(s\) max_byte; known: allow_host, allow_sou"):
        load_settings({}, env={}, config_file=config)
    config.write_text("config = 'other.toml'\n")  # flags and environment only
    with pytest.raises(SettingsError, match=r"unknown setting\(s\) config"):
        load_settings({}, env={}, config_file=config)
    config.write_text("[[datasets]]\nkey = 'a'\n")
    with pytest.raises(SettingsError, match=r"datasets\[0\] needs key"):
        load_settings({}, env={}, config_file=config)
    config.write_text("[[datasets]]\nkey = 'a'\nsource = 'x'\npin = 'maybe'\n")
    with pytest.raises(SettingsError, match=r"datasets\[0\]\.pin must be true or false, got 'maybe'"):
        load_settings({}, env={}, config_file=config)
    config.write_text("[[datasets]]\nkey = 'a'\nsource = 'x'\nsize = 1\n")
    with pytest.raises(SettingsError, match=r"datasets\[0\] has unknown field\(s\) size"):
        load_settings({}, env={}, config_file=config)
    config.write_text("max_bytes = 1\nmax_fraction = 0.5\n")
    with pytest.raises(SettingsError, match="max_bytes or max_fraction, not both"):
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


def test_every_name_comes_from_the_field() -> None:
    """A field's name is its config key, SHMCACHE_<NAME> its variable, --<name> its flag."""
    fields = Settings.model_fields
    assert [env_name(n) for n in ("root", "socket", "token", "config")] == [
        ENV_ROOT, ENV_SOCKET, ENV_TOKEN, ENV_CONFIG
    ]  # the client and the core read these very names
    assert [flag_name(n) for n in ("max_load_rate", "root")] == ["--max-load-rate", "--root"]
    assert all(field.description for field in fields.values())
    assert not given(fields["datasets"]).flag and not given(fields["datasets"]).env
    assert not given(fields["config"]).file


@pytest.mark.parametrize("where", ["flag", "env", "file"])
def test_errors_say_where_the_bad_value_came_from(tmp_path: Path, where: str) -> None:
    config = tmp_path / "c.toml"
    config.write_text('max_bytes = "lots"\nload_workers = 3\n')
    cli: dict[str, Any] = {"max_bytes": "lots"} if where == "flag" else {}
    env = {"SHMCACHE_MAX_BYTES": "lots"} if where == "env" else {}
    expected = {
        "flag": "--max-bytes",
        "env": "SHMCACHE_MAX_BYTES",
        "file": f"config file {config}: max_bytes",
    }[where]
    with pytest.raises(SettingsError) as caught:
        load_settings({"root": tmp_path, **cli}, env=env, config_file=config if where == "file" else None)
    assert str(caught.value) == f"{expected} must be a size such as 8GiB, 500M or 1073741824, got 'lots'"


def test_a_secret_is_never_echoed(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings({"root": tmp_path}, env={"SHMCACHE_TOKEN": "hunter2"})
    assert "SHMCACHE_TOKEN is too short" in str(caught.value) and "hunter2" not in str(caught.value)


def test_environment_lists_relative_paths_and_the_highest_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "conf" / "c.toml"
    config.parent.mkdir()
    config.write_text('socket = "run/d.sock"\nmax_bytes = "1MiB"\ncleanup_on_exit = true\n')
    env = {
        "SHMCACHE_ALLOW_SOURCE": os.pathsep.join(["a", "", str(tmp_path / "b")]),
        "SHMCACHE_ROOT": "cache",
        "SHMCACHE_MAX_FRACTION": "0.5",
        "SHMCACHE_LOG_LEVEL": "WARNING",
        "SHMCACHE_HOST": "",  # empty: not set
        "SHMCACHE_CONFIG": "conf/c.toml",
    }
    settings = load_settings({}, env=env)
    assert settings.allow_source == (tmp_path / "a", tmp_path / "b")
    assert settings.root == tmp_path / "cache" and settings.config == config
    assert settings.socket_path == config.parent / "run" / "d.sock"  # relative to the file
    assert settings.max_fraction == 0.5 and settings.max_bytes is None  # env's budget replaces the file's
    assert settings.log_level == "warning" and settings.host is None and settings.cleanup_on_exit
    flagged = load_settings({"max_bytes": "2MiB", "cleanup_on_exit": False}, env=env)
    assert flagged.max_bytes == 2 << 20 and flagged.max_fraction is None
    assert flagged.cleanup_on_exit  # an on/off flag left off does not turn it off


def test_allowed_host_names_from_flag_env_and_config(tmp_path: Path) -> None:
    """--allow-host, SHMCACHE_ALLOW_HOST (':'-separated) and allow_host in the file, normalised
    (lower case, no trailing dot or brackets); the Host check runs on loopback or when named."""
    tcp = {"host": "127.0.0.1", "port": 0, "allow_source": [tmp_path]}
    config = tmp_path / "c.toml"
    config.write_text('allow_host = ["From.File."]\n')
    assert load_settings(tcp, env={}, config_file=config).allow_host == ("from.file",)
    from_env = load_settings(tcp, env={env_name("allow_host"): "a.example:B.example"}, config_file=config)
    assert from_env.allow_host == ("a.example", "b.example")
    flagged = load_settings({**tcp, "allow_host": ["b.example", "[FE80::1]"]}, env={}, config_file=config)
    assert flagged.allow_host == ("b.example", "fe80::1")
    assert flagged.host_names == {"localhost", "127.0.0.1", "::1", "b.example", "fe80::1"}
    assert load_settings({"root": tmp_path}, env={}).host_names is None  # no TCP
    public = {"host": "0.0.0.0", "port": 0, "allow_source": [tmp_path], "token": TOKEN}
    assert load_settings(public, env={}).host_names is None  # the token guards a public address
    named = load_settings({**public, "allow_host": ["c.example"]}, env={}).host_names
    assert named == {"localhost", "127.0.0.1", "::1", "0.0.0.0", "c.example"}


def test_settings_read_the_process_environment_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHMCACHE_LOAD_WORKERS", "5")
    monkeypatch.setenv("SHMCACHE_MAX_BYTES", "1GiB")
    assert load_settings({"root": tmp_path}).load_workers == 5
    built = Settings(root=tmp_path, load_workers=4)  # keyword arguments are the flags
    assert built.load_workers == 4 and built.max_bytes == 1 << 30
    assert load_settings({"root": tmp_path}, env={}).load_workers == 2  # a given environment replaces it
    monkeypatch.setenv("SHMCACHE_PORT", "not a port")
    with pytest.raises(SettingsError, match="SHMCACHE_PORT must be an integer, got 'not a port'"):
        load_settings({"root": tmp_path})


def _serve(*args: str, env: dict[str, str] | None = None) -> Any:
    environ = {k: "" for k in os.environ if k.startswith(ENV_PREFIX)}
    return CliRunner().invoke(app, ["serve", *args], env={**environ, "COLUMNS": "250", **(env or {})})


def test_serve_has_a_flag_per_setting_naming_its_variable() -> None:
    result = _serve("--help")
    assert result.exit_code == 0, result.output
    for name, field in Settings.model_fields.items():
        if given(field).flag:
            assert flag_name(name) in result.output, name
            assert env_name(name) in result.output, name
    assert "--datasets" not in result.output and "default 2" in result.output
    assert "shmcache[service]" in result.output


def test_serve_flags_reach_the_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shmcache.service

    ran: list[Settings] = []

    def fake_serve(settings: Settings) -> int:
        ran.append(settings)
        return 0

    monkeypatch.setattr(shmcache.service, "serve", fake_serve)
    (tmp_path / "a").mkdir()
    result = _serve(
        "--root", str(tmp_path / "r"), "--max-bytes", "1GiB", "--allow-source", str(tmp_path),
        "--allow-source", str(tmp_path / "a"), "--cleanup-on-exit", "--log-level", "DEBUG",
        "--load-workers", "3", env={"SHMCACHE_MAX_LOAD_RATE": "1MiB"},
    )
    assert result.exit_code == 0, result.output
    [settings] = ran
    assert settings.root == tmp_path / "r" and settings.max_bytes == 1 << 30
    assert settings.allow_source == (tmp_path, tmp_path / "a") and settings.cleanup_on_exit
    assert settings.log_level == "debug" and settings.load_workers == 3 and settings.max_load_rate == 1 << 20


def test_serve_refuses_bad_settings_with_a_usage_error(tmp_path: Path) -> None:
    result = _serve("--root", str(tmp_path), "--max-bytes", "lots")
    assert result.exit_code == 2
    assert "error: --max-bytes must be a size such as 8GiB" in result.output
    result = _serve("--root", str(tmp_path), "--no-such-flag")
    assert result.exit_code == 2 and "--no-such-flag" in result.output


def test_without_the_service_extra_serve_says_what_to_install_and_the_rest_works(tmp_path: Path) -> None:
    hide = "import sys; sys.modules['pydantic_settings'] = None; from shmcache.cli import main; main()"
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    done = subprocess.run(
        [sys.executable, "-c", hide, "serve", "--help"], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 1
    assert "needs the service extra (pydantic_settings is missing): pip install 'shmcache[service]'" in (
        done.stderr
    )
    listed = subprocess.run(
        [sys.executable, "-c", hide, "ls", "--root", str(tmp_path / "r")],
        capture_output=True, text=True, env=env, check=False,
    )
    assert listed.returncode == 0 and "KEY" in listed.stdout, listed.stderr


def test_cli_start_and_the_settings_import_stay_light() -> None:
    code = (
        "import json, sys; import shmcache.cli; cli = [m for m in ('pydantic', 'pydantic_settings', "
        "'fastapi') if m in sys.modules]; import shmcache.service.settings; "
        "print(json.dumps([cli, [m for m in ('fastapi', 'uvicorn', 'starlette') if m in sys.modules]]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [[], []]
