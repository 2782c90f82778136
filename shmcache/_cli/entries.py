"""The commands on entries: ``put``, ``ls``, ``info``, ``evict``, ``cleanup``, ``stats``,
``verify``.

Each picks its backend once (:mod:`.backend`): the daemon serving the root, else this
process. ``put`` is the one that cares which: through the daemon it submits one load
per source, so several sources load in parallel, and Ctrl+C cancels them.
"""

from __future__ import annotations

import glob
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from .._disk.keys import validate_key
from .._disk.procmaps import MappingScan
from .._error_table import CLI, fix
from .._sources.files import PLANNERS
from .._sources.tar_shards import is_shard_source
from .._sources.token_files import is_token_source
from .._sources.urls import is_url
from .._store import EntryInfo, Store, StoreStats
from .._store.maintenance import linked_keys
from .._store.member_writes import MemberWriter
from .._store.ownership import owner_name, usage_by_owner
from .._units import human_bytes
from ..errors import (
    CorruptEntryError,
    InvalidKeyError,
    InvalidSourceError,
    KeyExistsError,
    KeyNotFoundError,
    ShmCacheError,
    SourceNotFoundError,
)
from .backend import command_team, local_store, open_backend
from .common import EXIT_INTERRUPTED, fail, failures_exit_1, print_table, set_team, warn_or_raise
from .daemon_put import interrupts_restored, put_through, report
from .options import ByUserOption, JsonOption, LocalOption, RootOption

if TYPE_CHECKING:
    from rich.progress import Progress


__all__ = ["cleanup", "evict", "info", "list_command", "put", "register", "stats", "verify"]

_POLL_MIN_S = 0.01
_POLL_MAX_S = 0.2


def register(app: typer.Typer) -> None:
    """Add the entry commands to ``app`` (in the order ``--help`` lists them)."""
    app.command()(put)
    app.command("ls")(list_command)
    app.command()(info)
    app.command()(evict)
    app.command()(cleanup)
    app.command()(stats)
    app.command()(verify)


# ---------------------------------------------------------------------- put


class PutAs(str, Enum):
    """What ``put --as`` makes of a directory (``Store.put_file``'s ``as_``)."""

    auto = "auto"
    arrays = "arrays"
    blobs = "blobs"


