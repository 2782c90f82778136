"""``shmcache serve``: run the daemon, with one flag per field of its settings model.

The flags are generated from :class:`shmcache.service.settings.Settings` (the one
declaration of every daemon setting) when ``serve`` runs, not when the CLI starts:
importing pydantic-settings costs about 0.2 s, which no other command should pay, and
without the service extra the other commands still work and ``serve`` says what to install.
"""

from __future__ import annotations

import inspect
import os
import types
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args, get_origin

import typer

from .._diagnose.logind import removeipc_risk
from .._disk.layout import ENV_TEAM, SOCKET_NAME
from .._team.config import team_of
from ..errors import InvalidRequestError, ShmCacheError
from .common import debug_enabled, fail, global_root, team_option

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo

__all__ = ["register"]

_HELP = f"""Run the daemon: the HTTP control API of the cache, on <root>/{SOCKET_NAME} (mode 0600).

Only processes of the daemon's user (or root) may use the socket. TCP (--host/--port)
is opt-in and needs --allow-source; a non-loopback address also needs a token.
--team NAME (or shmcache --team NAME serve, or $SHMCACHE_TEAM without --root) serves a
team's root as its service account: the root, budget and sources come from
/etc/shmcache/teams.toml, and the team's group may use the socket (0660).

Settings: flags > SHMCACHE_* environment > config file > defaults. Stops on SIGTERM or
SIGINT: running loads are cancelled (nothing partial is published), the socket and
pid file are removed. Needs the service extra: pip install 'shmcache\\[service]'.
"""
_EXTRA = "pip install 'shmcache[service]'"


def register(app: typer.Typer) -> None:
    """Add ``serve`` to ``app``; its arguments are parsed by the generated command."""
    app.command(
        "serve",
        help=_HELP,
        add_help_option=False,  # --help goes to the generated command, which knows the flags
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    )(_serve)


def _serve(ctx: typer.Context) -> None:
    try:
        from ..service import settings
    except ImportError as exc:
        raise fail(_missing_extra(exc)) from None
    command = typer.main.get_command(_generated_app(settings.Settings.model_fields))
    command.main(list(ctx.args), prog_name=ctx.command_path, standalone_mode=True)


def _generated_app(fields: dict[str, FieldInfo]) -> typer.Typer:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command("serve", help=_HELP)(_with_flags(_run, fields))
    return app


def _run(**values: Any) -> None:
    """Load the settings (flags given in ``values``) and run the daemon until it stops."""
    try:  # FastAPI and uvicorn only now
        from ..service import SettingsError, load_settings
        from ..service import serve as run_daemon
    except ImportError as exc:
        raise fail(_missing_extra(exc)) from None
    if values.get("root") is None and global_root() is not None:  # shmcache --root R serve
        values["root"] = global_root()
    try:
        values["team"] = _team_to_serve(values.get("team"), values.get("root") is not None)
        settings = load_settings(values)
    except (SettingsError, InvalidRequestError) as exc:
        if debug_enabled():
            raise
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    risk = removeipc_risk(settings.root) if settings.team is None else None  # a team's root: see docs/team.md
    if risk is not None:  # before the daemon's own log: it is about where the cache will not last
        typer.echo(f"warning: {risk.summary}; fix: {risk.fix}", err=True)
    try:
        status = run_daemon(settings)
    except (ShmCacheError, OSError) as exc:
        raise fail(exc) from None
    raise typer.Exit(status)


def _team_to_serve(flag: str | None, root_given: bool) -> str | None:
    """``serve --team``, else the global ``shmcache --team`` (the same), else
    ``$SHMCACHE_TEAM`` where no ``--root`` is given, as for every other command (with a
    notice: a member who exported it for reads is told which root this would serve)."""
    given = team_option()
    if flag is not None and given is not None and flag != given:
        raise InvalidRequestError(
            f"shmcache --team {given} serve --team {flag}: two teams; give one --team"
        )
    team = flag if flag is not None else given
    if team is None and not root_given:
        team = team_of(None, None)  # $SHMCACHE_TEAM (refused with $SHMCACHE_ROOT, as for reads)
        if team is not None:
            typer.echo(
                f"notice: serving team {team}'s root (${ENV_TEAM}); `shmcache serve --root ROOT` "
                "serves another", err=True,
            )
    return team


def _missing_extra(exc: ImportError) -> ShmCacheError:
    return ShmCacheError(f"shmcache serve needs the service extra ({exc.name} is missing): {_EXTRA}")


# ---------------------------------------------------------------------- flags from the fields


def _with_flags(run: Callable[..., None], fields: dict[str, FieldInfo]) -> Callable[..., None]:
    """``run`` with a keyword parameter per setting that has a flag, as typer reads them."""
    from ..service.settings import flag_name, given

    parameters = [
        inspect.Parameter(
            name,
            inspect.Parameter.KEYWORD_ONLY,
            default=False if _flag_type(field) is bool else None,
            annotation=Annotated[
                _flag_type(field),
                typer.Option(
                    flag_name(name),
                    help=_flag_help(name, field),
                    show_default=False,
                    **_path_checks(_flag_type(field)),
                ),
            ],
        )
        for name, field in fields.items()
        if given(field).flag
    ]

    def command(**values: Any) -> None:
        run(**values)

    command.__signature__ = inspect.Signature(parameters, return_annotation=None)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": None}
    command.__doc__ = _HELP
    return command


def _path_checks(kind: Any) -> dict[str, Any]:
    """A path flag is not checked by typer (which calls a root another user keeps private
    "not readable", a usage error): the settings and the daemon say what is wrong with it."""
    return {"readable": False} if Path in get_args(kind) or kind is Path else {}


def _flag_type(field: FieldInfo) -> Any:
    """The type typer parses the flag as; the settings model validates the value after."""
    from ..service.settings import takes_text

    kind = _without_none(field.annotation)
    if takes_text(field) or get_origin(kind) is Literal:
        return str | None
    if kind is bool:
        return bool
    if get_origin(kind) is tuple:  # a repeatable flag
        item = get_args(kind)[0]
        item = get_args(item)[0] if get_origin(item) is Annotated else item
        if get_origin(item) in (Union, types.UnionType):  # e.g. a directory or a URL: as text
            item = str
        return list[item] | None  # type: ignore[valid-type]
    return kind | None


def _without_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        rest = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def _flag_help(name: str, field: FieldInfo) -> str:
    """The field's description, its default and its environment variable."""
    from ..service.settings import env_name, given

    notes = []
    default = field.default
    if default not in (None, False, ()) and field.default_factory is None and not isinstance(default, Path):
        notes.append(f"default {default}")
    if given(field).env:
        listed = get_origin(_without_none(field.annotation)) is tuple
        notes.append(f"env: {env_name(name)}" + (f", '{os.pathsep}'-separated" if listed else ""))
    text = (field.description or name).rstrip(".")
    return f"{text} ({'; '.join(notes)})." if notes else f"{text}."
