"""The daemon's settings, declared once: each field of :class:`Settings` is one setting.

A field's name is its config-file key; ``SHMCACHE_<NAME>`` its environment variable;
``--<name-with-dashes>`` its ``shmcache serve`` flag (generated from the fields); its type,
default, description and constraints are declared on the field and nowhere else.

Precedence, as pydantic-settings sources: flags > environment > config file > defaults.
The config file is TOML (``--config`` or ``SHMCACHE_CONFIG``); relative paths in it are
relative to the file. One budget wins whole: a layer that sets ``max_bytes`` or
``max_fraction`` replaces both of the layers below. Errors say which setting, where it came
from (flag, variable or file) and why. Nothing else in the service reads ``os.environ``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

from pydantic import AfterValidator, BeforeValidator, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from shmcache._disk.layout import ENV_PREFIX, SOCKET_NAME, Layout, default_root
from shmcache._sources.urls import is_url

from .setting_fields import (
    DatasetSpec,
    Given,
    LogLevel,
    SettingsError,
    Size,
    _absolute,
    _dataset_tables,
    _host_name,
    _long_enough,
    _lower,
    _one_or_many,
    _resolve_sources,
    _source_prefix,
    env_name,
    flag_name,
    given,
    is_loopback,
    loopback_names,
    normal_host,
    parse_size,
    takes_text,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "DEFAULT_LOAD_WORKERS",
    "DEFAULT_LOCK_TIMEOUT",
    "DEFAULT_REQUEST_TIMEOUT",
    "ENV_PREFIX",
    "DatasetSpec",
    "Given",
    "Settings",
    "SettingsError",
    "env_name",
    "flag_name",
    "given",
    "is_loopback",
    "load_settings",
    "loopback_names",
    "normal_host",
    "parse_size",
    "takes_text",
]

DEFAULT_LOAD_WORKERS = 2
DEFAULT_REQUEST_TIMEOUT = 10.0
DEFAULT_LOCK_TIMEOUT = 60.0
_BUDGET = ("max_bytes", "max_fraction")
# ---------------------------------------------------------------------- the table


class Settings(BaseSettings):
    """Everything ``shmcache serve`` needs; :func:`load_settings` reads it from flags,
    environment and config file (``Settings(**values)`` also reads ``os.environ``)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_ignore_empty=True, extra="forbid", frozen=True
    )

    root: Annotated[Path, AfterValidator(_absolute)] = Field(
        default_factory=default_root,
        validate_default=True,
        description="Cache root (default /dev/shm/shmcache-<uid>).",
    )
    socket: Annotated[Path | None, AfterValidator(_absolute)] = Field(
        None, description=f"Unix socket path (default <root>/{SOCKET_NAME})."
    )
    max_bytes: Size = Field(
        None,
        ge=0,
        description="The root's budget, e.g. 32GiB, recorded in the root and kept by every writer "
        "(replacing a different recorded one; without it the recorded one stays): puts evict "
        "least-recently-used unpinned, unmapped entries to stay within it.",
    )
    max_fraction: float | None = Field(
        None, gt=0, le=1, description="The root's budget as a fraction of its file system, e.g. 0.5 "
        "(recorded in bytes, as --max-bytes)."
    )
    config: Annotated[Path | None, AfterValidator(_absolute), Given(file=False)] = Field(
        None, description="TOML config file (root, max_bytes, allow_source, datasets to preload, ...)."
    )
    host: str | None = Field(
        None,
        description="Also listen on TCP at this address (needs --port and --allow-source; a "
        "non-loopback address needs --token).",
    )
    port: int | None = Field(None, ge=0, le=65535, description="TCP port (0 picks a free one).")
    token: Annotated[str | None, AfterValidator(_long_enough)] = Field(
        None,
        description="Bearer token TCP clients must send (16 characters or more); prefer the "
        "environment variable: a flag is visible in ps.",
    )
    allow_host: Annotated[
        tuple[Annotated[str, AfterValidator(_host_name)], ...], BeforeValidator(_one_or_many)
    ] = Field(
        (),
        description="Host name TCP clients may send in the Host header besides localhost, 127.0.0.1, "
        "[::1] and the --host address (repeatable; no port). Any other Host is refused (421): this "
        "stops DNS rebinding.",
    )
    allow_source: Annotated[
        tuple[Annotated[Path | str, BeforeValidator(_source_prefix)], ...], BeforeValidator(_one_or_many)
    ] = Field(
        (),
        description="Directory the API may load from (repeatable; symlinks and .. are resolved "
        "first), or URL prefix (s3://bucket/data: loads under it, with the daemon's own "
        "credentials). Default: anything the daemon can read, and no URL.",
    )
    request_timeout: float = Field(
        DEFAULT_REQUEST_TIMEOUT,
        gt=0,
        description="Seconds a connection has to send a whole request (line, headers and body) once "
        "it opens or starts one; slower ones are closed (slow or idle clients must not hold the "
        "daemon's descriptors).",
    )
    lock_timeout: float = Field(
        DEFAULT_LOCK_TIMEOUT,
        gt=0,
        description="Seconds a load waits for a key lock held by another process that is still "
        "running (a cache() loader, a put), 'inf' for no bound; a holder stopped (Ctrl+Z) for 3 s "
        "fails the load at once, naming it. Requests wait at most 5 s.",
    )
    team: Annotated[str | None, Given(env=False)] = Field(
        None,
        description="Serve this team's root, as /etc/shmcache/teams.toml (or $SHMCACHE_TEAMS_FILE) "
        "declares it, running as its service account: the root, budget and allowed sources come "
        "from there; members of the team's group may use the socket (docs/team.md).",
    )
    cleanup_on_exit: bool = Field(False, description="Evict every entry when stopping.")
    huge_pages: bool = Field(
        False,
        description="After each load, put the entry's files of 2 MiB or more on huge pages "
        "(MADV_COLLAPSE: Linux >= 6.1, no root), so that CachedDataset(huge_pages=True) finds "
        "them made and the daemon's memory cgroup, not a training job's, is charged for them.",
    )
    load_workers: int = Field(DEFAULT_LOAD_WORKERS, ge=1, description="Loads that run at once.")
    max_load_rate: Size = Field(
        None,
        gt=0,
        description="Bytes per second per load, e.g. 500MiB, to leave memory bandwidth to "
        "training (default: unlimited).",
    )
    log_level: Annotated[LogLevel, BeforeValidator(_lower)] = Field(
        "info", description="debug, info, warning or error."
    )
    datasets: Annotated[
        tuple[DatasetSpec, ...],
        BeforeValidator(_dataset_tables),
        AfterValidator(_resolve_sources),
        Given(flag=False, env=False),
    ] = Field((), description="Entries to load at start-up: [[datasets]] key, source, pin.")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags (the keyword arguments) > environment > config file > defaults."""
        return init_settings, _Environment(settings_cls, _ENVIRON.get()), _ConfigFile(settings_cls)

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        """Refuse unsafe or contradictory combinations."""
        host, port, token, allow = (flag_name(n) for n in ("host", "port", "token", "allow_source"))
        if self.max_bytes is not None and self.max_fraction is not None:
            raise ValueError("set max_bytes or max_fraction, not both")
        if self.team is not None:
            given_too = sorted(
                flag_name(n) for n in ("root", "socket", "max_bytes", "max_fraction", "allow_source", "host")
                if n in self.model_fields_set
            )
            if given_too:
                raise ValueError(
                    f"{flag_name('team')} takes the root, budget and allowed sources from the teams "
                    f"file, and listens on the team root's socket only: drop {', '.join(given_too)} "
                    f"(or its {ENV_PREFIX}* variable)"
                )
        if self.port is not None and self.host is None:
            raise ValueError(f"{port} needs {host} (TCP is opt-in; the default is the Unix socket)")
        if self.allow_host and self.host is None:
            raise ValueError(f"{flag_name('allow_host')} needs {host}: it names the daemon over TCP")
        if self.host is not None:
            if self.port is None:
                raise ValueError(f"{host} needs {port} (0 picks a free port)")
            if not is_loopback(self.host) and not self.token:
                raise ValueError(
                    f"refusing to listen on non-loopback host {self.host!r} without a token: anyone "
                    f"who can reach it could load and evict data. Pass {token} (or {env_name('token')}) "
                    "and clients send 'Authorization: Bearer <token>'"
                )
            if not self.allow_source:
                raise ValueError(
                    f"TCP needs at least one {allow} DIR: over TCP the daemon cannot tell who asks, "
                    "so it only loads from directories you allow"
                )
        return self

    @property
    def allow_dirs(self) -> tuple[Path, ...]:
        """The directories of ``allow_source``."""
        return tuple(p for p in self.allow_source if isinstance(p, Path))

    @property
    def allow_urls(self) -> tuple[str, ...]:
        """The URL prefixes of ``allow_source``."""
        return tuple(p for p in self.allow_source if isinstance(p, str))

    @property
    def socket_path(self) -> Path:
        return self.socket if self.socket is not None else Layout(self.root).socket

    @property
    def pid_path(self) -> Path:
        return Layout(self.root).pid_file

    @property
    def uses_tcp(self) -> bool:
        return self.host is not None

    @property
    def host_names(self) -> frozenset[str] | None:
        """The names a TCP request's Host header may give (without port), or None to take any:
        checked when the daemon listens on loopback (a browser on this machine could be pointed
        at it by DNS rebinding) or ``allow_host`` names some."""
        if self.host is None or not (is_loopback(self.host) or self.allow_host):
            return None
        own = normal_host(self.host)
        return loopback_names() | set(self.allow_host) | ({own} if own else set())

    def load_lock_timeout(self) -> float | None:
        """``lock_timeout`` as a Store takes it (None: no bound)."""
        return None if self.lock_timeout == float("inf") else self.lock_timeout

    def budget_bytes(self, capacity: int) -> int | None:
        """The byte budget, given the capacity of the root's file system."""
        if self.max_fraction is not None:
            return int(capacity * self.max_fraction)
        return self.max_bytes


