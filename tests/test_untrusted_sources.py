"""Sources that are not what they seem (issue 10): FIFOs and other non-regular files named
``*.npy``, files swapped for links out of ``--allow-source`` between the check and the
copy, and files rewritten while they are copied.

Real FIFOs, sockets, symlinks and rewriter processes; the daemon tests use the module's
real ``shmcache serve`` (conftest ``daemon``, sources under ``data_dir``)."""

from __future__ import annotations

import mmap
import multiprocessing
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.synchronize import Event
from pathlib import Path

import httpx
import numpy as np
import pytest
from cli_helpers import cli_process
from service_helpers import Daemon, scratch_dir, unique, wait_job, write_big_npy

from shmcache import (
    CorruptSourceError,
    InvalidSourceError,
    SourceNotAllowedError,
    Store,
    UnsupportedDataError,
)
from shmcache._sources import source_files

MiB = 1 << 20
BIG = 160 * MiB  # more than one kernel copy chunk: a callback runs between chunks
PROMPT_S = 10.0  # "at once": generous for a loaded machine, far below a hang


def _nothing_published(store: Store, root: Path) -> None:
    assert store.list() == []
    for sub in ("tmp", "objects", "entries"):
        assert not (root / sub).exists() or os.listdir(root / sub) == [], sub


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """Sources on the tmpfs: there, writes through a shared mapping change no time stamp."""
    with scratch_dir("sources") as path:
        yield path


# ---------------------------------------------------------------------- not a regular file


def _unblock(fifo: Path) -> None:
    """Release a reader stuck opening ``fifo`` (today's code), so the test can end."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def _fifo(path: Path) -> Callable[[], None]:
    os.mkfifo(path)
    return lambda: _unblock(path)


def _socket(path: Path) -> Callable[[], None]:
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    return server.close


def _device(path: Path) -> Callable[[], None]:
    path.symlink_to("/dev/null")  # (not /dev/zero: the code before this test read it until OOM)
    return lambda: None


NOT_FILES = {
    "fifo": (_fifo, "(it is a FIFO)"),
    "socket": (_socket, "not a regular file"),
    "device": (_device, "(it is a character device)"),
}


def _within(
    seconds: float, action: Callable[[], object], release: Callable[[], None]
) -> BaseException | None:
    """Run ``action`` on a thread; the exception it raised, or fail if it still runs after ``seconds``."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            action()
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        release()
        thread.join(seconds)
        pytest.fail(f"still blocked after {seconds} s")
    return outcome[0]


@pytest.mark.parametrize("suffix", [".npy", ".npz"])
@pytest.mark.parametrize("kind", list(NOT_FILES))
def test_non_regular_file_is_refused_at_once(
    store: Store, root: Path, tmp_path: Path, kind: str, suffix: str
) -> None:
    make, says = NOT_FILES[kind]
    source = tmp_path / f"x{suffix}"
    release = make(source)
    try:
        for action in (lambda: store.plan_file("k", source), lambda: store.put_file("k", source)):
            error = _within(PROMPT_S, action, release)
            assert isinstance(error, InvalidSourceError), repr(error)
            assert str(source) in str(error) and says in str(error)
    finally:
        release()
    _nothing_published(store, root)


def test_fifo_in_a_directory_is_skipped(store: Store, tmp_path: Path) -> None:
    np.save(tmp_path / "good.npy", np.arange(3))
    os.mkfifo(tmp_path / "pipe.npy")
    release = lambda: _unblock(tmp_path / "pipe.npy")  # noqa: E731
    assert _within(PROMPT_S, lambda: store.put_file("ds", tmp_path), release) is None
    assert [e.key for e in store.list()] == ["ds/good"]


