"""The daemon's settings, read once at the edge: CLI flags > environment > config file > defaults.

Environment variables carry the ``SHMCACHE_`` prefix (``SHMCACHE_ROOT``,
``SHMCACHE_MAX_BYTES``...). The config file is TOML (``--config`` or
``SHMCACHE_CONFIG``); relative paths in it are relative to the file. Nothing else in
the service reads ``os.environ``.
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shmcache import default_root

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "DEFAULT_LOAD_WORKERS",
    "ENV_PREFIX",
    "DatasetSpec",
    "Settings",
    "SettingsError",
    "is_loopback",
    "load_settings",
    "parse_size",
]

ENV_PREFIX = "SHMCACHE_"
DEFAULT_LOAD_WORKERS = 2
SOCKET_NAME = "daemon.sock"
PID_NAME = "daemon.pid"
_LOG_LEVELS = ("debug", "info", "warning", "error")
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(i?)B?\s*", re.IGNORECASE)
_CONFIG_KEYS = {
    "root",
    "socket",
    "max_bytes",
    "max_fraction",
    "host",
    "port",
    "token",
    "allow_source",
    "cleanup_on_exit",
    "load_workers",
    "max_load_rate",
    "log_level",
    "datasets",
}


class SettingsError(ValueError):
    """A setting is missing, malformed or unsafe; the message says which and why."""


@dataclass(frozen=True)
class DatasetSpec:
    """One ``[[datasets]]`` table of the config file: loaded at start-up."""

    key: str
    source: Path
    pin: bool = False


@dataclass(frozen=True)
class Settings:
    """Everything ``shmcache serve`` needs; build it with :func:`load_settings`."""

    root: Path
    socket: Path | None = None
    """Where the Unix socket goes (default ``<root>/daemon.sock``)."""
    max_bytes: int | None = None
    """Budget in bytes (mutually exclusive with ``max_fraction``)."""
    max_fraction: float | None = None
    """Budget as a fraction of the root's file system, resolved at start."""
    host: str | None = None
    """TCP host; None serves on the Unix socket ``<root>/daemon.sock`` only."""
    port: int | None = None
    token: str | None = None
    """Bearer token every request must carry (required for non-loopback TCP)."""
    allow_source: tuple[Path, ...] = ()
    """Directories the API may load from (resolved); empty = anything the daemon can read."""
    cleanup_on_exit: bool = False
    load_workers: int = DEFAULT_LOAD_WORKERS
    max_load_rate: int | None = None
    """Bytes per second per load (None: as fast as the kernel copies)."""
    log_level: str = "info"
    datasets: tuple[DatasetSpec, ...] = ()
    config_file: Path | None = None

    @property
    def socket_path(self) -> Path:
        return self.socket if self.socket is not None else self.root / SOCKET_NAME

    @property
    def pid_path(self) -> Path:
        return self.root / PID_NAME

    @property
    def uses_tcp(self) -> bool:
        return self.host is not None

    def budget_bytes(self, capacity: int) -> int | None:
        """The byte budget, given the capacity of the root's file system."""
        if self.max_fraction is not None:
            return int(capacity * self.max_fraction)
        return self.max_bytes

    def validate(self) -> Settings:
        """Refuse unsafe or contradictory settings; returns self."""
        if self.max_bytes is not None and self.max_bytes < 0:
            raise SettingsError(f"max_bytes must be >= 0, got {self.max_bytes}")
        if self.max_fraction is not None and not 0 < self.max_fraction <= 1:
            raise SettingsError(f"max_fraction must be in (0, 1], got {self.max_fraction}")
        if self.load_workers < 1:
            raise SettingsError(f"load_workers must be >= 1, got {self.load_workers}")
        if self.max_load_rate is not None and self.max_load_rate <= 0:
            raise SettingsError(f"max_load_rate must be > 0, got {self.max_load_rate}")
        if self.log_level not in _LOG_LEVELS:
            raise SettingsError(f"log_level must be one of {', '.join(_LOG_LEVELS)}, got {self.log_level!r}")
        if self.port is not None and self.host is None:
            raise SettingsError("--port needs --host (TCP is opt-in; the default is the Unix socket)")
        if self.host is not None:
            if self.port is None:
                raise SettingsError("--host needs --port (0 picks a free port)")
            if not 0 <= self.port <= 65535:
                raise SettingsError(f"port must be in 0..65535, got {self.port}")
            if not is_loopback(self.host) and not self.token:
                raise SettingsError(
                    f"refusing to listen on non-loopback host {self.host!r} without a token: anyone who "
                    "can reach it could load and evict data. Pass --token (or SHMCACHE_TOKEN) and "
                    "clients send 'Authorization: Bearer <token>'"
                )
            if not self.allow_source:
                raise SettingsError(
                    "TCP needs at least one --allow-source DIR: over TCP the daemon cannot tell who "
                    "asks, so it only loads from directories you allow"
                )
        if self.token is not None and len(self.token) < 16:
            raise SettingsError("the token is too short: use at least 16 random characters")
        return self


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from outside