def put(
    path: Annotated[
        str,
        typer.Argument(
            help="A .npy, .npz, .safetensors, .pt/.pth (state dict) or .h5/.hdf5 file; a .parquet, "
            ".feather, .csv or .jsonl table, or a datasets save_to_disk folder (a table per split); "
            "a raw token file with --dtype, or a Megatron .bin/.idx pair; a directory of array files "
            "(or of any files: one blobs entry, see --as), or a quoted glob ('data/*.npy'): "
            "each match goes under KEY/<name without its suffix>; each array, tensor or dataset of a "
            "multi-array file under KEY/<its name>. Tar shards ('shards/{000..099}.tar', "
            "'shards/*.tar', one .tar) become ONE blobs entry, a blob per member.",
            show_default=False,
            metavar="PATH",
        ),
    ],
    key: Annotated[
        str,
        typer.Option("--key", "-k", help="Key (a directory puts KEY/<relative path>).", show_default=False),
    ],
    root: RootOption = None,
    pin: Annotated[bool, typer.Option("--pin", help="Never evict it to stay within a budget.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace existing entries.")] = False,
    progress: Annotated[
        bool | None,
        typer.Option("--progress/--no-progress", help="Byte progress bar on stderr (default: on a terminal).",
                     show_default=False),
    ] = None,
    local: LocalOption = False,
    as_: Annotated[
        PutAs,
        typer.Option(
            "--as",
            help="What a directory becomes: 'arrays' (KEY/<name> per .npy/.npz), 'blobs' (one "
            "entry holding every file's bytes, e.g. images: open_blobs(KEY)) or 'auto' (blobs when "
            "it holds no array files; a directory mixing both asks for one of the two).",
        ),
    ] = PutAs.auto,
    storage_option: Annotated[
        list[str] | None,
        typer.Option(
            "--storage-option",
            help="KEY=VALUE for the filesystem of a URL PATH (repeatable; a dotted KEY nests: "
            "client_kwargs.endpoint_url=http://...; true/false/numbers are parsed). Loads in this "
            "process: a daemon loads URLs with its own credentials. Never shown or recorded.",
            show_default=False,
        ),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype",
            help="PATH is a raw token file of this integer dtype (e.g. uint16 for nanoGPT's train.bin; "
            "uint8..uint64, int8..int64): one 1-D array. A Megatron .bin/.idx pair needs none: it "
            "becomes a ragged entry of its documents.",
            show_default=False,
        ),
    ] = None,
    team: Annotated[
        str | None,
        typer.Option(
            "--team",
            show_default=False,
            help="Put into this team's root (as `shmcache --team NAME put`): files are read by "
            "this process with your rights and written into the files the team's daemon makes; "
            "URLs are loaded by the daemon, from the team's allow_sources only.",
        ),
    ] = None,
) -> None:
    """Load PATH into the cache under KEY and print the keys published.

    PATH may be a URL (s3://bucket/prefix/, gs://, az://, hf://, https://):
    .npy, .safetensors, .pt, .npz, .h5, table and (with --dtype) token objects are
    streamed into the cache.

    Through the daemon when one serves the root (Ctrl+C cancels the load),
    else (or with --local) in this process, with a notice; the root's budget
    applies either way. Nothing partial is ever published.
    """
    if team is not None:
        set_team(team)
    try:
        with failures_exit_1():
            sources = _sources(path, key, dtype)
            options = _storage_options(storage_option or [])
        if not local and (writer := _member_writer(root)) is not None:
            with failures_exit_1():
                files = [(k, s) for k, s in sources if isinstance(s, Path)]
                for published_key in _put_as_member(writer, files, pin, overwrite, as_.value, dtype):
                    typer.echo(published_key)
            sources = [(k, s) for k, s in sources if not isinstance(s, Path)]  # URLs: the daemon's
            if not sources:
                return
        bar, title = _progress_bar(progress), f"put {key}"
        with open_backend(root, local) as control:
            if isinstance(control, Store):
                with failures_exit_1():
                    published = _put_here(
                        control, sources, pin, overwrite, bar, title, local, as_.value, options, dtype
                    )
            else:
                with failures_exit_1():
                    if options:
                        raise InvalidSourceError(
                            "--storage-option applies to loads in this process, and a daemon serves "
                            "this root: it loads URLs with its own credentials (its environment, "
                            "config files or instance role). Drop the options, or add --local"
                        )
                with interrupts_restored():  # Ctrl+C from here on: the daemon says what happened
                    with failures_exit_1():
                        outcome = put_through(control, sources, pin, overwrite, bar, title, as_.value, dtype)
                    report(outcome)
                return
    except KeyboardInterrupt:  # in this process, or before any load was asked of the daemon
        typer.echo("interrupted: nothing partial was published (see `shmcache ls`)", err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    for published_key in published:
        typer.echo(published_key)


def _storage_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``--storage-option`` pairs as fsspec storage options (a dotted key nests)."""
    options: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:
            raise InvalidSourceError(f"--storage-option takes KEY=VALUE, got one without '=' ({name[:40]!r})")
        try:
            value: Any = json.loads(text)
            if not isinstance(value, (bool, int, float)):
                value = text
        except ValueError:
            value = text
        *parents, last = name.split(".")
        target = options
        for parent in parents:
            target = target.setdefault(parent, {})
            if not isinstance(target, dict):
                raise InvalidSourceError(f"--storage-option {name}: {parent} is both a value and a table")
        target[last] = value
    return options


def _sources(path: str, key: str, dtype: str | None = None) -> list[tuple[str, Path | str]]:
    """``(key, source)`` pairs for PATH: itself if it exists (or is a URL), else the matches
    of a glob, each under ``key/<name without its suffix>`` (suffixes ``put_file`` takes, and
    a token file's: a raw one with ``dtype``, a Megatron pair, put once however many of its
    two files match)."""
    validate_key(key)
    if is_url(path):
        return [(key, path)]
    literal = Path(path).expanduser()
    exists = os.path.exists(literal)  # False for a name too long to be a file (a brace pattern)
    if not exists and os.path.isfile(f"{literal}.idx"):
        literal, exists = Path(f"{literal}.idx"), True  # a Megatron dataset named by its prefix
    if exists or not glob.has_magic(path) or is_shard_source(path):  # shards: one entry
        return [(key, literal)]
    matches = sorted(glob.glob(os.path.expanduser(path)))
    if not matches:
        raise SourceNotFoundError(f"no file or directory matches {path!r}")
    pairs: dict[str, Path | str] = {}
    for match in matches:
        source = Path(match)
        megatron = dtype is None and is_token_source(source)
        if megatron:
            source = source.with_suffix(".idx")  # the pair, whichever of its files matched
        token = (dtype is not None and not source.is_dir()) or megatron
        name = source.name
        stem = name.rsplit(".", 1)[0] if source.suffix.lower() in PLANNERS or token else name
        child = validate_key(f"{key}/{stem}")
        if child in pairs and not (megatron and pairs[child] == source):
            raise InvalidKeyError(
                f"{pairs[child]} and {match} would both be put as {child!r}; narrow the pattern"
            )
        pairs[child] = source
    return list(pairs.items())


def _progress_bar(enabled: bool | None) -> Progress:
    """A byte progress bar on stderr (shown on a terminal, or always with --progress)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        ProgressColumn,
        Task,
        TextColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class BinarySpeedColumn(ProgressColumn):
        """Speed in the same binary units as the sizes (rich's own column says GB/s)."""

        def render(self, task: Task) -> Text:
            speed = task.finished_speed or task.speed
            if speed is None and task.finished and task.elapsed:  # too quick for rich's samples
                speed = task.completed / task.elapsed
            shown = "?" if speed is None else f"{human_bytes(int(speed))}/s"
            return Text(shown, style="progress.data.speed")

    console = Console(stderr=True, force_terminal=True if enabled else None)
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        BinarySpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=enabled is False or not console.is_terminal,
        transient=False,
    )


