"""The control client: the daemon's HTTP API as Python methods returning typed records.

Opening data never goes through here: use ``shmcache.open_array`` & co., which read the
file system directly. This client loads, evicts, lists and inspects through the daemon,
and satisfies :class:`shmcache._control.CacheControl` like a local ``Store`` does.
"""

from __future__ import annotations

import builtins
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpcore
import httpx

from shmcache import EntryInfo, default_root, validate_key
from shmcache._disk.layout import ENV_ROOT, ENV_SOCKET, ENV_TOKEN, Layout
from shmcache._sources.urls import is_url
from shmcache._store.ownership import owner_name
from shmcache._team.config import checked_team, team_of
from shmcache.errors import DaemonUnavailableError, ShmCacheError

from ._errors import JobCancelledError, error_from_body
from ._liveness import LiveDaemon, live_daemon
from ._records import BudgetState, EntryDetail, Health, Job, ServiceStats, entry_from_json
from ._transport import CheckedUnixBackend, expected_uids

if TYPE_CHECKING:
    from shmcache._control import CacheControl

__all__ = ["DEFAULT_TIMEOUT", "ENV_SOCKET", "ENV_TOKEN", "Client"]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 30.0
_POLL_MIN_S = 0.01
_POLL_MAX_S = 0.25
_SETTLE_S = 10.0
"""How long an interrupted ``put_file`` waits for the daemon to settle the cancelled load."""
_DYING_S = 1.0
"""How long a daemon whose socket refused a poll may still hold its pid lock as it exits."""