def parse_size(value: object, what: str = "size") -> int:
    """``"8GiB"``, ``"500M"``, ``"1.5G"`` or an integer -> bytes (K/M/G/T/P are powers of 1024)."""
    if isinstance(value, bool):
        raise SettingsError(f"{what} must be a size such as 8GiB or 500M, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        match = _SIZE_RE.fullmatch(value)
        if match:
            number, unit = float(match.group(1)), match.group(2).upper()
            return int(number * 1024 ** " KMGTP".index(unit or " "))
    raise SettingsError(f"{what} must be a size such as 8GiB, 500M or 1073741824, got {value!r}")


def _parse_bool(value: object, what: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off", ""):
        return value.lower() in ("1", "true", "yes", "on")
    raise SettingsError(f"{what} must be true or false, got {value!r}")


def _parse_int(value: object, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise SettingsError(f"{what} must be an integer, got {value!r}")


def _parse_float(value: object, what: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise SettingsError(f"{what} must be a number, got {value!r}")


def _resolve_dirs(values: Sequence[object], base: Path, what: str) -> tuple[Path, ...]:
    dirs = []
    for value in values:
        if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
            raise SettingsError(f"{what} entries must be directory paths, got {value!r}")
        path = Path(os.path.realpath(base / os.fspath(value)))
        if not path.is_dir():
            raise SettingsError(f"{what} {path} is not a directory")
        dirs.append(path)
    return tuple(dirs)


def _read_config(path: Path) -> dict[str, Any]:
    """The config file's settings, normalized to the field names of :class:`Settings`."""
    try:
        with open(path, "rb") as fp:
            data = tomllib.load(fp)
    except FileNotFoundError:
        raise SettingsError(f"config file {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SettingsError(f"cannot read config file {path}: {exc}") from exc
    unknown = sorted(set(data) - _CONFIG_KEYS)
    if unknown:
        raise SettingsError(
            f"config file {path}: unknown setting(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(_CONFIG_KEYS))}"
        )
    base = path.parent
    where = f"config file {path}:"
    out: dict[str, Any] = {}
    if "root" in data:
        out["root"] = base / str(data["root"])
    if "socket" in data:
        out["socket"] = Path(os.path.abspath(base / str(data["socket"])))
    if "max_bytes" in data:
        out["max_bytes"] = parse_size(data["max_bytes"], f"{where} max_bytes")
    if "max_fraction" in data:
        out["max_fraction"] = _parse_float(data["max_fraction"], f"{where} max_fraction")
    if "max_bytes" in out and "max_fraction" in out:
        raise SettingsError(f"{where} set max_bytes or max_fraction, not both")
    if "host" in data:
        out["host"] = str(data["host"])
    if "port" in data:
        out["port"] = _parse_int(data["port"], f"{where} port")
    if "token" in data:
        out["token"] = str(data["token"])
    if "allow_source" in data:
        allowed = data["allow_source"]
        if isinstance(allowed, str):
            allowed = [allowed]
        if not isinstance(allowed, list):
            raise SettingsError(f"{where} allow_source must be a list of directories")
        out["allow_source"] = _resolve_dirs(allowed, base, f"{where} allow_source")
    if "cleanup_on_exit" in data:
        out["cleanup_on_exit"] = _parse_bool(data["cleanup_on_exit"], f"{where} cleanup_on_exit")
    if "load_workers" in data:
        out["load_workers"] = _parse_int(data["load_workers"], f"{where} load_workers")
    if "max_load_rate" in data:
        out["max_load_rate"] = parse_size(data["max_load_rate"], f"{where} max_load_rate")
    if "log_level" in data:
        out["log_level"] = str(data["log_level"]).lower()
    if "datasets" in data:
        out["datasets"] = _read_datasets(data["datasets"], base, where)
    return out


def _read_datasets(tables: object, base: Path, where: str) -> tuple[DatasetSpec, ...]:
    if not isinstance(tables, list):
        raise SettingsError(f"{where} datasets must be an array of tables ([[datasets]])")
    specs = []
    for i, table in enumerate(tables):
        if not isinstance(table, dict) or not {"key", "source"} <= set(table):
            raise SettingsError(f"{where} datasets[{i}] needs key = ... and source = ...")
        extra = sorted(set(table) - {"key", "source", "pin"})
        if extra:
            raise SettingsError(f"{where} datasets[{i}]: unknown field(s) {', '.join(extra)}")
        source = Path(os.path.realpath(base / str(table["source"])))
        pin = _parse_bool(table.get("pin", False), f"{where} datasets[{i}].pin")
        specs.append(DatasetSpec(str(table["key"]), source, pin))
    return tuple(specs)


def _read_env(env: Mapping[str, str]) -> dict[str, Any]:
    def get(name: str) -> str | None:
        value = env.get(ENV_PREFIX + name)
        return value if value else None

    out: dict[str, Any] = {}
    if (value := get("ROOT")) is not None:
        out["root"] = Path(value)
    if (value := get("SOCKET")) is not None:
        out["socket"] = Path(os.path.abspath(value))
    if (value := get("MAX_BYTES")) is not None:
        out["max_bytes"] = parse_size(value, f"{ENV_PREFIX}MAX_BYTES")
    if (value := get("MAX_FRACTION")) is not None:
        out["max_fraction"] = _parse_float(value, f"{ENV_PREFIX}MAX_FRACTION")
    if "max_bytes" in out and "max_fraction" in out:
        raise SettingsError(f"set {ENV_PREFIX}MAX_BYTES or {ENV_PREFIX}MAX_FRACTION, not both")
    if (value := get("HOST")) is not None:
        out["host"] = value
    if (value := get("PORT")) is not None:
        out["port"] = _parse_int(value, f"{ENV_PREFIX}PORT")
    if (value := get("TOKEN")) is not None:
        out["token"] = value
    if (value := get("ALLOW_SOURCE")) is not None:
        dirs = [d for d in value.split(os.pathsep) if d]
        out["allow_source"] = _resolve_dirs(dirs, Path.cwd(), f"{ENV_PREFIX}ALLOW_SOURCE")
    if (value := get("CLEANUP_ON_EXIT")) is not None:
        out["cleanup_on_exit"] = _parse_bool(value, f"{ENV_PREFIX}CLEANUP_ON_EXIT")
    if (value := get("LOAD_WORKERS")) is not None:
        out["load_workers"] = _parse_int(value, f"{ENV_PREFIX}LOAD_WORKERS")
    if (value := get("MAX_LOAD_RATE")) is not None:
        out["max_load_rate"] = parse_size(value, f"{ENV_PREFIX}MAX_LOAD_RATE")
    if (value := get("LOG_LEVEL")) is not None:
        out["log_level"] = value.lower()
    return out


def _read_cli(cli: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in cli.items():
        if value is None or (name == "allow_source" and not value):
            continue
        if name in ("max_bytes", "max_load_rate"):
            out[name] = parse_size(value, f"--{name.replace('_', '-')}")
        elif name == "max_fraction":
            out[name] = _parse_float(value, "--max-fraction")
        elif name == "allow_source":
            out[name] = _resolve_dirs(list(value), Path.cwd(), "--allow-source")
        elif name == "root":
            out[name] = Path(value)
        elif name == "socket":
            out[name] = Path(os.path.abspath(value))
        elif name == "log_level":
            out[name] = str(value).lower()
        elif name == "cleanup_on_exit":
            if value:  # a flag can only turn it on
                out[name] = True
        else:
            out[name] = value
    if "max_bytes" in out and "max_fraction" in out:
        raise SettingsError("pass --max-bytes or --max-fraction, not both")
    return out


def load_settings(
    cli: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | os.PathLike[str] | None = None,
) -> Settings:
    """Merge defaults < config file < environment < CLI flags, then validate.

    ``cli`` maps :class:`Settings` field names to flag values (None = not given).
    ``env`` defaults to ``os.environ``; the config file is ``config_file``, else
    ``$SHMCACHE_CONFIG``, else none.
    """
    env = os.environ if env is None else env
    if config_file is None and env.get(ENV_PREFIX + "CONFIG"):
        config_file = env[ENV_PREFIX + "CONFIG"]
    merged: dict[str, Any] = {}
    layers = [
        _read_config(Path(os.path.abspath(config_file))) if config_file is not None else {},
        _read_env(env),
        _read_cli(cli or {}),
    ]
    for layer in layers:
        if "max_bytes" in layer or "max_fraction" in layer:  # one budget: the highest layer's
            merged.pop("max_bytes", None)
            merged.pop("max_fraction", None)
        merged.update(layer)
    root = merged.pop("root", None)
    root = Path(os.path.abspath(root if root is not None else default_root()))
    settings = Settings(
        root=root,
        config_file=Path(os.path.abspath(config_file)) if config_file is not None else None,
    )
    return replace(settings, **merged).validate()