def _member_writer(root: Path | None) -> MemberWriter | None:
    """A team's root (``--team``): its daemon's write channel; None for a personal root."""
    team = command_team(root)
    return None if team is None else MemberWriter(team.root, team=team.name)


def _put_as_member(
    writer: MemberWriter,
    sources: Sequence[tuple[str, Path | str]],
    pin: bool,
    overwrite: bool,
    as_: str,
    dtype: str | None = None,
) -> list[str]:
    """Put files into a team's root: read here, with this user's rights, written into the
    files its daemon makes (the daemon never opens them)."""
    published: list[str] = []
    for key, source in sources:
        published += writer.put_file(key, source, overwrite=overwrite, pin=pin, as_=as_, dtype=dtype)
    return published


def _put_here(
    store: Store,
    sources: list[tuple[str, Path | str]],
    pin: bool,
    overwrite: bool,
    bar: Progress,
    title: str,
    local: bool = False,
    as_: str = "auto",
    options: dict[str, Any] | None = None,
    dtype: str | None = None,
) -> list[str]:
    """Validate every source first (nothing is copied if one is bad), then put them."""
    plans = [
        (key, source, store.plan_file(key, source, as_=as_, storage_options=options, dtype=dtype))
        for key, source in sources
    ]
    if not overwrite:
        for _, _, plan in plans:
            for entry in plan:
                if store.exists(entry.key):
                    raise KeyExistsError(
                        f"entry {entry.key!r} already exists; pass {fix('overwrite', CLI)} to replace "
                        f"it, or evict it first ({fix('evict', CLI, key=entry.key)})"
                    )
    why = "--local" if local else "no daemon"
    typer.echo(f"notice: {why} on {store.root}; loading in this process", err=True)
    published: list[str] = []
    with bar:
        task = bar.add_task(title, total=sum(entry.size for _, _, plan in plans for entry in plan))
        offset = 0
        for key, source, plan in plans:
            def advance(done: int, _total: int, base: int = offset) -> None:
                bar.update(task, completed=base + done)

            published += store.put_file(
                key, source, overwrite=overwrite, pin=pin, progress=advance, as_=as_,
                storage_options=options, dtype=dtype,
            )
            offset += sum(entry.size for entry in plan)
    return published


# ---------------------------------------------------------------------- inspect


def _mapped_by(root: Path | None) -> MappingScan:
    """What live processes map (one /proc scan, in this process): ``pids_of(version)``."""
    try:
        return local_store(root).scan_mappings()
    except OSError:
        return MappingScan()


def _cuda_pins(root: Path) -> dict[str, list[dict[str, Any]]]:
    """Version -> the live processes that pinned it with CUDA (``shmcache.torch.pin``)."""
    from .._disk.pin_records import live_pins

    found: dict[str, list[dict[str, Any]]] = {}
    for pid, pins in sorted(live_pins(root).items()):
        for pin in pins:
            held = {"pid": pid, "registered": pin.registered, "error": pin.error}
            found.setdefault(pin.version, []).append(held)
    return found


def _pinned_cell(budget_pinned: bool, cuda: list[dict[str, Any]]) -> str:
    """``yes`` (the budget never evicts it) and/or ``cuda <pids>`` (pinned by CUDA)."""
    cells = ["yes"] if budget_pinned else []
    if cuda:
        cells.append("cuda " + _show_pids([p["pid"] for p in cuda]))
    return ", ".join(cells)


