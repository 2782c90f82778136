"""Writes through a daemon's descriptor channel (``ROOT/daemon.fds``): the daemon makes
each file, the member fills it, the daemon checks and publishes it.

Against a real ``shmcache serve`` on a personal root (the channel is the same for a team
root; other users: ``test_team_members.py``), and, for quotas, a channel served in this
process with a quota. Members that misbehave speak the protocol raw.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from service_helpers import Daemon, running_daemon, temporary_root, wait_for
from shmcache.service.fd_channel import FdChannel
from shmcache.service.members import MemberPolicy

import shmcache
from shmcache import QuotaExceededError, Store
from shmcache._disk.fs import allocated_bytes
from shmcache._disk.npy import build_header
from shmcache._store.fd_messages import FDS_SOCKET, recv_message, send_message
from shmcache._store.member_writes import MemberWriter
from shmcache._store.ownership import fair_order
from shmcache._store.records import EntryInfo
from shmcache.errors import (
    CorruptSourceError,
    KeyExistsError,
    UnsupportedDataError,
)


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    """A real daemon on a fresh personal root."""
    with temporary_root() as root, running_daemon(root) as running:
        yield running


@pytest.fixture(scope="module")
def served(daemon: Daemon) -> Path:
    return daemon.root


def _tmp_versions(root: Path) -> list[str]:
    return [name for name in os.listdir(root / "tmp") if not name.endswith(".lock")]


def _ask(sock: socket.socket, body: dict[str, object]) -> tuple[dict[str, object], int | None]:
    send_message(sock, body)
    got = recv_message(sock)
    assert got is not None
    return got


def _raw(root: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(str(root / FDS_SOCKET))
    return sock


def _npy(array: np.ndarray) -> bytes:
    return build_header(array.dtype, array.shape, False) + array.tobytes()


# ---------------------------------------------------------------------- round trips


def test_put_array_through_the_daemon_is_read_back_verified_and_owned(served: Path) -> None:
    data = np.arange(1000, dtype=np.float32).reshape(10, 100)
    info = MemberWriter(served).put_array("rt/array", data)
    store = Store(served)
    assert np.array_equal(store.open_array("rt/array"), data)
    assert info.owner_uid == os.geteuid() == store.info("rt/array").owner_uid
    assert store.verify("rt/array") is True  # the daemon's checksum of the bytes it published
    assert _tmp_versions(served) == []


def test_containers_share_and_cache_through_the_daemon(served: Path) -> None:
    writer = MemberWriter(served)
    store = Store(served)
    writer.put_strings("rt/strings", ["a", "bb", "ccc"])
    writer.put_records("rt/records", [{"x": 1}, {"y": [2, 3]}])
    writer.put_ragged("rt/ragged", [np.arange(3), np.arange(5)])
    assert list(store.open_strings("rt/strings")) == ["a", "bb", "ccc"]
    assert store.open_records("rt/records")[1] == {"y": [2, 3]}
    assert store.open_ragged("rt/ragged")[1].tolist() == [0, 1, 2, 3, 4]
    rows = [{"label": i, "path": f"img{i}.jpg"} for i in range(5)]
    assert writer.share("rt/shared", rows) == "table"
    version = store.info("rt/shared").version
    writer.share("rt/shared", rows)  # the same content: reused, not written again
    assert store.info("rt/shared").version == version
    with pytest.raises(KeyExistsError):
        writer.share("rt/shared", rows[:2])
    calls: list[int] = []

    def loader() -> np.ndarray:
        calls.append(1)
        return np.ones(4)

    for _ in range(2):
        assert writer.cache("rt/cached", loader, store.open_array, "v1").tolist() == [1.0] * 4
    assert calls == [1]


_CACHE_CALLER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from shmcache import Store
    from shmcache._store.member_writes import MemberWriter

    root, marks = sys.argv[1], sys.argv[2]

    def loader():
        with open(marks, "a") as fp:
            fp.write("loaded\\n")
        time.sleep(1.0)  # the other caller arrives meanwhile and waits on the key's lock
        return np.arange(5)

    print(MemberWriter(root).cache("rt/once", loader, Store(root).open_array, None).tolist())
    """
)