class Client:
    """A connection to the ``shmcache serve`` daemon of a root.

    By default it talks over the daemon's Unix socket: ``socket``, else
    ``$SHMCACHE_SOCKET``, else ``<root>/daemon.sock`` (``root`` defaults to
    ``$SHMCACHE_ROOT`` or ``/dev/shm/shmcache-<uid>``). With ``url``
    (``http://host:port``) it talks TCP and sends ``token`` (default
    ``$SHMCACHE_TOKEN``) as ``Authorization: Bearer``.

    On the Unix socket, the process that answers must run as the root's owner (or as one
    of ``daemon_uids``), checked before anything is sent
    (:class:`~shmcache.errors.UntrustedDaemonError` otherwise). A stopped daemon (SIGSTOP,
    Ctrl+Z) is reported within a few seconds, whatever ``timeout``; a slow one gets all of it.

    ``team`` (or ``$SHMCACHE_TEAM`` without a ``root``): the daemon of that team's root,
    which must run as the service account the administrator's teams file names.

    One keep-alive connection is reused across calls (and re-created in a forked
    child). Use it as a context manager, or call :meth:`close`. Errors come back as the
    exceptions the core raises (``KeyNotFoundError``, ``CacheFullError``...); a daemon
    that does not answer is :class:`~shmcache.DaemonUnavailableError`.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        url: str | None = None,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        socket: str | os.PathLike[str] | None = None,
        daemon_uids: Iterable[int] = (),
        team: str | None = None,
    ) -> None:
        self.team = team_of(root, team) if url is None else team
        self._group: str | None = None  # the team's, for the message of a refused connection
        if self.team is not None:  # the root and the daemon's account come from the teams file alone
            config = checked_team(self.team)
            root, daemon_uids = config.root, {*daemon_uids, config.uid}
            self._group = config.group
        self._root = Path(os.path.abspath(root if root is not None else default_root()))
        self.url = url.rstrip("/") if url else None
        self.timeout = timeout
        if self.url is None:
            configured = socket if socket is not None else os.environ.get(ENV_SOCKET) or None
            self.socket_path: Path | None = (
                Path(os.path.abspath(configured)) if configured else Layout(self._root).socket
            )
            self._token = None
        else:
            self.socket_path = None
            self._token = token if token is not None else os.environ.get(ENV_TOKEN) or None
        self.daemon_uids = frozenset(daemon_uids)
        self._http: httpx.Client | None = None
        self._pid = -1

    @property
    def root(self) -> Path:
        """The cache root this client's daemon serves (as given; the daemon says in :meth:`health`)."""
        return self._root

    def __repr__(self) -> str:
        where = self.url if self.url is not None else f"unix:{self.socket_path}"
        return f"Client({where!r})"

    # ------------------------------------------------------------------ connection

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection (a later call opens a new one)."""
        http, self._http = self._http, None
        if http is not None and self._pid == os.getpid():
            http.close()

    def _connection(self) -> httpx.Client:
        if self._http is None or self._pid != os.getpid():  # never share a socket with a forked parent
            headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
            if self.socket_path is not None:
                self._http = httpx.Client(
                    transport=self._unix_transport(), base_url="http://shmcache", timeout=self.timeout,
                    headers=headers,
                )
            else:
                assert self.url is not None
                self._http = httpx.Client(base_url=self.url, timeout=self.timeout, headers=headers)
            self._pid = os.getpid()
        return self._http

    def _unix_transport(self) -> httpx.HTTPTransport:
        """httpx's transport over a connection pool whose connections check who answers
        and notice a stopped daemon (:mod:`._transport`)."""
        assert self.socket_path is not None
        if self.team is not None:  # the teams file's account alone: never whoever owns the path now
            uids: Callable[[], frozenset[int]] = lambda: self.daemon_uids  # noqa: E731
        else:
            uids = lambda: expected_uids(self.root, self.daemon_uids)  # noqa: E731
        backend = CheckedUnixBackend(self.socket_path, self.root, uids)
        transport = httpx.HTTPTransport()
        # httpx has no public way to give its pool a network backend: the pool is replaced
        # (with httpx's own default limits).
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=5.0)
        transport._pool = httpcore.ConnectionPool(
            network_backend=backend,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
        )
        return transport

    def _unavailable(self, exc: Exception) -> DaemonUnavailableError:
        if self.socket_path is None:
            return DaemonUnavailableError(
                f"cannot reach the shmcache daemon at {self.url} ({exc or type(exc).__name__}): is "
                "`shmcache serve --host H --port P` running there, and the address right?"
            )
        if _denied(self.socket_path, exc) and self.team is not None:
            return DaemonUnavailableError(
                f"cannot open team {self.team}'s daemon socket {self.socket_path}: permission denied; "
                f"only the members of the team's group may use it: ask an administrator to add you "
                f"(usermod -aG {self._group or 'GROUP'} {owner_name(os.getuid())}), then log in again"
            )
        if _denied(self.socket_path, exc):  # another user's root: its daemon serves only that user
            return DaemonUnavailableError(
                f"cannot open the daemon's socket {self.socket_path}: permission denied (it, or the "
                "directory it is in, belongs to another user, and a daemon serves only its own user): "
                f"use a root of your own (--root, {ENV_ROOT}) or run as the daemon's user"
            )
        timed_out = isinstance(exc, httpx.TimeoutException)
        if timed_out:  # the stream says how long it waited: less than the timeout for a stopped daemon
            reason = str(exc) if str(exc).startswith("no answer") else f"no answer within {self.timeout:g} s"
        elif not os.path.lexists(self.socket_path):
            reason = "no socket there"
        else:
            reason = str(exc) or type(exc).__name__
        live = live_daemon(self.root)
        if live is not None:  # alive but not answering: say so, never suggest starting another
            message = _not_answering(live, self.root, self.socket_path, reason, timed_out)
            return DaemonUnavailableError(message)
        start = f"shmcache serve --root {self.root}"
        if self.socket_path != Layout(self.root).socket:
            start += f" --socket {self.socket_path}"
        return DaemonUnavailableError(
            f"no shmcache daemon answers on {self.socket_path} ({reason}): start one with `{start}` "
            "(or work without it: shmcache.Store, or the CLI without a daemon)"
        )

    def _request(
        self,
        method: str,
        path: str,
        *,
        json: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
    ) -> Any:
        try:
            response = self._connection().request(method, path, json=json, params=params)
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from exc
        if response.status_code >= 400:
            raise _error_of(response)
        try:
            return response.json()
        except ValueError as exc:
            raise ShmCacheError(
                f"the daemon answered {method} {path} with something that is not JSON "
                f"(HTTP {response.status_code}): {response.text[:200]!r}"
            ) from exc

    # ------------------------------------------------------------------ the API

    def health(self) -> Health:
        """Whether the daemon answers, and its version, pid and root."""
        return Health.from_json(self._request("GET", "/v1/health"))

    def stats(self) -> ServiceStats:
        """Capacity, use, budget and entry count, plus bytes held by readers and job counts."""
        return ServiceStats.from_json(self._request("GET", "/v1/stats"))

    def budget(self) -> BudgetState:
        """The root's budget and what its entries use (:meth:`Store.budget <shmcache.Store.budget>`)."""
        return BudgetState.from_json(self._request("GET", "/v1/budget"))

    def set_budget(self, max_bytes: int | None) -> BudgetState:
        """Record the root's budget (None removes it); every writer of the root keeps it. A
        budget below what the root holds evicts nothing now: the next put evicts to fit."""
        return BudgetState.from_json(self._request("PUT", "/v1/budget", json={"max_bytes": max_bytes}))

    def list(self, prefix: str | None = None) -> builtins.list[EntryInfo]:
        """Entries that are ``prefix`` or lie under ``prefix/`` (all without it), sorted by key."""
        params = {"prefix": prefix} if prefix else None
        return [entry_from_json(item) for item in self._request("GET", "/v1/entries", params=params)]

    def info(self, key: str) -> EntryDetail:
        """One entry's metadata and the PIDs of live processes that map it."""
        return EntryDetail.from_json(self._request("GET", _entry_path(key)))

    def load(
        self,
        key: str,
        source: str | os.PathLike[str],
        pin: bool = False,
        overwrite: bool = False,
        wait: bool = False,
        progress: Callable[[Job], None] | None = None,
        timeout: float | None = None,
        as_: str = "auto",
        dtype: str | None = None,
    ) -> Job:
        """Ask the daemon to load ``source`` (a ``.npy``; an ``.npz``, ``.safetensors``,
        ``.pt``/``.pth`` or ``.h5``/``.hdf5`` as ``key/<member, tensor or dataset>``; a
        directory as ``key/<relative path>``) under ``key`` in the background.

        ``source`` is a path on the daemon's machine (over the Unix socket a relative
        path is made absolute here), or a URL under one of the daemon's ``--allow-source``
        URL prefixes, which the daemon loads with its own credentials. Returns the job at
        once, or with ``wait=True`` once it finished, calling ``progress(job)`` at every
        poll and raising the job's error (``CacheFullError``..., :class:`JobCancelledError`
        when cancelled) if it did not succeed. Interrupting the wait does not cancel the
        job: call :meth:`cancel`.
        ``as_`` is what a directory becomes (``auto``, ``arrays`` or ``blobs``: see
        :meth:`Store.put_file <shmcache.Store.put_file>`); ``dtype`` that of a raw token file.
        """
        path = os.fspath(source)
        if self.socket_path is not None and not is_url(path):
            path = os.path.abspath(path)
        body: dict[str, Any] = {"source": path, "pin": pin, "overwrite": overwrite}
        if as_ != "auto":  # only when asked: a daemon that predates blobs refuses the field
            body["as"] = as_
        if dtype is not None:  # likewise: a daemon that predates token files refuses it
            body["dtype"] = str(dtype)
        job = Job.from_json(self._request("PUT", _entry_path(key), json=body))
        if wait:
            job = self.wait(job.id, progress=progress, timeout=timeout, first=job)
        return job

    def wait(
        self,
        job_id: str,
        progress: Callable[[Job], None] | None = None,
        timeout: float | None = None,
        *,
        first: Job | None = None,
    ) -> Job:
        """Poll a job until it is done and return it; raise its error if it failed or was
        cancelled, ``TimeoutError`` after ``timeout`` seconds (the job goes on)."""
        return _outcome(self._follow(job_id, progress, timeout, first))

    def _follow(
        self,
        job_id: str,
        progress: Callable[[Job], None] | None,
        timeout: float | None,
        first: Job | None,
    ) -> Job:
        """Poll a job, calling ``progress`` at every poll, until it is no longer active."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = _POLL_MIN_S
        job = first if first is not None else self.job(job_id)
        while True:
            if progress is not None:
                progress(job)
            if not job.active:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} is still {job.state} after {timeout:g} s")
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
            job = self.refresh(job)

    def job(self, job_id: str) -> Job:
        """A load job's state and progress."""
        return Job.from_json(self._request("GET", f"/v1/jobs/{quote(job_id, safe='')}"))

    def refresh(self, job: Job) -> Job:
        """``job``'s state now. A daemon gone since (killed, or stopped: its loads end with
        it) raises :class:`~shmcache.DaemonUnavailableError` saying so, not only that no
        daemon answers, which reads as if the load had never begun. One that lives but does
        not answer (paused, swamped; or one over TCP, which cannot be checked) raises the
        error as it is: its load may go on."""
        try:
            return self.job(job.id)
        except DaemonUnavailableError as exc:
            if self.socket_path is None or not self._died(_DYING_S):
                raise
            raise DaemonUnavailableError(
                f"the daemon stopped during the load of {job.key!r} (job {job.id}), which ended "
                f"with it: nothing more of it will be published (`shmcache ls {job.key}` shows "
                f"whether it was published before; put it again once a daemon runs). {exc}"
            ) from None

    def _died(self, within: float) -> bool:
        """Whether the root's daemon is gone, or goes within ``within`` seconds: one killed
        closes its socket and its locked pid file one after the other as it exits, and
        a refused request may come in between."""
        deadline = time.monotonic() + within
        while live_daemon(self.root) is not None:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def jobs(self) -> builtins.list[Job]:
        """Queued and running jobs, and the last finished ones."""
        return [Job.from_json(item) for item in self._request("GET", "/v1/jobs")]

    def cancel(self, job_id: str) -> Job:
        """Cancel a queued or running load (nothing partial is published); returns the job,
        which may still be ``running`` for a moment while the copy stops."""
        return Job.from_json(self._request("DELETE", f"/v1/jobs/{quote(job_id, safe='')}"))

    def evict(self, key: str) -> int:
        """Remove an entry; returns the bytes freed. Processes that map it keep their version."""
        result: dict[str, Any] = self._request("DELETE", _entry_path(key))
        return int(result["freed_bytes"])

    def cleanup(self) -> int:
        """Remove partial writes and orphans of dead writers; returns the bytes freed."""
        result: dict[str, Any] = self._request("POST", "/v1/cleanup")
        return int(result["freed_bytes"])

    # ------------------------------------------------------------------ the control protocol

    def mapped_by(self, key: str) -> builtins.list[int]:
        """PIDs of live processes that map the current version of ``key``."""
        return list(self.info(key).mapped_by)

    def put_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        pin: bool = False,
        progress: Callable[[int, int], None] | None = None,
        as_: str = "auto",
        dtype: str | None = None,
    ) -> builtins.list[str]:
        """Load ``path`` through the daemon and wait: :meth:`Store.put_file <shmcache.Store.put_file>`
        with the daemon's budget. Returns the keys published.

        ``progress(done, total)`` is called as the copy advances. A failed load raises its
        error (``CacheFullError``...); if ``progress`` raises or the wait is interrupted
        (``KeyboardInterrupt``), the load is cancelled and the exception goes on, with a
        note (and a log warning) saying how the load ended: cancelled with nothing
        published, or published anyway when the cancel came too late.
        """

        def report(job: Job) -> None:
            if progress is not None and job.bytes_total is not None:
                progress(job.bytes_done, job.bytes_total)

        job = self.load(key, path, pin=pin, overwrite=overwrite, as_=as_, dtype=dtype)
        try:
            done = self._follow(job.id, report, None, job)
        except BaseException as exc:
            _note(exc, self._cancel_and_settle(job))
            raise
        return list(_outcome(done).keys)

    def _cancel_and_settle(self, job: Job) -> str:
        """Cancel a load and wait (a few seconds) for its final state; say what it was."""
        self.close()  # an interrupted request may have left the connection half-read
        try:
            self.cancel(job.id)
        except ShmCacheError as exc:  # finished meanwhile, or the daemon is gone
            logger.debug("cancelling job %s: %s", job.id, exc)
        try:
            job = self._follow(job.id, None, _SETTLE_S, None)
        except (ShmCacheError, TimeoutError) as exc:
            return f"the load of {job.key!r} (job {job.id}) was cancelled; its outcome is unknown ({exc})"
        if job.state == "done":
            return f"the load of {job.key!r} had finished: published {', '.join(job.keys)}"
        return f"the load of {job.key!r} ended {job.state}: nothing published"