def _show_pids(pids: Sequence[int]) -> str:
    return f"{len(pids)} pids" if len(pids) > 3 else ",".join(map(str, pids))


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def list_command(
    prefix: Annotated[
        str | None, typer.Argument(help="Only PREFIX and keys under PREFIX/.", metavar="PREFIX")
    ] = None,
    root: RootOption = None,
    as_json: JsonOption = False,
    local: LocalOption = False,
) -> None:
    """List entries: key, kind, dtype, shape, size, owner (who loaded it), pinned, mapped by
    (PIDs), age.

    PINNED says ``yes`` for an entry pinned in the cache (the budget never evicts it) and
    ``cuda PIDS`` for processes that pinned it with CUDA (``shmcache.torch.pin``)."""
    with open_backend(root, local) as control, failures_exit_1():
        entries = control.list(prefix)
    mapped = _mapped_by(root)
    cuda = _cuda_pins(local_store(root).root)
    if as_json:
        typer.echo(json.dumps([{**asdict(e), "mapped_by": sorted(mapped.pids_of(e.version)),
                                "cuda_pinned_by": cuda.get(e.version, [])} for e in entries], indent=1))
        return
    now = time.time()
    rows = [
        (e.key, e.kind, e.dtype or "", "x".join(map(str, e.shape or ())) or "()", human_bytes(e.size),
         owner_name(e.owner_uid), _pinned_cell(e.pinned, cuda.get(e.version, [])),
         _show_pids(sorted(mapped.pids_of(e.version))),
         _age(now - e.created))
        for e in entries
    ]
    print_table(("KEY", "KIND", "DTYPE", "SHAPE", "SIZE", "OWNER", "PINNED", "MAPPED BY", "AGE"), rows)
    _note_hidden_mappers(local_store(root).root, mapped)


def _note_hidden_mappers(root: Path, mapped: MappingScan) -> None:
    """In a root others read (a team's), say that MAPPED BY lists only the processes whose
    maps this user may read (even root's may be refused: a process that changed its uid is
    not dumpable): an empty cell there is not "nobody reads it"."""
    try:
        st = os.stat(root)
    except OSError:
        return
    if st.st_uid == os.geteuid():
        return
    readers = mapped.hidden_members(st.st_uid, st.st_gid)
    if readers:
        typer.echo(
            f"notice: MAPPED BY lists only the processes whose /proc/PID/maps you may read: "
            f"{len(readers)} {'process' if len(readers) == 1 else 'processes'} of other members could "
            "not be read, and may map these entries",
            err=True,
        )


def info(
    key: Annotated[str, typer.Argument(help="The entry's key.", show_default=False, metavar="KEY")],
    root: RootOption = None,
    local: LocalOption = False,
) -> None:
    """Show one entry's metadata as JSON, with mapped_by: PIDs of live processes mapping it."""
    with open_backend(root, local) as control, failures_exit_1():
        found = control.info(key)
    # Scanned here, as ``ls`` does: a team's daemon may not read its members' /proc/PID/maps.
    mapped = _mapped_by(root)
    detail: dict[str, Any] = {**asdict(found), "mapped_by": sorted(mapped.pids_of(found.version))}
    typer.echo(json.dumps(detail, indent=1))
    _note_hidden_mappers(local_store(root).root, mapped)


# ---------------------------------------------------------------------- remove, maintain


def evict(
    keys: Annotated[list[str], typer.Argument(help="Keys to remove (prefixes with --prefix).",
                                             show_default=False, metavar="KEY")],
    root: RootOption = None,
    prefix: Annotated[
        bool, typer.Option("--prefix", help="Evict every entry that is KEY or lies under KEY/.")
    ] = False,
    local: LocalOption = False,
) -> None:
    """Remove entries; processes that mapped them keep reading their version."""
    failed = False
    with open_backend(root, local, writes="evict entries") as control:
        for key in keys:
            try:
                if prefix:
                    targets = [entry.key for entry in control.list(key)]
                    if not targets:
                        raise KeyNotFoundError(f"no entry is {key!r} or lies under {key + '/'!r}")
                else:
                    targets = [key]
                for target in targets:
                    freed = control.evict(target)
                    typer.echo(f"evicted {target} ({human_bytes(freed)})")
            except ShmCacheError as exc:
                warn_or_raise(exc)
                failed = True
    if failed:
        raise typer.Exit(1)


def cleanup(root: RootOption = None, local: LocalOption = False) -> None:
    """Remove partial writes and orphans left by dead writers."""
    with open_backend(root, local, writes="clean up") as control, failures_exit_1():
        freed = control.cleanup()
    typer.echo(f"freed {human_bytes(freed)}")