def test_cli_put_of_a_fifo_fails_at_once(root: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "x.npy"
    os.mkfifo(fifo)
    process = cli_process("put", str(fifo), "--key", "k", "--root", str(root))
    try:
        _, stderr = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail("`shmcache put` of a FIFO hangs")
    finally:
        _unblock(fifo)
    assert process.returncode == 1
    assert "FIFO" in stderr and str(fifo) in stderr


def test_daemon_refuses_a_fifo_at_once_and_keeps_answering(daemon: Daemon, data_dir: Path) -> None:
    fifos = [data_dir / f"{unique('pipe')}.npy" for _ in range(3)]
    for fifo in fifos:
        os.mkfifo(fifo)
    try:
        with daemon.client(timeout=PROMPT_S) as client:
            for fifo in fifos:
                started = time.monotonic()
                response = client.put(f"/v1/entries/{unique('k')}", json={"source": str(fifo)})
                assert time.monotonic() - started < PROMPT_S
                assert response.status_code == 400, response.text
                assert response.json()["error"] == "InvalidSourceError"
                assert "FIFO" in response.json()["detail"]
            assert client.get("/v1/health").status_code == 200
            sources = {job["source"] for job in client.get("/v1/jobs").json()}
            assert not sources & {str(fifo) for fifo in fifos}  # refused before any job was queued
    finally:
        for fifo in fifos:
            _unblock(fifo)
    assert daemon.process.poll() is None


# ---------------------------------------------------------------------- links out of the allowed dirs


@pytest.fixture(params=["openat2", "nofollow"])
def opener(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways of opening beneath a directory: openat2 where the kernel has it, and the
    O_NOFOLLOW walk of older kernels (forced here by saying the kernel has no openat2)."""
    if request.param == "openat2" and not source_files.openat2_available():
        pytest.skip("this kernel (or its seccomp filter) has no openat2")
    if request.param == "nofollow":
        monkeypatch.setattr(source_files, "_have_openat2", False)
    return str(request.param)


@pytest.fixture
def allowed(tmp_path: Path) -> tuple[Path, Path]:
    """An allowed directory holding ``ds/sub/x.npy``, and a secret outside it with the same layout."""
    top, outside = tmp_path / "allowed", tmp_path / "outside"
    for base, value in ((top, 1), (outside, 666)):
        (base / "ds" / "sub").mkdir(parents=True)
        np.save(base / "ds" / "sub" / "x.npy", np.full((3, 4), value, np.int64))
    return top, outside


def _swap_file(top: Path, outside: Path) -> None:
    victim = top / "ds" / "sub" / "x.npy"
    victim.unlink()
    victim.symlink_to(outside / "ds" / "sub" / "x.npy")


def _swap_directory(top: Path, outside: Path) -> None:
    victim = top / "ds" / "sub"
    victim.rename(top / "ds" / "old")
    victim.symlink_to(outside / "ds" / "sub")


def _once(action: Callable[[], None]) -> Callable[[int, int], None]:
    """A put_file progress callback that runs ``action`` at its first call: after every
    check, before the first byte is copied."""
    done = []

    def progress(_done: int, _total: int) -> None:
        if not done:
            done.append(True)
            action()

    return progress


@pytest.mark.parametrize("swap", [_swap_file, _swap_directory], ids=["file", "directory"])
@pytest.mark.parametrize("source", ["ds/sub/x.npy", "ds"])
def test_swapped_for_a_link_out_after_the_check(
    store: Store, root: Path, allowed: tuple[Path, Path], opener: str, swap: Callable[..., None], source: str
) -> None:
    top, outside = allowed
    with pytest.raises(SourceNotAllowedError) as info:
        store.put_file("k", top / source, allowed_dirs=[top], progress=_once(lambda: swap(top, outside)))
    assert str(outside) not in str(info.value)  # nothing about where the link points
    _nothing_published(store, root)


def test_links_out_are_refused_when_planned(store: Store, allowed: tuple[Path, Path]) -> None:
    top, outside = allowed
    _swap_file(top, outside)
    with pytest.raises(SourceNotAllowedError):
        store.plan_file("k", top / "ds", allowed_dirs=[top])
    with pytest.raises(SourceNotAllowedError):
        store.put_file("k", top / "ds", allowed_dirs=[top])


def test_links_inside_the_allowed_dirs_still_load(
    store: Store, allowed: tuple[Path, Path], opener: str
) -> None:
    top, _ = allowed
    (top / "alias.npy").symlink_to(top / "ds" / "sub" / "x.npy")  # absolute
    (top / "ds" / "link.npy").symlink_to("sub/x.npy")  # relative
    assert store.put_file("a", top / "alias.npy", allowed_dirs=[top]) == ["a"]
    assert sorted(store.put_file("d", top / "ds", allowed_dirs=[top])) == ["d/link", "d/sub/x"]
    assert store.open_array("a")[0, 0] == 1 and store.open_array("d/link")[0, 0] == 1


def test_file_replaced_by_another_after_the_check(
    store: Store, root: Path, allowed: tuple[Path, Path]
) -> None:
    top, _ = allowed
    victim = top / "ds" / "sub" / "x.npy"

    def replace() -> None:
        np.save(top / "other.npy", np.full((3, 4), 7, np.int64))
        os.replace(top / "other.npy", victim)

    with pytest.raises(CorruptSourceError, match="changed after it was checked"):
        store.put_file("k", victim, allowed_dirs=[top], progress=_once(replace))
    _nothing_published(store, root)


def test_daemon_job_opens_what_was_checked(daemon: Daemon, data_dir: Path, tmp_path: Path) -> None:
    """A file checked by the PUT and swapped for a link out before its queued job runs:
    the job fails and the secret's shape, dtype and checksum never become an entry."""
    secret = tmp_path / "secret.npy"
    np.save(secret, np.full((5, 5), 666, np.int64))
    victim = data_dir / f"{unique('victim')}.npy"
    np.save(victim, np.arange(4))
    blockers = [write_big_npy(data_dir / f"{unique('big')}.npy", 1 << 30) for _ in range(2)]
    key = unique("victim")
    with daemon.client() as client:
        jobs = [client.put(f"/v1/entries/{unique('big')}", json={"source": str(b)}).json() for b in blockers]
        for job in jobs:  # both load workers busy (64 MiB/s): the next load waits in the queue
            wait_job(client, job["id"], states=("running",))
        response = client.put(f"/v1/entries/{key}", json={"source": str(victim)})
        assert response.status_code == 202, response.text
        assert response.json()["state"] == "queued"
        victim.unlink()
        victim.symlink_to(secret)
        for job in jobs:
            client.delete(f"/v1/jobs/{job['id']}")
        job = wait_job(client, response.json()["id"])
        assert job["state"] == "failed", job
        assert job["error"]["type"] == "SourceNotAllowedError"
        assert str(secret) not in job["error"]["detail"]
        assert client.get(f"/v1/entries/{key}").status_code == 404
    for blocker in blockers:
        blocker.unlink()


# ---------------------------------------------------------------------- changed while loading


def _write_at(path: Path, offset: int, data: bytes) -> Callable[[], None]:
    def write() -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)

    return write


def _mid_copy(action: Callable[[], None]) -> Callable[[int, int], None]:
    """A progress callback that runs ``action`` once, after the first chunk was copied."""
    done = []

    def progress(copied: int, total: int) -> None:
        if 0 < copied < total and not done:
            done.append(True)
            action()

    return progress


def _replace_with_copy(path: Path) -> None:
    data = path.read_bytes()
    path.with_suffix(".new").write_bytes(data)
    os.replace(path.with_suffix(".new"), path)


CHANGES: dict[str, Callable[[Path], Callable[[], None]]] = {
    "rewritten-ahead": lambda p: _write_at(p, BIG - MiB, b"\x07" * MiB),  # not copied yet
    "rewritten-behind": lambda p: _write_at(p, 200, b"\x07" * 64),  # copied already
    "truncated": lambda p: lambda: os.truncate(p, BIG // 2),
    "replaced": lambda p: lambda: _replace_with_copy(p),  # same bytes, another file
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_source_changed_during_the_copy(store: Store, root: Path, shm_dir: Path, change: str) -> None:
    source = write_big_npy(shm_dir / "big.npy", BIG)
    with pytest.raises(CorruptSourceError, match="changed while loading") as info:
        store.put_file("k", source, progress=_mid_copy(CHANGES[change](source)))
    assert str(source) in str(info.value)
    _nothing_published(store, root)


def test_source_changed_between_the_check_and_the_copy(store: Store, root: Path, shm_dir: Path) -> None:
    source = shm_dir / "x.npy"
    np.save(source, np.arange(1000))
    with pytest.raises(CorruptSourceError, match="changed after it was checked"):
        store.put_file("k", source, progress=_once(_write_at(source, 200, b"\x07" * 8)))
    _nothing_published(store, root)


def _rewrite_forever(path: str, ready: Event, stop: Event) -> None:
    fd = os.open(path, os.O_WRONLY)
    blocks = [bytes([value]) * MiB for value in (1, 2)]
    ready.set()
    while not stop.is_set():
        for offset in range(256, BIG - MiB, 8 * MiB):  # payload only: the header stays valid
            os.pwrite(fd, blocks[offset // MiB % 2], offset)
        blocks.reverse()


def test_source_rewritten_by_another_process(store: Store, root: Path, shm_dir: Path) -> None:
    source = write_big_npy(shm_dir / "big.npy", BIG)
    context = multiprocessing.get_context("fork")
    ready, stop = context.Event(), context.Event()
    writer = context.Process(target=_rewrite_forever, args=(str(source), ready, stop), daemon=True)
    writer.start()
    try:
        assert ready.wait(30)
        with pytest.raises(CorruptSourceError, match="changed"):
            store.put_file("k", source)
    finally:
        stop.set()
        writer.join(30)
    _nothing_published(store, root)


def test_checksum_is_that_of_the_bytes_published(store: Store, shm_dir: Path) -> None:
    """Writes through a shared mapping of a tmpfs file change no time stamp, so nothing can
    tell the copy was mixed; the checksum recorded is still that of the bytes published
    (before: that of another read of the source, so ``verify`` blamed the cache)."""
    source = write_big_npy(shm_dir / "big.npy", BIG)
    fd = os.open(source, os.O_RDWR)
    mapping = mmap.mmap(fd, BIG + 128)
    os.close(fd)
    for page in range(0, BIG + 128, mmap.PAGESIZE):
        mapping[page] = mapping[page]  # every page writable already: later writes fault no more

    def write_through_mapping() -> None:
        time.sleep(1.0)  # (let a checksum thread that reads the source on its own finish first)
        mapping[BIG + 128 - MiB : BIG + 128] = b"\x09" * MiB

    try:
        assert store.put_file("k", source, progress=_mid_copy(write_through_mapping)) == ["k"]
    finally:
        mapping.close()
    assert store.verify("k") is True
    assert store.open_array("k")[-1] == 9  # copied after the change, and checksummed as copied


# ---------------------------------------------------------------------- hostile headers (issue 18)


def _npy_with_header(path: Path, fields: str, payload: bytes) -> Path:
    """A ``.npy`` file whose header dict is ``fields`` verbatim (padded as numpy pads it)."""
    text = fields.encode("latin1")
    pad = -(10 + len(text) + 1) % 64
    header = text + b" " * pad + b"\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + payload)
    return path


def _safetensors_with_header(path: Path, header: str, payload: bytes = b"") -> Path:
    raw = header.encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + payload)
    return path


def _ones(n: int) -> str:
    return "(" + ", ".join(["1"] * n) + ",)"


HOSTILE_NPY = {
    "70 dimensions": (f"{{'descr': '<f4', 'fortran_order': False, 'shape': {_ones(70)}, }}", 4),
    "a bool dimension": ("{'descr': '|u1', 'fortran_order': False, 'shape': (True,), }", 1),
    "an empty shape whose other dimensions overflow": (
        f"{{'descr': '<f4', 'fortran_order': False, 'shape': (0, {2**62}, {2**62}), }}",
        0,
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE_NPY))
@pytest.mark.parametrize("container", [".npy", ".npz"])
def test_npy_shapes_no_reader_can_open_are_refused(
    store: Store, root: Path, tmp_path: Path, case: str, container: str
) -> None:
    fields, nbytes = HOSTILE_NPY[case]
    source = _npy_with_header(tmp_path / "x.npy", fields, b"\0" * nbytes)
    if container == ".npz":
        import zipfile

        with zipfile.ZipFile(tmp_path / "x.npz", "w") as archive:
            archive.write(source, "x.npy")
        source = tmp_path / "x.npz"
    with pytest.raises(CorruptSourceError, match="shape"):
        store.put_file("k", source)
    _nothing_published(store, root)


HOSTILE_SAFETENSORS = {
    "70 dimensions": ('{"t": {"dtype": "F32", "shape": %s, "data_offsets": [0, 4]}}' % ([1] * 70), 4),
    "a bool dimension": ('{"t": {"dtype": "U8", "shape": [true], "data_offsets": [0, 1]}}', 1),
    "an empty shape whose other dimensions overflow": (
        '{"t": {"dtype": "F32", "shape": [0, %d, %d], "data_offsets": [0, 0]}}'.replace("%d", str(2**62)),
        0,
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE_SAFETENSORS))
def test_safetensors_shapes_no_reader_can_open_are_refused(
    store: Store, root: Path, tmp_path: Path, case: str
) -> None:
    header, nbytes = HOSTILE_SAFETENSORS[case]
    source = _safetensors_with_header(tmp_path / "m.safetensors", header, b"\0" * nbytes)
    with pytest.raises(CorruptSourceError, match=r"tensor 't'.*shape"):
        store.put_file("k", source)
    _nothing_published(store, root)


def test_safetensors_header_nested_100000_deep_is_refused(store: Store, root: Path, tmp_path: Path) -> None:
    depth = 100_000
    header = (
        '{"t": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "x": ' + "[" * depth + "]" * depth + "}"
    )
    source = _safetensors_with_header(tmp_path / "deep.safetensors", header, b"\0")
    with pytest.raises(CorruptSourceError, match="nests objects or lists over"):
        store.put_file("k", source)
    _nothing_published(store, root)


def test_brackets_inside_safetensors_strings_are_not_nesting(store: Store, tmp_path: Path) -> None:
    note = '"[[[[[[{{{{{{ \\" ]]"'  # brackets, and an escaped quote, inside a string
    tensor = '"t": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}'
    header = '{"__metadata__": {"note": ' + note + "}, " + tensor + "}"
    source = _safetensors_with_header(tmp_path / "ok.safetensors", header, b"\x07")
    store.put_file("k", source)
    assert store.open_array("k/t").tolist() == [7]


def _shared_dict_bomb(path: Path, levels: int = 24) -> Path:
    """A ~2 KB checkpoint whose every level is one dict referenced twice: 2**levels tensors
    when walked naively (torch.save memoizes the shared dicts, as any pickle does)."""
    torch = pytest.importorskip("torch")
    nested: dict[str, object] = {"w": torch.zeros(1)}
    for _ in range(levels):
        nested = {"a": nested, "b": nested}
    torch.save(nested, path)
    return path


def test_torch_shared_dict_bomb_is_refused_at_once(store: Store, root: Path, tmp_path: Path) -> None:
    source = _shared_dict_bomb(tmp_path / "bomb.pt")
    assert source.stat().st_size < 4096
    started = time.monotonic()
    error = _within(PROMPT_S, lambda: store.put_file("k", source), lambda: None)
    assert time.monotonic() - started < PROMPT_S
    assert isinstance(error, UnsupportedDataError), repr(error)
    assert "is the very dict already found at" in str(error) and str(source) in str(error)
    _nothing_published(store, root)


def test_torch_tensor_saved_under_two_names_still_loads(store: Store, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    torch.save({"embed": weight, "head": weight}, tmp_path / "tied.pt")  # tied weights: one object
    store.put_file("m", tmp_path / "tied.pt")
    assert store.open_array("m/head").tolist() == store.open_array("m/embed").tolist() == weight.tolist()


def test_torch_70_dimensions_are_refused(store: Store, root: Path, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    torch.save({"t": torch.zeros((1,) * 70)}, tmp_path / "wide.pt")
    with pytest.raises(UnsupportedDataError, match="70 dimensions"):
        store.put_file("k", tmp_path / "wide.pt")
    _nothing_published(store, root)


def test_daemon_refuses_the_torch_bomb_and_keeps_answering(daemon: Daemon, data_dir: Path) -> None:
    source = _shared_dict_bomb(data_dir / f"{unique('bomb')}.pt")
    answers: list[httpx.Response] = []

    def post() -> None:
        with daemon.client(timeout=60) as client:
            answers.append(client.put(f"/v1/entries/{unique('k')}", json={"source": str(source)}))

    poster = threading.Thread(target=post, daemon=True)
    started = time.monotonic()
    poster.start()
    with daemon.client(timeout=PROMPT_S) as client:
        while poster.is_alive() and time.monotonic() - started < 60:
            assert client.get("/v1/health").status_code == 200  # answered meanwhile
            time.sleep(0.05)
    poster.join(1)
    assert answers, "the load of a 2 KB checkpoint did not answer within 60 s"
    assert time.monotonic() - started < PROMPT_S
    response = answers[0]
    assert response.status_code in (400, 415, 422), response.text
    assert response.json()["error"] in ("UnsupportedDataError", "InvalidSourceError"), response.text
    assert daemon.process.poll() is None


def test_torch_dicts_nested_too_deep_are_refused(store: Store, root: Path, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    nested: dict[str, object] = {"w": torch.zeros(1)}
    for _ in range(40):
        nested = {"d": nested}
    torch.save(nested, tmp_path / "deep.pt")
    with pytest.raises(UnsupportedDataError, match="dicts nested over 32 deep"):
        store.put_file("k", tmp_path / "deep.pt")
    _nothing_published(store, root)


def test_daemon_answers_a_deeply_nested_safetensors_header_with_a_4xx(daemon: Daemon, data_dir: Path) -> None:
    depth = 100_000
    header = '{"x": ' + "[" * depth + "]" * depth + "}"
    source = _safetensors_with_header(data_dir / f"{unique('deep')}.safetensors", header)
    with daemon.client(timeout=60) as client:
        response = client.put(f"/v1/entries/{unique('k')}", json={"source": str(source)})
        assert response.status_code == 400, response.text  # was a 500 with a RecursionError
        assert response.json()["error"] == "CorruptSourceError"
        assert "nests objects or lists over" in response.json()["detail"]
        assert client.get("/v1/health").status_code == 200


def test_safetensors_with_too_many_tensors_is_refused(
    store: Store, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shmcache._sources import safetensors

    monkeypatch.setattr(safetensors, "MAX_TENSORS", 1000)  # the real cap (2^20): a 60 MB header
    empty = '{"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}'
    header = "{" + ",".join(f'"{i:x}": {empty}' for i in range(1001)) + "}"  # each one an entry
    source = _safetensors_with_header(tmp_path / "many.safetensors", header)
    with pytest.raises(UnsupportedDataError, match="over 1000 tensors"):
        store.put_file("k", source)
    _nothing_published(store, root)


@pytest.mark.parametrize("brackets", ["()", "[]", "{}"])
def test_npy_header_of_deeply_nested_brackets_is_refused_at_once(
    store: Store, root: Path, tmp_path: Path, brackets: str
) -> None:
    """A 900 KB header of brackets (under the 1 MiB header limit): numpy's own parser took
    seconds per 100 KB of it before refusing; the nesting is now refused first."""
    depth = 450_000
    opener = brackets[0] if brackets != "{}" else "{0: "
    nested = opener * depth + brackets[1] * depth
    fields = f"{{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'x': {nested}}}".encode()
    header = fields + b" " * (-(12 + len(fields) + 1) % 64) + b"\n"
    source = tmp_path / "nested.npy"
    source.write_bytes(b"\x93NUMPY\x02\x00" + len(header).to_bytes(4, "little") + header + bytes(4))
    started = time.monotonic()
    with pytest.raises(CorruptSourceError, match="nests brackets over 64 deep"):
        store.put_file("k", source)
    assert time.monotonic() - started < PROMPT_S
    _nothing_published(store, root)
