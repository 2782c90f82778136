"""``shmcache budget``: show, set or clear the root's byte budget.

The budget is recorded in the root (``<root>/budget.json``), so every writer keeps it:
library calls, the CLI with or without a daemon, the daemon and its preloads. Through the
daemon when one serves the root (it may be the only one allowed to write there), else in
this process (``--local``: in this process regardless).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from .._store import Store
from .._store.budget import checked_budget, read_budget
from .._units import human_bytes
from ..errors import DaemonUnavailableError
from .backend import daemon_client, resolve_root
from .common import fail, failures_exit_1
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
        show(ctx)


@dataclass(frozen=True)
class _GroupOptions:
    root: Path | None
    as_json: bool
    local: bool


def _group(ctx: typer.Context) -> _GroupOptions:
    found = ctx.find_object(_GroupOptions)
    return found if found is not None else _GroupOptions(None, False, False)


@budget_app.command()
def show(
    ctx: typer.Context, root: RootOption = None, as_json: JsonOption = False, local: LocalOption = False
) -> None:
    """The budget, who set it and when, and how much of it the entries use."""
    group = _group(ctx)
    root, as_json, local = root or group.root, as_json or group.as_json, local or group.local
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
    group = _group(ctx)
    with failures_exit_1():
        nbytes = checked_budget(size, "SIZE")
    _print(_call(root or group.root, local or group.local, "PUT", nbytes)[0])


@budget_app.command()
def clear(ctx: typer.Context, root: RootOption = None, local: LocalOption = False) -> None:
    """Remove the root's budget: puts are bounded by the file system only."""
    group = _group(ctx)
    _print(_call(root or group.root, local or group.local, "PUT", None)[0])


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
        store = Store(resolve_root(root))
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
    # Client has no budget methods yet: the request through its connection and error mapping.
    body = {"max_bytes": max_bytes} if method == "PUT" else None
    answer: dict[str, Any] = client._request(method, "/v1/budget", json=body)
    return answer


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
