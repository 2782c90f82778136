"""What the fields of :class:`~shmcache.service.settings.Settings` are made of: where each
may be given (markers), the parsers and checks of their values, the preload record, and
host names as the Host header gives them."""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator
from pydantic.fields import FieldInfo

from shmcache._disk.layout import ENV_PREFIX
from shmcache._sources.urls import is_url, local_path_of, redact_url
from shmcache._units import size_in_bytes

__all__ = [
    "DatasetSpec",
    "Given",
    "LogLevel",
    "SettingsError",
    "Size",
    "env_name",
    "flag_name",
    "given",
    "is_loopback",
    "loopback_names",
    "normal_host",
    "parse_size",
    "takes_text",
]

_MIN_TOKEN = 16
_HOST_RE = re.compile(r"[a-z0-9_.-]+|[0-9a-f:.]*:[0-9a-f:.]*")  # a name, an IPv4 or an IPv6 address
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


class SettingsError(ValueError):
    """A setting is missing, malformed or unsafe; the message says which, from where, and why."""


@dataclass(frozen=True)
class DatasetSpec:
    """One ``[[datasets]]`` table of the config file: loaded at start-up."""

    key: str
    source: Path | str
    """A path, or a URL (``s3://...``: loaded with the daemon's own credentials)."""
    pin: bool = False


# ---------------------------------------------------------------------- markers on fields


@dataclass(frozen=True)
class Given:
    """Where a setting may be given, when not everywhere (flag, environment, config file)."""

    flag: bool = True
    env: bool = True
    file: bool = True


_EVERYWHERE = Given()


class _TakesText:
    """Marks a setting whose flag takes text that its validator parses (``8GiB``)."""


def _marker(field: FieldInfo, kind: type[Any]) -> Any:
    return next((m for m in field.metadata if isinstance(m, kind)), None)


def given(field: FieldInfo) -> Given:
    """Where ``field`` may be given."""
    found: Given | None = _marker(field, Given)
    return found or _EVERYWHERE


def takes_text(field: FieldInfo) -> bool:
    """Whether the flag of ``field`` takes text (parsed by the field's validator)."""
    return _marker(field, _TakesText) is not None


def flag_name(name: str) -> str:
    """The ``shmcache serve`` flag of setting ``name``."""
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    """The environment variable of setting ``name``."""
    return ENV_PREFIX + name.upper()


# ---------------------------------------------------------------------- value parsers


def parse_size(value: object, what: str = "size") -> int:
    """``"8GiB"``, ``"500M"``, ``"1.5G"`` or an integer -> bytes (K/M/G/T/P are powers of 1024)."""
    try:
        return size_in_bytes(value)
    except ValueError as exc:
        raise SettingsError(f"{what} {exc}") from None


def _optional_size(value: object) -> int | None:
    return None if value is None else size_in_bytes(value)


def _absolute(path: Path | None) -> Path | None:
    return None if path is None else Path(os.path.abspath(path))


def _directory(path: Path) -> Path:
    real = Path(os.path.realpath(path))
    if not real.is_dir():
        raise ValueError(f"names {real}, which is not a directory")
    return real


def _source_prefix(value: object) -> object:
    """An ``--allow-source`` entry: a directory (resolved), or a URL prefix (``s3://bucket/data``)
    kept as text, without credentials (they would show in the settings and in messages)."""
    if isinstance(value, str) and is_url(value):
        local = local_path_of(value)
        if local is None:
            if redact_url(value) != value:
                raise ValueError(f"URL prefix {redact_url(value)} must not carry user information or a query")
            return value.rstrip("/")
        value = local
    if isinstance(value, (str, os.PathLike)):
        return _directory(Path(value))
    return value


def _one_or_many(value: object) -> object:
    return [value] if isinstance(value, (str, os.PathLike)) else value


def _lower(value: object) -> object:
    return value.lower() if isinstance(value, str) else value


def _long_enough(token: str | None) -> str | None:
    if token is not None and len(token) < _MIN_TOKEN:
        raise ValueError(f"is too short: use at least {_MIN_TOKEN} random characters")
    return token


def _host_name(value: str) -> str:
    name = normal_host(value)
    with_port = "]:" in value or value.count(":") == 1
    if name is None or with_port or name.isdigit() or not _HOST_RE.fullmatch(name):
        raise ValueError(
            f"{value!r} is not a host name or address; give it without a port or scheme "
            "(e.g. cache.example or 10.0.0.5)"
        )
    return name


def _dataset_tables(value: object) -> object:
    """``[[datasets]]`` as TOML gives it: an array of tables with key, source and maybe pin."""
    if not isinstance(value, (list, tuple)):
        raise ValueError("must be an array of tables ([[datasets]])")
    for i, table in enumerate(value):
        if isinstance(table, DatasetSpec):
            continue
        if not isinstance(table, dict) or not {"key", "source"} <= set(table):
            raise ValueError(f"[{i}] needs key = ... and source = ...")
        extra = sorted(set(table) - {"key", "source", "pin"})
        if extra:
            raise ValueError(f"[{i}] has unknown field(s) {', '.join(extra)}")
    return value


def _resolve_sources(specs: tuple[DatasetSpec, ...]) -> tuple[DatasetSpec, ...]:
    return tuple(replace(spec, source=_dataset_source(spec.source)) for spec in specs)


def _dataset_source(source: Path | str) -> Path | str:
    """A preload's source: a URL as given (``file://`` as its path), a path resolved."""
    if isinstance(source, str) and is_url(source):
        local = local_path_of(source)
        if local is None:
            return source
        source = local
    return Path(os.path.realpath(source))


Size = Annotated[int | None, BeforeValidator(_optional_size), _TakesText()]
LogLevel = Literal["debug", "info", "warning", "error"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from outside


def loopback_names() -> frozenset[str]:
    """Host names that always mean this machine (``localhost``, ``127.0.0.1``, ``::1``)."""
    return _LOOPBACK_NAMES


def normal_host(host: str) -> str | None:
    """``host`` as a Host header names it, compared as such: lower case, without port, IPv6
    brackets or a trailing dot; None when it is malformed (a bare IPv6 address with a port...)."""
    host = host.strip().lower()
    if host.startswith("["):
        name, bracket, rest = host[1:].partition("]")
        if not bracket or (rest and not (rest[0] == ":" and rest[1:].isdigit())):
            return None
    elif host.count(":") == 1:
        name, _, port = host.partition(":")
        if not port.isdigit():
            return None
    else:
        name = host  # a name, an IPv4 address or a bare IPv6 address (no port to split off)
    name = name.rstrip(".")
    return name or None