if TYPE_CHECKING:

    def _is_a_cache_control(client: Client) -> CacheControl:
        return client  # mypy checks that Client satisfies the protocol


def _note(exc: BaseException, what: str) -> None:
    """Tell how an interrupted load ended: on the exception (Python 3.11+) and in the log."""
    logger.warning("%s", what)
    if hasattr(exc, "add_note"):
        exc.add_note(what)


def _outcome(job: Job) -> Job:
    """A finished job, or the exception it finished with."""
    if job.state == "cancelled":
        detail = job.error.detail if job.error else "cancelled"
        raise JobCancelledError(f"load of {job.key!r} was cancelled ({detail}); nothing was published")
    if job.error is not None:
        raise error_from_body(job.error.type, job.error.detail)
    return job


def _not_answering(live: LiveDaemon, root: Path, socket_path: Path, reason: str, timed_out: bool) -> str:
    """Why a daemon that lives (its pid file is locked) does not answer, and what to do."""
    pid = str(live.pid) if live.pid is not None else f"$(cat {live.pid_file})"
    if not timed_out:
        return (
            f"the shmcache daemon {live} of {root} is running but does not accept connections on "
            f"{socket_path} ({reason}): it is starting or stopping, or listens on another socket "
            f"(started with --socket: pass that path as socket= or in ${ENV_SOCKET})"
        )
    if live.stopped:
        state = f"it is stopped (SIGSTOP or Ctrl+Z): `kill -CONT {pid}` resumes it"
    else:
        state = (
            f"it is hung or overloaded: see its log, or restart it (`kill -TERM {pid}`, then "
            f"`shmcache serve --root {root}`)"
        )
    return (
        f"the shmcache daemon {live} of {root} does not answer on {socket_path} ({reason}); {state}. "
        "Working on the root without it (shmcache.Store; the CLI's --local) goes around its loads "
        "and jobs (the root's budget still holds)"
    )


def _denied(path: Path, exc: Exception) -> bool:
    """Whether connecting to ``path`` failed for want of permission (``Path.exists`` would
    raise ``PermissionError`` itself when the socket's directory is another user's)."""
    cause: BaseException | None = exc
    for _ in range(8):  # httpx -> httpcore -> the OSError of connect()
        if cause is None:
            break
        if isinstance(cause, PermissionError):
            return True
        cause = cause.__cause__ or cause.__context__
    try:
        os.stat(path)
    except PermissionError:
        return True
    except OSError:
        pass
    return False


def _entry_path(key: str) -> str:
    # Validated here: a key like "a/../b" must not be normalised into another URL.
    return "/v1/entries/" + quote(validate_key(key), safe="/")


def _error_of(response: httpx.Response) -> ShmCacheError:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return error_from_body(body["error"], str(body.get("detail", "")), response.status_code)
    name = "UnauthorizedError" if response.status_code == 401 else None
    return error_from_body(name, f"{response.reason_phrase}: {response.text[:200]}", response.status_code)
