"""``shmcache budget``: show, set or clear the root's byte budget.

The budget is recorded in the root (``<root>/budget.json``), so every writer keeps it:
library calls, the CLI with or without a daemon, the daemon and its preloads. Through the
daemon when one serves the root (it may be the only one allowed to write there), else in
this process (``--local``: in this process regardless).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from .._store.budget import checked_budget, read_budget
from .._units import human_bytes
from ..errors import DaemonUnavailableError, InvalidRequestError
from .backend import daemon_client, local_store, refuse_team_writes_here, resolve_root
from .common import fail, failures_exit_1, usage_error
from .options import JsonOption, LocalOption, RootOption

if TYPE_CHECKING:
    from ..client import Client

__all__ = ["budget_app", "register"]

budget_app = typer.Typer(
    name="budget",
    help="Show, set or clear the root's byte budget, which every writer keeps: a put beyond it "
    "evicts least-recently-used entries that are neither pinned nor mapped, or fails. Without a "
    "subcommand: show.",
    no_args_is_help=False,
    add_completion=False,
)


def register(app: typer.Typer) -> None:
    app.add_typer(budget_app, name="budget")


@budget_app.callback(invoke_without_command=True)
def _default(
    ctx: typer.Context, root: RootOption = None, as_json: JsonOption = False, local: LocalOption = False
) -> None:
    ctx.obj = _GroupOptions(root, as_json, local)  # `budget --root R set ...` means R too
    if ctx.invoked_subcommand is None:
        show(ctx, root, as_json, local)


@dataclass(frozen=True)
class _GroupOptions:
    root: Path | None
    as_json: bool
    local: bool


def _options(ctx: typer.Context, root: Path | None, local: bool) -> tuple[Path | None, bool]:
    """``--root`` and ``--local`` of a subcommand, or the group's (``budget --root R set``):
    a root on the subcommand's own command line wins, then the group's, then
    ``$SHMCACHE_ROOT`` or the default."""
    found = ctx.find_object(_GroupOptions)
    group = found if found is not None else _GroupOptions(None, False, False)
    source = ctx.get_parameter_source("root")  # (typer bundles its own click: compared by name)
    if (source is None or source.name != "COMMANDLINE") and group.root is not None:
        root = group.root
    return root, local or group.local


@budget_app.command()
def show(
    ctx: typer.Context, root: RootOption = None, as_json: JsonOption = False, local: LocalOption = False
) -> None:
    """The budget, who set it and when, and how much of it the entries use."""
    root, local = _options(ctx, root, local)
    found = ctx.find_object(_GroupOptions)
    as_json = as_json or (found is not None and found.as_json)
    state, daemon = _call(root, local, "GET")
    if as_json:
        typer.echo(json.dumps({"root": str(resolve_root(root)), **state, "daemon": daemon}, indent=1))
        return
    _print(state)


@budget_app.command("set")
def set_command(
    ctx: typer.Context,
    size: Annotated[
        str,
        typer.Argument(help="The budget: bytes, or a size such as 64GiB, 500M.", show_default=False),
    ],
    root: RootOption = None,
    local: LocalOption = False,
) -> None:
    """Record the root's budget, kept by every writer from now on.

    A budget below what the root holds evicts nothing now: the next put evicts to fit, and
    `shmcache doctor` fails until then.
    """
    try:
        nbytes = checked_budget(size, "SIZE")
    except InvalidRequestError as exc:  # a bad argument: a usage error, as serve --max-bytes 10XB
        raise usage_error(str(exc)) from None
    if nbytes == 0:
        typer.echo("warning: a budget of 0 bytes: no put fits until it is raised (`shmcache budget clear` "
                   "removes it)", err=True)
    _print(_call(*_options(ctx, root, local), "PUT", nbytes)[0])


@budget_app.command()
def clear(ctx: typer.Context, root: RootOption = None, local: LocalOption = False) -> None:
    """Remove the root's budget: puts are bounded by the file system only."""
    _print(_call(*_options(ctx, root, local), "PUT", None)[0])


def _call(
    root: Path | None, local: bool, method: str, max_bytes: int | None = None
) -> tuple[dict[str, Any], bool]:
    """``GET`` or ``PUT`` the budget through the daemon serving ``root``, else on the root in
    this process: the state afterwards (``Budget`` of the HTTP API) and whether the daemon
    answered."""
    try:
        client = daemon_client(root, local)
    except DaemonUnavailableError as exc:
        raise fail(exc) from None
    with failures_exit_1():
        if client is not None:
            with client:
                return _through_daemon(client, method, max_bytes), True
        if method == "PUT" and not local:
            refuse_team_writes_here(root, "set the budget")
        store = local_store(root)
        if method == "PUT":
            store.set_budget(max_bytes, set_by="shmcache budget")
        record = read_budget(store.layout)
        used = store.stats().used
    return {
        "max_bytes": None if record is None else record.max_bytes,
        "set_by": None if record is None else record.set_by,
        "set_at": None if record is None else record.set_at,
        "used": used,
        "over_budget": record is not None and used > record.max_bytes,
    }, False


def _through_daemon(client: Client, method: str, max_bytes: int | None) -> dict[str, Any]:
    state = client.set_budget(max_bytes) if method == "PUT" else client.budget()
    return asdict(state)


def _print(state: dict[str, Any]) -> None:
    max_bytes, used = state["max_bytes"], int(state["used"])
    if max_bytes is None:
        typer.echo("budget:   none (puts are bounded by the file system only)")
        typer.echo(f"used:     {human_bytes(used)}")
        return
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state["set_at"] or 0))
    typer.echo(f"budget:   {human_bytes(max_bytes)} ({max_bytes} bytes; set by {state['set_by']}, {when})")
    share = f"{100 * used / max_bytes:.0f}%" if max_bytes else "-"
    typer.echo(f"used:     {human_bytes(used)} ({share})")
    if state["over_budget"]:
        typer.echo(
            f"warning:  {human_bytes(used - max_bytes)} over the budget: the next put evicts "
            "least-recently-used entries that are neither pinned nor mapped to fit (or fails); "
            "`shmcache evict KEY` frees space now",
            err=True,
        )
