"""``shmcache.client.Client`` against a real daemon: records, errors, jobs, transports."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

import httpx
import numpy as np
import pytest
from cli_helpers import save, stale_socket
from service_helpers import Daemon, fresh_root, running_daemon, temporary_root, unique, write_big_npy
from shmcache.client import ACTIVE_STATES as CLIENT_ACTIVE_STATES
from shmcache.client import (
    ERROR_TYPES,
    Client,
    EntryDetail,
    Health,
    Job,
    JobCancelledError,
    JobError,
    JobFinishedError,
    JobNotFoundError,
    ServiceStats,
    SourceNotAllowedError,
    error_from_body,
)
from shmcache.client._client import _error_of

import shmcache
from shmcache import _control, errors
from shmcache._control import ACTIVE_STATES, CacheControl
from shmcache._disk.layout import ENV_ROOT, ENV_SOCKET, ENV_TOKEN, Layout

pytest.importorskip("fastapi")

# The module's `daemon` (conftest) loads from `data_dir` at 64 MiB/s: a 1 GiB sparse source
# takes ~16 s, so it can be caught running.
TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def tcp_daemon(data_dir: Path) -> Iterator[Daemon]:
    """TCP on loopback with a token and a 1 MiB budget."""
    with temporary_root() as root, running_daemon(
        root,
        "--allow-source", str(data_dir),
        "--host", "127.0.0.1", "--port", "0",
        "--max-bytes", "1MiB",
        env={ENV_TOKEN: TOKEN},
    ) as running:
        yield running


@pytest.fixture
def client(daemon: Daemon) -> Iterator[Client]:
    with Client(daemon.root) as connected:
        yield connected


def test_health_and_stats_are_typed_records(client: Client, daemon: Daemon) -> None:
    health = client.health()
    assert isinstance(health, Health)
    assert health.status == "ok" and health.pid == daemon.pid and health.root == str(daemon.root)
    assert health.version == shmcache.__version__
    stats = client.stats()
    assert isinstance(stats, ServiceStats) and isinstance(stats, shmcache.StoreStats)
    assert stats.root == str(daemon.root) and stats.capacity > 0 and stats.budget is None
    assert stats.jobs_queued >= 0 and stats.held_by_readers_bytes >= 0


def test_load_wait_list_info_evict(client: Client, daemon: Daemon, data_dir: Path) -> None:
    key = unique("labels")
    array = np.arange(600, dtype=np.int32).reshape(20, 30)
    seen: list[Job] = []
    job = client.load(key, save(data_dir / f"{key}.npy", array), pin=True, wait=True, progress=seen.append)
    assert isinstance(job, Job) and job.state == "done" and not job.active
    assert job.keys == (key,) and job.bytes_done == job.bytes_total
    assert seen and seen[-1] == job and all(isinstance(s, Job) for s in seen)
    np.testing.assert_array_equal(shmcache.open_array(key, root=daemon.root), array)

    listed = client.list(key)
    assert [type(e) for e in listed] == [shmcache.EntryInfo] and listed[0].shape == (20, 30)
    assert listed[0].pinned and listed[0].dtype == "int32"

    detail = client.info(key)
    assert isinstance(detail, EntryDetail) and isinstance(detail, shmcache.EntryInfo)
    assert os.getpid() in detail.mapped_by  # open_array above mapped it in this process
    assert detail.checksum and detail.source == str(data_dir / f"{key}.npy")

    assert client.evict(key) > array.nbytes
    with pytest.raises(shmcache.KeyNotFoundError):
        client.info(key)
    assert client.cleanup() >= 0


def test_listing_matches_the_local_store(client: Client, daemon: Daemon, data_dir: Path) -> None:
    """The same records, whichever way they are read (last_used may lag in listings)."""
    prefix = unique("same")
    for name in ("a", "b"):
        save(data_dir / f"{prefix}-{name}.npy", np.ones(5) * ord(name))
        client.load(f"{prefix}/{name}", data_dir / f"{prefix}-{name}.npy", wait=True)
    local = [replace(e, last_used=0.0) for e in shmcache.Store(daemon.root).list(prefix)]
    remote = [replace(e, last_used=0.0) for e in client.list(prefix)]
    assert remote == local and [e.key for e in remote] == [f"{prefix}/a", f"{prefix}/b"]
    store_info = shmcache.Store(daemon.root).info(f"{prefix}/a")
    assert asdict(replace(store_info, last_used=0.0)).items() <= asdict(
        replace(client.info(f"{prefix}/a"), last_used=0.0)
    ).items()


def test_load_of_a_directory_and_an_npz(client: Client, data_dir: Path) -> None:
    key = unique("dir")
    folder = data_dir / key
    (folder / "sub").mkdir(parents=True)
    save(folder / "x.npy", np.zeros(3))
    save(folder / "sub" / "y.npy", np.ones(4))
    job = client.load(key, folder, wait=True)
    assert sorted(job.keys) == [f"{key}/sub/y", f"{key}/x"]
    np.savez(data_dir / f"{key}.npz", p=np.arange(2), q=np.arange(3))
    assert sorted(client.load(f"{key}z", data_dir / f"{key}.npz", wait=True).keys) == [
        f"{key}z/p", f"{key}z/q"
    ]


def test_load_blobs_with_as(client: Client, data_dir: Path) -> None:
    key = unique("imgs")
    folder = data_dir / key
    (folder / "sub").mkdir(parents=True)
    (folder / "a.jpg").write_bytes(b"\xff\xd8 jpeg")
    (folder / "sub" / "b.png").write_bytes(b"\x89PNG")
    assert client.load(key, folder, wait=True).keys == (key,)  # auto: no array files, blobs
    blobs = shmcache.open_blobs(key, root=client.root)
    assert [bytes(b) for b in blobs] == [b"\xff\xd8 jpeg", b"\x89PNG"]
    info = client.info(key)
    assert (info.kind, info.dtype, info.shape) == ("blobs", "bytes", (2,))
    save(folder / "x.npy", np.arange(3))
    with pytest.raises(shmcache.InvalidSourceError, match="--as arrays"):
        client.load(f"{key}m", folder)
    assert client.load(f"{key}b", folder, as_="blobs", wait=True).keys == (f"{key}b",)
    assert "x.npy" in shmcache.open_blobs(f"{key}b", root=client.root)
    assert client.put_file(f"{key}a", folder, as_="arrays") == [f"{key}a/x"]
    with pytest.raises(shmcache.InvalidRequestError):
        client.load(f"{key}z", folder, as_="images")


@pytest.mark.parametrize(
    ("call", "expected", "builtin"),
    [
        (lambda c, d: c.info("no/such/key"), shmcache.KeyNotFoundError, KeyError),
        (lambda c, d: c.evict("no/such/key"), shmcache.KeyNotFoundError, KeyError),
        (lambda c, d: c.info("a/../b"), shmcache.InvalidKeyError, ValueError),
        (lambda c, d: c.info("bad key"), shmcache.InvalidKeyError, ValueError),
        (lambda c, d: c.list("bad key"), shmcache.InvalidKeyError, ValueError),
        (lambda c, d: c.load("k", d / "missing.npy"), shmcache.SourceNotFoundError, FileNotFoundError),
        (lambda c, d: c.load("k", "/etc/hostname"), SourceNotAllowedError, PermissionError),
        (lambda c, d: c.load("k", d / "garbage.npy"), shmcache.CorruptSourceError, ValueError),
        (lambda c, d: c.load("k", d / "objects.npy"), shmcache.UnsupportedDataError, TypeError),
        (lambda c, d: c.job("0" * 32), JobNotFoundError, LookupError),
        (lambda c, d: c.cancel("0" * 32), JobNotFoundError, LookupError),
    ],
    ids=["info-missing", "evict-missing", "dotdot-key", "space-key", "bad-prefix", "missing-source",
         "outside-allowed", "corrupt-source", "object-array", "unknown-job", "cancel-unknown"],
)
def test_errors_come_back_as_the_core_exceptions(
    client: Client, data_dir: Path, call: object, expected: type[Exception], builtin: type[Exception]
) -> None:
    (data_dir / "garbage.npy").write_bytes(b"this is not an npy file")
    np.save(data_dir / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(expected) as caught:
        call(client, data_dir)  # type: ignore[operator]
    assert isinstance(caught.value, builtin) and isinstance(caught.value, shmcache.ShmCacheError)
    assert str(caught.value)  # a message that says what to do
    rebuilt = pickle.loads(pickle.dumps(caught.value))
    assert type(rebuilt) is type(caught.value) and str(rebuilt) == str(caught.value)


def test_existing_key_and_overwrite(client: Client, data_dir: Path) -> None:
    key = unique("exists")
    source = save(data_dir / f"{key}.npy", np.arange(4))
    client.load(key, source, wait=True)
    with pytest.raises(shmcache.KeyExistsError):
        client.load(key, source)
    save(source, np.arange(5))
    assert client.load(key, source, overwrite=True, wait=True).state == "done"
    assert client.info(key).shape == (5,)


def test_cancel_a_running_load(client: Client, daemon: Daemon, data_dir: Path) -> None:
    key = unique("big")
    job = client.load(key, write_big_npy(data_dir / f"{key}.npy", 1 << 30))
    assert job.active and job.id in {j.id for j in client.jobs()}
    with pytest.raises(TimeoutError):
        client.wait(job.id, timeout=0.01)
    stopped = client.cancel(job.id)
    assert stopped.id == job.id and stopped.cancel_requested
    with pytest.raises(JobCancelledError):
        client.wait(job.id)
    assert client.job(job.id).state == "cancelled"
    assert not shmcache.Store(daemon.root).exists(key)
    with pytest.raises(JobFinishedError):
        client.cancel(job.id)


def test_the_client_is_a_cache_control(client: Client, daemon: Daemon, data_dir: Path) -> None:
    """The control protocol, as a local Store offers it: put_file waits and returns the keys."""
    assert isinstance(client, CacheControl) and client.root == daemon.root
    key = unique("proto")
    array = np.arange(1 << 16, dtype=np.int64)
    seen: list[tuple[int, int]] = []
    source = save(data_dir / f"{key}.npy", array)
    keys = client.put_file(key, source, pin=True, progress=lambda done, total: seen.append((done, total)))
    assert keys == [key] and seen and seen[-1] == (source.stat().st_size,) * 2  # bytes copied, header too
    assert all(done <= total for done, total in seen)
    opened = shmcache.open_array(key, root=daemon.root)
    np.testing.assert_array_equal(opened, array)
    assert os.getpid() in client.mapped_by(key)
    assert client.info(key).pinned
    with pytest.raises(shmcache.KeyExistsError):
        client.put_file(key, data_dir / f"{key}.npy")
    save(data_dir / f"{key}.npy", array[:10])
    assert client.put_file(key, data_dir / f"{key}.npy", overwrite=True) == [key]
    assert client.info(key).shape == (10,)
    folder = data_dir / f"{key}-dir"
    folder.mkdir()
    save(folder / "x.npy", np.zeros(3))
    save(folder / "y.npy", np.ones(3))
    assert sorted(client.put_file(f"{key}/d", folder)) == [f"{key}/d/x", f"{key}/d/y"]


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, RuntimeError])
def test_put_file_cancels_the_load_when_interrupted(
    client: Client, daemon: Daemon, data_dir: Path, interruption: type[BaseException]
) -> None:
    key = unique("interrupted")
    source = write_big_npy(data_dir / f"{key}.npy", 1 << 30)

    def progress(done: int, total: int) -> None:
        raise interruption("stop")

    with pytest.raises(interruption):
        client.put_file(key, source, progress=progress)
    [job] = [j for j in client.jobs() if j.key == key]
    assert job.cancel_requested
    with pytest.raises(JobCancelledError):
        client.wait(job.id)
    assert not shmcache.Store(daemon.root).exists(key)


def test_put_file_raises_the_error_the_job_ended_with(client: Client, daemon: Daemon, data_dir: Path) -> None:
    key = unique("cancelled")
    source = write_big_npy(data_dir / f"{key}.npy", 1 << 30)
    with Client(daemon.root) as other:

        def cancel_when_running(done: int, total: int) -> None:
            active = [j for j in other.jobs() if j.key == key and j.state in ACTIVE_STATES]
            if active and not active[0].cancel_requested:  # once: the next polls see it stopping
                other.cancel(active[0].id)

        with pytest.raises(JobCancelledError, match="nothing was published"):
            client.put_file(key, source, progress=cancel_when_running)
    assert not shmcache.Store(daemon.root).exists(key)


def test_budget_exceeded_is_cache_full_over_tcp_with_a_token(tcp_daemon: Daemon, data_dir: Path) -> None:
    assert tcp_daemon.tcp_url is not None
    key = unique("huge")
    source = write_big_npy(data_dir / f"{key}.npy", 2 << 20)
    with Client(url=tcp_daemon.tcp_url, token=TOKEN) as client:
        assert client.health().root == str(tcp_daemon.root)
        with pytest.raises(shmcache.CacheFullError) as caught:
            client.load(key, source, wait=True)
        assert isinstance(caught.value, OSError)
        small = save(data_dir / f"{key}-small.npy", np.arange(10))
        assert client.load(key, small, wait=True).keys == (key,)


def test_tcp_token_is_required_and_read_from_the_environment(
    tcp_daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert tcp_daemon.tcp_url is not None
    monkeypatch.delenv(ENV_TOKEN, raising=False)
    with Client(url=tcp_daemon.tcp_url) as client, pytest.raises(shmcache.UnauthorizedError) as caught:
        client.stats()
    assert isinstance(caught.value, PermissionError) and "token" in str(caught.value)
    with Client(url=tcp_daemon.tcp_url, token="wrong") as client, pytest.raises(shmcache.UnauthorizedError):
        client.health()
    monkeypatch.setenv(ENV_TOKEN, TOKEN)
    with Client(url=tcp_daemon.tcp_url) as client:
        assert client.stats().budget == 1 << 20


def test_no_daemon_is_daemon_unavailable_saying_how_to_start_one() -> None:
    root = fresh_root()
    with pytest.raises(shmcache.DaemonUnavailableError) as caught:
        Client(root).health()
    assert isinstance(caught.value, ConnectionError)
    assert f"shmcache serve --root {root}" in str(caught.value)
    assert not root.exists()  # asking does not create the root


def test_stale_socket_is_daemon_unavailable(tmp_path: Path) -> None:
    with temporary_root() as root:
        stale_socket(Layout(root).socket)
        with Client(root) as client, pytest.raises(shmcache.DaemonUnavailableError) as caught:
            client.list()
        assert "shmcache serve --root" in str(caught.value)


def test_unreachable_tcp_daemon() -> None:
    with Client(url="http://127.0.0.1:9", timeout=2) as client, pytest.raises(
        shmcache.DaemonUnavailableError
    ) as caught:
        client.health()
    assert "127.0.0.1:9" in str(caught.value)


def test_socket_comes_from_shmcache_socket(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_SOCKET, str(daemon.socket_path))
    elsewhere = fresh_root()
    with Client(elsewhere) as client:
        assert client.socket_path == daemon.socket_path
        assert client.health().root == str(daemon.root)
    monkeypatch.delenv(ENV_SOCKET)
    monkeypatch.setenv(ENV_ROOT, str(daemon.root))
    with Client() as client:
        assert client.socket_path == daemon.socket_path and client.root == daemon.root


def test_connection_is_reused_and_reopened_after_close(client: Client) -> None:
    client.health()
    first = client._http
    client.stats()
    assert client._http is first
    client.close()
    assert client.health().status == "ok"


def test_a_forked_child_opens_its_own_connection(client: Client) -> None:
    client.health()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: must not reuse the parent's socket
        try:
            ok = client.health().status == "ok" and client._pid == os.getpid()
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1" and status == 0
    os.close(read)
    assert client.health().status == "ok"


def test_error_mapping_of_every_core_error_and_unknown_ones() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert ERROR_TYPES[name] is cls
        assert type(error_from_body(name, "msg")) is cls
    unknown = error_from_body("InternalError", "boom", 500)
    assert type(unknown) is shmcache.ShmCacheError
    assert "InternalError" in str(unknown) and "boom" in str(unknown)
    assert isinstance(_error_of(httpx.Response(401, text="no")), shmcache.UnauthorizedError)
    plain = _error_of(httpx.Response(502, text="<html>bad gateway</html>"))
    assert type(plain) is shmcache.ShmCacheError and "502" in str(plain)
    body = _error_of(httpx.Response(404, json={"error": "JobNotFoundError", "detail": "gone"}))
    assert isinstance(body, JobNotFoundError) and str(body) == "gone"


def test_records_ignore_fields_a_newer_daemon_adds() -> None:
    job = {
        "id": "x", "key": "k", "source": "/s", "pin": False, "overwrite": False, "state": "failed",
        "bytes_done": 1, "bytes_total": 2, "keys": [], "error": {"type": "CacheFullError", "detail": "d"},
        "cancel_requested": False, "created": 1.0, "started": None, "finished": 2.0, "priority": 7,
    }
    parsed = Job.from_json(job)
    assert parsed.error is not None and parsed.error.type == "CacheFullError" and not parsed.active
    assert Job is _control.Job and JobError is _control.JobError and CLIENT_ACTIVE_STATES is ACTIVE_STATES
    health = Health.from_json(
        {"status": "ok", "version": "9", "pid": 1, "root": "/r", "uptime_s": 1.0, "extra": 1}
    )
    assert health.version == "9"


def test_client_package_imports_no_service_fastapi_or_torch() -> None:
    code = (
        "import json, sys, shmcache.client; "
        "print(json.dumps([m for m in ('fastapi', 'uvicorn', 'torch', 'shmcache.service', 'typer') "
        "if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