def stats(
    root: RootOption = None,
    as_json: JsonOption = False,
    local: LocalOption = False,
    by_user: ByUserOption = False,
) -> None:
    """Capacity, use, budget, entry count and partial writes of the cache root (and the daemon's jobs)."""
    with open_backend(root, local) as control, failures_exit_1():
        daemon = not isinstance(control, Store)
        result: StoreStats = control.stats()
        entries = control.list() if by_user else []
    if by_user:
        _print_usage(entries, as_json)
        return
    if as_json:
        warnings = [result.budget_warning] if result.budget_warning is not None else []
        body = {**asdict(result), "over_budget": result.over_budget, "daemon": daemon, "warnings": warnings}
        typer.echo(json.dumps(body, indent=1))
        return
    budget, over = ("none" if result.budget is None else human_bytes(result.budget)), ""
    if result.over_budget and result.budget is not None:
        over = f"; OVER BUDGET by {human_bytes(result.used - result.budget)}"
    typer.echo(f"root:     {result.root}")
    typer.echo(f"daemon:   {'running' if daemon else 'not used (--local)' if local else 'not running'}")
    typer.echo(f"entries:  {result.entries}")
    typer.echo(f"used:     {human_bytes(result.used)}  (budget {budget}{over})")
    if result.packed_held > 0:
        typer.echo(f"packed:   {human_bytes(result.packed_held)} of it held by directory puts' manifests "
                   "beyond their entries (evicted packed entries: freed with the rest of that put)")
    if result.partial_bytes > 0:
        typer.echo(f"partial:  {human_bytes(result.partial_bytes)} in writes in progress or left by dead "
                   "writers (shmcache cleanup frees the dead ones)")
    typer.echo(f"free:     {human_bytes(result.free)} of {human_bytes(result.capacity)}")
    if result.budget_warning is not None:
        typer.echo(f"warning:  {result.budget_warning}", err=True)
    if over:
        typer.echo("warning:  the entries use more than the budget: the next put evicts least-recently-"
                   "used entries that are neither pinned nor mapped (`shmcache budget` shows it)", err=True)
    if (held := getattr(result, "held_by_readers_bytes", None)) is not None:
        hidden = getattr(result, "held_by_readers_unseen", 0)
        note = f"; not counted: what {hidden} members' processes map (the daemon may not scan them)"
        note = note if hidden else ""
        typer.echo(f"held:     {human_bytes(held)} of evicted/replaced entries still mapped by readers{note}")
        typer.echo(f"jobs:     {getattr(result, 'jobs_running', 0)} running, "
                   f"{getattr(result, 'jobs_queued', 0)} queued")


def _print_usage(entries: Sequence[EntryInfo], as_json: bool) -> None:
    """``stats --by-user``: one row per owner, most bytes first."""
    usage = sorted(usage_by_owner(entries).values(), key=lambda u: (-u.bytes, owner_name(u.uid)))
    if as_json:
        typer.echo(json.dumps([
            {"user": owner_name(u.uid), "uid": u.uid, "entries": u.entries, "bytes": u.bytes} for u in usage
        ], indent=1))
        return
    rows = [(owner_name(u.uid), "" if u.uid is None else str(u.uid), str(u.entries), human_bytes(u.bytes))
            for u in usage]
    print_table(("USER", "UID", "ENTRIES", "SIZE"), rows)


def verify(
    key: Annotated[str | None, typer.Argument(help="One entry (default: all).", metavar="KEY")] = None,
    root: RootOption = None,
) -> None:
    """Check entries against the checksums recorded when they were put.

    One line per entry: ok, no checksum, or CORRUPT (then exit status 1:
    evict the entry and put it again). Reads every byte, in this process.
    """
    store = local_store(root)
    with failures_exit_1():
        store.list()  # checks the root
        keys = [key] if key is not None else linked_keys(store.layout)  # damaged ones too
    corrupt = 0
    for name in keys:
        try:
            status = "ok" if store.verify(name) else "no checksum"
        except CorruptEntryError as exc:
            corrupt += 1
            typer.echo(f"CORRUPT      {name}: {exc}")
            continue
        except KeyNotFoundError as exc:
            if key is not None:
                raise fail(exc) from None
            continue  # evicted while we went through the list
        except (ShmCacheError, OSError) as exc:
            raise fail(exc) from None
        typer.echo(f"{status:<12} {name}")
    if corrupt:
        typer.echo(f"error: {corrupt} corrupt entr{'y' if corrupt == 1 else 'ies'}", err=True)
        raise typer.Exit(1)