def test_members_cache_calls_at_once_run_the_loader_once(served: Path, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    callers = [
        subprocess.Popen(
            [sys.executable, "-c", _CACHE_CALLER, str(served), str(marks)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    outputs = [caller.communicate(timeout=120)[0].strip() for caller in callers]
    assert outputs == ["[0, 1, 2, 3, 4]"] * 3
    assert marks.read_text().splitlines() == ["loaded"]


def test_put_file_is_read_by_the_member_and_copied_into_the_daemons_file(
    served: Path, tmp_path: Path
) -> None:
    np.save(tmp_path / "a.npy", np.arange(6).reshape(2, 3))
    np.savez(tmp_path / "b.npz", x=np.arange(3), y=np.ones(2))
    writer = MemberWriter(served)
    assert writer.put_file("files/a", tmp_path / "a.npy") == ["files/a"]
    assert sorted(writer.put_file("files/b", tmp_path / "b.npz")) == ["files/b/x", "files/b/y"]
    store = Store(served)
    assert store.open_array("files/a").tolist() == [[0, 1, 2], [3, 4, 5]]
    assert store.open_array("files/b/y").tolist() == [1.0, 1.0]
    assert store.info("files/a").source == str(tmp_path / "a.npy")
    assert store.verify("files/b/x") is True


def test_a_large_file_is_copied_by_the_kernel_into_the_daemons_file(served: Path, tmp_path: Path) -> None:
    big = np.arange(3 << 20, dtype=np.float32)  # 12 MiB: the kernel copy with its trailing checksum
    np.save(tmp_path / "big.npy", big)
    assert MemberWriter(served).put_file("files/big", tmp_path / "big.npy") == ["files/big"]
    assert np.array_equal(Store(served).open_array("files/big"), big)
    assert Store(served).verify("files/big") is True


def test_a_directory_of_thousands_of_files_is_put_and_answered_whole(served: Path, tmp_path: Path) -> None:
    """3,000 files with long names: the commit (~0.5 MB of metadata) and its answer (~1 MB)
    are larger than a seqpacket record may be (the socket's send buffer, 208 KiB by
    default: 600 files failed after publishing, 3,000 with a raw EMSGSIZE after the
    writes); they go as several records and the member gets every entry back."""
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(3000):
        np.save(folder / f"a_rather_long_file_name_as_datasets_have_{i:05d}.npy", np.full(4, i))
    keys = MemberWriter(served).put_file("many", folder)
    assert len(keys) == 3000 and keys[0].startswith("many/a_rather_long_file_name")
    last = Store(served).open_array("many/a_rather_long_file_name_as_datasets_have_02999")
    assert last.tolist() == [2999] * 4
    assert not _tmp_versions(served)


def test_a_message_goes_as_records_with_its_descriptor_and_is_bounded() -> None:
    """The framing alone: a message of 5 MB arrives whole, its descriptor with it; one of
    100 KB is one record (as an older peer sends and reads); a record but the last of
    another size, a request over the daemon's 8 MiB, and a peer that hangs up in the middle
    of a message are typed errors, not half messages."""
    from shmcache._store import fd_messages
    from shmcache.errors import InvalidRequestError

    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    read_end, write_end = os.pipe()
    try:
        body = {"op": "commit", "extra": [{"name": f"k{i}" * 20} for i in range(50_000)]}
        assert fd_messages.message_size(body) > 100 * fd_messages.RECORD
        sender = threading.Thread(target=send_message, args=(left, body, write_end))
        sender.start()
        got = recv_message(right)
        sender.join()
        assert got is not None and got[0] == body and got[1] is not None
        os.write(got[1], b"x")
        os.close(got[1])
        assert os.read(read_end, 1) == b"x"
        send_message(left, {"op": "begin", "pad": "x" * 100_000})  # what an older peer reads: one record
        assert json.loads(right.recv(1 << 20)) == {"op": "begin", "pad": "x" * 100_000}
        left.sendall(b"\x01" + b" " * 100)  # a record but the last of other than RECORD bytes
        with pytest.raises(InvalidRequestError, match="not 32768 bytes"):
            recv_message(right)
        big = {"op": "commit", "extra": ["x" * 1000] * 9000}  # 9 MB: over what the daemon reads

        def send_big() -> None:
            with contextlib.suppress(OSError):  # the reader gives up and closes
                send_message(left, big)

        sender = threading.Thread(target=send_big)
        sender.start()
        with pytest.raises(InvalidRequestError, match="over the channel's 8388608 bytes"):
            recv_message(right, fd_messages.MAX_REQUEST, one_big_at_a_time=True)
        right.close()  # (the rest of that message is never read)
        sender.join()
        left.close()
        left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        left.sendall(b"\x01" + b" " * (fd_messages.RECORD - 1))
        left.close()  # the peer hangs up in the middle of a message
        with pytest.raises(InvalidRequestError, match="middle of a message"):
            recv_message(right)
    finally:
        for fd in (read_end, write_end):
            os.close(fd)
        right.close()


def test_existing_key_is_refused_and_overwrite_replaces(served: Path) -> None:
    writer = MemberWriter(served)
    writer.put_array("rt/again", np.zeros(2))
    with pytest.raises(KeyExistsError, match="overwrite=True"):
        writer.put_array("rt/again", np.ones(2))
    writer.put_array("rt/again", np.ones(2), overwrite=True)
    assert Store(served).open_array("rt/again").tolist() == [1.0, 1.0]


def test_object_arrays_are_refused_before_anything_is_sent(served: Path) -> None:
    with pytest.raises(UnsupportedDataError):
        MemberWriter(served).put_array("rt/objects", np.array([object()]))


def test_metrics_count_each_users_entries_bytes_and_puts(served: Path, daemon: Daemon) -> None:
    MemberWriter(served).put_array("rt/metered", np.zeros(1000, dtype=np.uint8))
    with daemon.client() as http:
        text = http.get("/metrics").text
    user = pwd.getpwuid(os.geteuid()).pw_name
    assert f'shmcache_user_entries{{user="{user}"}}' in text
    assert f'shmcache_user_bytes{{user="{user}"}}' in text
    assert f'shmcache_member_puts_total{{user="{user}"}}' in text


def test_every_write_records_its_owner_in_a_personal_root(root: Path) -> None:
    info = Store(root).put_array("mine", np.arange(3))
    assert info.owner_uid == os.geteuid() == Store(root).list()[0].owner_uid


# ---------------------------------------------------------------------- a member that cheats


def _begin_one(sock: socket.socket, key: str, size: int, kind: str = "array") -> None:
    answer, _ = _ask(sock, {"op": "begin", "entries": [{"key": key, "kind": kind, "files": {"data": size}}]})
    assert answer["ok"] is True, answer


def _file(sock: socket.socket) -> int:
    answer, fd = _ask(sock, {"op": "file", "entry": 0, "name": "data"})
    assert answer["ok"] is True and fd is not None, answer
    return fd


def test_a_pickle_header_is_refused_and_nothing_is_published(served: Path) -> None:
    body = b"\x93NUMPY\x01\x00v\x00{'descr': '|O', 'fortran_order': False, 'shape': (1,), }"
    body = body.ljust(127) + b"\n" + b"\x80\x04N."
    sock = _raw(served)
    try:
        _begin_one(sock, "cheat/pickle", len(body))
        fd = _file(sock)
        os.write(fd, body)
        os.close(fd)
        answer, _ = _ask(sock, {"op": "commit", "extra": [{}]})
    finally:
        sock.close()
    assert answer["ok"] is False and answer["error"] in ("UnsupportedDataError", "CorruptSourceError")
    assert not Store(served).exists("cheat/pickle")
    wait_for(lambda: _tmp_versions(served) == [], what="the refused version removed")


def test_a_descriptor_kept_open_is_refused_at_commit(served: Path) -> None:
    data = _npy(np.arange(4))
    sock = _raw(served)
    try:
        _begin_one(sock, "cheat/open", len(data))
        fd = _file(sock)
        os.write(fd, data)
        kept = os.dup(fd)  # a copy kept to change the bytes after the daemon checked them
        os.close(fd)
        answer, _ = _ask(sock, {"op": "commit", "extra": [{}]})
        os.close(kept)
    finally:
        sock.close()
    assert answer["ok"] is False and answer["error"] == "InvalidRequestError"
    assert "still open for writing" in str(answer["detail"])
    assert not Store(served).exists("cheat/open")


def test_a_size_other_than_declared_and_reserved_fields_are_refused(served: Path) -> None:
    data = _npy(np.arange(4))
    sock = _raw(served)
    try:
        _begin_one(sock, "cheat/size", len(data) + 8)
        fd = _file(sock)
        os.write(fd, data)
        os.ftruncate(fd, len(data))
        os.close(fd)
        answer, _ = _ask(sock, {"op": "commit", "extra": [{}]})
        assert answer["ok"] is False and answer["error"] == CorruptSourceError.__name__
        _begin_one(sock, "cheat/owner", len(data))
        fd = _file(sock)
        os.write(fd, data)
        os.close(fd)
        answer, _ = _ask(sock, {"op": "commit", "extra": [{"owner_uid": 12345}]})
        assert answer["ok"] is False and "owner_uid" in str(answer["detail"])
    finally:
        sock.close()
    assert not Store(served).exists("cheat/size") and not Store(served).exists("cheat/owner")


def test_bad_requests_are_typed_errors(served: Path) -> None:
    sock = _raw(served)
    try:
        for body in (
            {"op": "nope"},
            {"op": "file", "entry": 0, "name": "data"},
            {"op": "begin", "entries": [{"key": "../x", "kind": "array", "files": {"data": 10}}]},
            {"op": "begin", "entries": [{"key": "k", "kind": "pickle", "files": {"data": 10}}]},
            {"op": "begin", "entries": [{"key": "k", "kind": "array", "files": {"../meta": 10}}]},
        ):
            answer, fd = _ask(sock, body)
            assert answer["ok"] is False and fd is None, body
            assert answer["error"] in ("InvalidRequestError", "InvalidKeyError"), answer
    finally:
        sock.close()


_KILLED_MID_PUT = textwrap.dedent(
    """
    import os, socket, sys, time
    from shmcache._store.fd_messages import recv_message, send_message
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(sys.argv[1])
    size = 64 << 20
    entry = {"key": "killed", "kind": "array", "files": {"data": size}}
    send_message(sock, {"op": "begin", "entries": [entry]})
    assert recv_message(sock)[0]["ok"]
    send_message(sock, {"op": "file", "entry": 0, "name": "data"})
    answer, fd = recv_message(sock)
    os.write(fd, b"x" * (1 << 20))
    print("filling", flush=True)
    time.sleep(600)
    """
)


def test_a_member_killed_mid_put_publishes_nothing_and_its_space_returns(served: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_MID_PUT, str(served / FDS_SOCKET)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "filling"
        filling = _tmp_versions(served)  # the version being filled
        # Preallocated: 64 MiB are taken (counted on the version itself: the file system's free
        # blocks move with every other test that runs beside this one).
        held = sum(allocated_bytes(served / "tmp" / name) for name in filling)
        assert held >= 64 << 20, (filling, held)
        child.send_signal(signal.SIGKILL)
        child.wait(60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    wait_for(lambda: _tmp_versions(served) == [], timeout=30, what="the killed member's version removed")
    assert not Store(served).exists("killed")
    assert not any((served / "tmp" / name).exists() for name in filling)  # its 64 MiB are back


# ---------------------------------------------------------------------- quotas, in this process


@pytest.fixture
def quota_channel(root: Path, tmp_path: Path) -> Iterator[tuple[Path, FdChannel]]:
    """A channel on ``root`` with a 64 KiB per-user quota, served by this process."""
    Store(root).prepare()
    like = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    like_path = tmp_path / "like.sock"
    like.bind(str(like_path))
    os.chmod(like_path, 0o600)
    channel = FdChannel(Store(root), MemberPolicy(user_quota=64 << 10), refusal=lambda uid: None)
    channel.start(like_path)
    try:
        yield root, channel
    finally:
        channel.close()
        like.close()


def test_a_put_over_quota_is_a_typed_error_and_writes_nothing(quota_channel: tuple[Path, FdChannel]) -> None:
    root, _ = quota_channel
    writer = MemberWriter(root)
    writer.put_array("q/first", np.zeros(5000, dtype=np.uint8))
    with pytest.raises(QuotaExceededError) as raised:
        writer.put_array("q/second", np.zeros(62_000, dtype=np.uint8))
    message = str(raised.value)
    assert "quota" in message and "64.0 KiB" in message and "use 5.0 KiB" in message, message
    assert isinstance(raised.value, shmcache.CacheFullError)
    assert not Store(root).exists("q/second")
    assert _tmp_versions(root) == []
    writer.put_array("q/second", np.zeros(5000, dtype=np.uint8))  # what fits still goes in


def test_quota_usage_is_rebuilt_from_the_recorded_owners(quota_channel: tuple[Path, FdChannel]) -> None:
    root, channel = quota_channel
    MemberWriter(root).put_array("q/kept", np.zeros(50_000, dtype=np.uint8))
    channel.close()  # a restart: a new channel knows nothing but what the root records
    restarted = FdChannel(Store(root), MemberPolicy(user_quota=64 << 10), refusal=lambda uid: None)
    like = root.parent / f"{root.name}-like.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(like))
    try:
        restarted.start(like)
        with pytest.raises(QuotaExceededError, match="quota"):
            MemberWriter(root).put_array("q/more", np.zeros(20_000, dtype=np.uint8))
        assert Store(root).info("q/kept").owner_uid == os.geteuid()
    finally:
        restarted.close()
        sock.close()
        like.unlink()


# ---------------------------------------------------------------------- fairness


def _entry(key: str, owner: int, size: int, last_used: float) -> EntryInfo:
    return EntryInfo(
        key, "array", "uint8", (size,), size, size, 0.0, False, None, key, last_used, owner_uid=owner
    )


def test_eviction_takes_the_lru_entries_of_members_over_their_share_first() -> None:
    entries = [
        _entry("a-old", 1, 100, 1.0),
        _entry("b-oldest", 2, 100, 0.5),
        _entry("a-new", 1, 100, 3.0),
        _entry("a-mid", 1, 100, 2.0),
    ]
    order = [e.key for e in fair_order(entries, share=200)]
    assert order == ["a-old", "a-mid", "a-new", "b-oldest"]  # user 1 holds 300 > 200
    assert [e.key for e in fair_order(entries, share=None)] == ["b-oldest", "a-old", "a-mid", "a-new"]


def test_the_daemons_own_writes_still_take_a_while_at_most(served: Path) -> None:
    """A hang guard: a put of 32 MiB through the channel finishes (generous bound)."""
    start = time.monotonic()
    MemberWriter(served).put_array("rt/big", np.ones(4 << 20))
    assert time.monotonic() - start < 120
    assert Store(served).open_array("rt/big").sum() == 4 << 20