# ---------------------------------------------------------------------- sources

_ENVIRON: ContextVar[Mapping[str, str] | None] = ContextVar("shmcache_settings_environ", default=None)
"""The environment :func:`load_settings` was given (None: ``os.environ``)."""


def _one_budget(values: dict[str, Any], spell: Callable[[str], str], state: Mapping[str, Any]) -> None:
    """Refuse both budgets in one layer; drop this layer's budget when a higher one set one."""
    if all(name in values for name in _BUDGET):
        first, second = (spell(name) for name in _BUDGET)
        raise SettingsError(f"set {first} or {second}, not both")
    if any(name in state for name in _BUDGET):
        for name in _BUDGET:
            values.pop(name, None)


class _Environment(EnvSettingsSource):
    """``SHMCACHE_<NAME>`` variables; list settings are ``os.pathsep``-separated."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str] | None) -> None:
        super().__init__(settings_cls)
        if environ is not None:
            self.env_vars = {name.lower(): value for name, value in environ.items() if value}

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        if not given(field).env:
            return None, field_name, False
        return super().get_field_value(field, field_name)

    def prepare_field_value(
        self, field_name: str, field: FieldInfo, value: Any, value_is_complex: bool
    ) -> Any:
        if isinstance(value, str) and get_origin(field.annotation) is tuple:
            return [item for item in value.split(os.pathsep) if item]
        return super().prepare_field_value(field_name, field, value, value_is_complex)

    def __call__(self) -> dict[str, Any]:
        values = super().__call__()
        _one_budget(values, env_name, self.current_state)
        return values


class _ConfigFile(PydanticBaseSettingsSource):
    """The TOML file that a flag or the environment named (``config``)."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # __call__ reads the whole file at once

    def __call__(self) -> dict[str, Any]:
        named = self.current_state.get("config")
        if named is None:
            return {}
        path = Path(os.path.abspath(named))
        data = _read_toml(path)
        fields = self.settings_cls.model_fields
        known = sorted(name for name, field in fields.items() if given(field).file)
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise SettingsError(
                f"config file {path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(known)}"
            )
        try:
            _one_budget(data, str, self.current_state)
        except SettingsError as exc:
            raise SettingsError(f"config file {path}: {exc}") from None
        base = path.parent
        for name, value in data.items():
            data[name] = _relative_to(base, fields[name].annotation, value)
        return data


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fp:
            return tomllib.load(fp)
    except FileNotFoundError:
        raise SettingsError(f"config file {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SettingsError(f"cannot read config file {path}: {exc}") from exc


def _mentions(annotation: Any, kind: type[Any]) -> bool:
    return annotation is kind or any(_mentions(arg, kind) for arg in get_args(annotation))


def _relative_to(base: Path, annotation: Any, value: Any) -> Any:
    """A config file's paths (strings where the field holds paths) made relative to its directory."""
    if isinstance(value, str) and is_url(value):
        return value  # a URL is not relative to anything
    if isinstance(value, list):
        return [_relative_to(base, annotation, item) for item in value]
    if isinstance(value, dict) and _mentions(annotation, DatasetSpec):
        source = value.get("source")
        if isinstance(source, str) and not is_url(source):
            return {**value, "source": str(base / source)}
        return value
    if isinstance(value, str) and _mentions(annotation, Path):
        return str(base / value)
    return value


# ---------------------------------------------------------------------- loading


def load_settings(
    cli: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | os.PathLike[str] | None = None,
) -> Settings:
    """Merge defaults < config file < environment < flags, then validate.

    ``cli`` maps :class:`Settings` field names to flag values (None, an empty list or a
    false on/off flag = not given). ``env`` defaults to ``os.environ``; the config file is
    ``config_file``, else ``cli["config"]``, else ``$SHMCACHE_CONFIG``, else none.
    """
    flags = {name: value for name, value in (cli or {}).items() if not _unset(value)}
    if config_file is not None:
        flags["config"] = config_file
    _one_budget(flags, flag_name, {})
    with _environment(env):
        try:
            return Settings(**flags)
        except ValidationError as exc:
            environ = os.environ if env is None else env
            raise SettingsError(_explain(exc, flags, environ)) from None


def _unset(flag: object) -> bool:
    """An absent flag: None, no repetition of a repeatable one, an on/off flag left off."""
    return flag is None or flag is False or (isinstance(flag, (list, tuple)) and not flag)


@contextmanager
def _environment(env: Mapping[str, str] | None) -> Iterator[None]:
    token = _ENVIRON.set(env)
    try:
        yield
    finally:
        _ENVIRON.reset(token)


def _explain(exc: ValidationError, flags: Mapping[str, Any], environ: Mapping[str, str]) -> str:
    """One clause per problem: the setting as the user gave it, and what is wrong with it."""
    config = flags.get("config") or environ.get(env_name("config"))
    clauses = []
    for error in exc.errors():
        loc, kind, ctx = error["loc"], error["type"], error.get("ctx") or {}
        if kind == "value_error":  # our validators' messages (a secret is never echoed)
            reason = str(ctx.get("error", error["msg"]))
        elif kind in _BOUND_ERRORS and loc:
            reason = f"must be {_bounds(Settings.model_fields[str(loc[0])])}, got {error['input']!r}"
        else:
            reason = f"{_REASONS.get(kind, error['msg']).format(**ctx)}, got {error['input']!r}"
        if not loc:  # a rule across settings: its message names them
            clauses.append(reason)
            continue
        where = _spelling(str(loc[0]), flags, environ, config)
        where += "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc[1:])
        clauses.append(f"{where}{'' if reason.startswith('[') else ' '}{reason}")
    return "; ".join(clauses)


def _spelling(name: str, flags: Mapping[str, Any], environ: Mapping[str, str], config: object) -> str:
    """The setting ``name`` as given: its flag, its variable, or its key in the config file."""
    field = Settings.model_fields.get(name)
    if name in flags or field is None:
        return flag_name(name)
    if given(field).env and environ.get(env_name(name)):
        return env_name(name)
    if config:
        return f"config file {os.path.abspath(str(config))}: {name}"
    return name


def _bounds(field: FieldInfo) -> str:
    """A field's numeric constraints in words: ``>= 1``, ``in 0..65535``, ``in (0, 1]``."""
    limits: dict[str, Any] = {}
    for item in field.metadata:
        for kind in ("ge", "gt", "le", "lt"):
            if getattr(item, kind, None) is not None:
                limits[kind] = getattr(item, kind)
    low = ("[", limits["ge"]) if "ge" in limits else ("(", limits["gt"]) if "gt" in limits else None
    high = ("]", limits["le"]) if "le" in limits else (")", limits["lt"]) if "lt" in limits else None
    if low and high:
        if low[0] == "[" and high[0] == "]" and isinstance(low[1], int) and isinstance(high[1], int):
            return f"in {low[1]}..{high[1]}"
        return f"in {low[0]}{low[1]}, {high[1]}{high[0]}"
    if low:
        return f"{'>=' if low[0] == '[' else '>'} {low[1]}"
    if high:
        return f"{'<=' if high[0] == ']' else '<'} {high[1]}"
    return "in range"


_BOUND_ERRORS = {"greater_than_equal", "greater_than", "less_than_equal", "less_than"}
_REASONS = {
    "int_parsing": "must be an integer",
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "bool_parsing": "must be true or false",
    "bool_type": "must be true or false",
    "string_type": "must be text",
    "path_type": "must be a path",
    "literal_error": "must be one of {expected}",
    "tuple_type": "must be a list",
    "extra_forbidden": "is not a setting",
}
