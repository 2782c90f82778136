"""One contract for the control protocol (:class:`shmcache._control.CacheControl`), run against
every backend that claims it: a local :class:`shmcache.Store` and the daemon's
:class:`shmcache.client.Client` (zarr-python's ``StoreTests`` style: the tests live in a base
class, each backend is a subclass that provides the ``backend`` fixture).

The same calls must give the same answers (keys, records, error classes) whichever backend
serves them, so the CLI and any tool can pick one and not care which.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from service_helpers import Daemon, unique
from source_times import age

import shmcache
from shmcache import EntryInfo, StoreStats
from shmcache._control import CacheControl
from shmcache._disk.layout import Layout

DEAD_WRITER_DIR = "1-999999999-deadbeef.1"
"""A partial version left in ``tmp/`` by a writer that died (no live process holds its lock)."""


class ControlContract:
    """The tests; a subclass provides ``backend`` (a CacheControl) and ``sources`` (a
    directory the backend may load from)."""

    @pytest.fixture
    def backend(self) -> CacheControl:
        raise NotImplementedError

    @pytest.fixture
    def sources(self, data_dir: Path) -> Path:
        path = data_dir / unique("src")
        path.mkdir()
        return path

    @pytest.fixture
    def prefix(self) -> str:
        """Every test's keys live under their own prefix: a daemon is shared by the module."""
        return unique("contract")

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def npy(folder: Path, name: str, array: np.ndarray) -> Path:
        path = folder / f"{name}.npy"
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, array, allow_pickle=False)
        return path

    # ------------------------------------------------------------------ the contract

    def test_is_a_cache_control_of_its_root(self, backend: CacheControl, expected_root: Path) -> None:
        assert isinstance(backend, CacheControl)
        assert isinstance(backend.root, Path) and backend.root == expected_root

    def test_put_file_of_an_npy_returns_its_key(
        self, backend: CacheControl, sources: Path, prefix: str
    ) -> None:
        source = self.npy(sources, "labels", np.arange(12, dtype=np.int64).reshape(3, 4))
        assert backend.put_file(f"{prefix}/labels", source) == [f"{prefix}/labels"]
        array = shmcache.Store(backend.root).open_array(f"{prefix}/labels")
        assert array.shape == (3, 4) and int(array.sum()) == 66

    def test_put_file_of_an_npz_returns_a_key_per_member(
        self, backend: CacheControl, sources: Path, prefix: str
    ) -> None:
        source = sources / "pair.npz"
        np.savez(source, x=np.arange(3), y=np.arange(4.0))
        assert backend.put_file(f"{prefix}/pair", source) == [f"{prefix}/pair/x", f"{prefix}/pair/y"]

    def test_put_file_of_a_directory_returns_a_key_per_file(
        self, backend: CacheControl, sources: Path, prefix: str
    ) -> None:
        folder = sources / "feats"
        self.npy(folder, "a", np.ones(5, dtype=np.float32))
        self.npy(folder / "sub", "b", np.zeros((2, 3), dtype=np.uint8))
        np.savez(folder / "c.npz", x=np.arange(3), y=np.arange(4.0))
        (folder / "notes.txt").write_text("not an array: ignored")
        keys = backend.put_file(f"{prefix}/feats", folder, pin=True, as_="arrays")  # auto would ask
        expected = [f"{prefix}/feats/{name}" for name in ("a", "c/x", "c/y", "sub/b")]
        assert sorted(keys) == expected and len(keys) == len(set(keys))
        assert [e.key for e in backend.list(prefix)] == expected
        assert all(e.pinned for e in backend.list(prefix))

    def test_put_file_of_other_files_or_as_blobs_is_one_blobs_entry(
        self, backend: CacheControl, sources: Path, prefix: str
    ) -> None:
        folder = sources / "images"
        (folder / "sub").mkdir(parents=True)
        (folder / "a.jpg").write_bytes(b"\xff\xd8 jpeg")
        (folder / "sub" / "b.png").write_bytes(b"\x89PNG")
        assert backend.put_file(f"{prefix}/imgs", folder) == [f"{prefix}/imgs"]
        self.npy(folder, "x", np.arange(3))
        with pytest.raises(shmcache.InvalidSourceError, match="--as arrays"):
            backend.put_file(f"{prefix}/mixed", folder)
        assert backend.put_file(f"{prefix}/all", folder, as_="blobs") == [f"{prefix}/all"]
        info = backend.info(f"{prefix}/all")
        assert (info.kind, info.dtype, info.shape) == ("blobs", "bytes", (3,))
        blobs = shmcache.open_blobs(f"{prefix}/all", root=backend.root)
        assert list(blobs.names) == ["a.jpg", "sub/b.png", "x.npy"] and bytes(blobs[1]) == b"\x89PNG"

    def test_put_file_reports_progress_up_to_the_total(
        self, backend: CacheControl, sources: Path, prefix: str
    ) -> None:
        source = self.npy(sources, "big", np.arange(1 << 16, dtype=np.int64))
        calls: list[tuple[int, int]] = []
        backend.put_file(f"{prefix}/big", source, progress=lambda done, total: calls.append((done, total)))
        assert calls and calls[-1][0] == calls[-1][1] >= source.stat().st_size - 4096
        assert all(0 <= done <= total for done, total in calls)

    def test_list_is_sorted_and_filtered_by_whole_key_components(
        self, backend: CacheControl, sources: Path, prefix: str
    ) -> None:
        for name in ("b/c", "ab", "a"):
            backend.put_file(f"{prefix}/{name}", self.npy(sources, name.replace("/", "-"), np.arange(2)))
        everything = [f"{prefix}/a", f"{prefix}/ab", f"{prefix}/b/c"]
        assert [e.key for e in backend.list(prefix)] == everything
        assert [e.key for e in backend.list(f"{prefix}/a")] == [f"{prefix}/a"]  # not .../ab
        assert [e.key for e in backend.list(f"{prefix}/b")] == [f"{prefix}/b/c"]
        assert backend.list(f"{prefix}/nothing") == []
        listed = [e.key for e in backend.list()]
        assert listed == sorted(listed) and set(everything) <= set(listed)
        assert all(isinstance(e, EntryInfo) for e in backend.list(prefix))

    def test_info_describes_the_entry(self, backend: CacheControl, sources: Path, prefix: str) -> None:
        array = np.arange(24, dtype="<f4").reshape(2, 3, 4)
        source = self.npy(sources, "cube", array)
        age(source)  # else racily clean (source_files.RACY_NS): its fingerprint says so
        backend.put_file(f"{prefix}/cube", source)
        info = backend.info(f"{prefix}/cube")
        assert isinstance(info, EntryInfo)
        assert info.key == f"{prefix}/cube" and info.kind == "array"
        assert info.dtype == "float32" and info.shape == (2, 3, 4) and info.nbytes == array.nbytes
        assert info.size >= array.nbytes and not info.pinned
        assert info.source == os.path.realpath(source)
        st = source.stat()
        assert info.source_fingerprint == {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        (listed,) = backend.list(f"{prefix}/cube")
        same = [f for f in EntryInfo.__dataclass_fields__ if f != "last_used"]  # opens may touch it
        assert {f: getattr(info, f) for f in same} == {f: getattr(listed, f) for f in same}

    def test_info_of_an_npz_member_names_the_member(
        self, backend: CacheControl, sources: Path, prefix: str
    ) -> None:
        source = sources / "pair.npz"
        np.savez(source, x=np.arange(3, dtype=np.int16))
        backend.put_file(f"{prefix}/pair", source)
        info = backend.info(f"{prefix}/pair/x")
        assert info.dtype == "int16" and info.shape == (3,) and info.nbytes == 6
        assert info.source == f"{os.path.realpath(source)}[x.npy]"

    def test_evict_frees_the_bytes_and_the_key_is_gone(
        self, backend: CacheControl, sources: Path, prefix: str
    ) -> None:
        array = np.arange(1 << 15, dtype=np.int64)
        backend.put_file(f"{prefix}/gone", self.npy(sources, "gone", array))
        freed = backend.evict(f"{prefix}/gone")
        assert isinstance(freed, int) and freed >= array.nbytes
        with pytest.raises(shmcache.KeyNotFoundError):
            backend.info(f"{prefix}/gone")
        with pytest.raises(shmcache.KeyNotFoundError):
            backend.evict(f"{prefix}/gone")
        assert backend.list(prefix) == []

    @pytest.mark.parametrize("bad", ["bad key", "a//b", "../x", "/abs", ""])
    def test_bad_keys_are_invalid_key_errors(
        self, backend: CacheControl, sources: Path, bad: str
    ) -> None:
        source = self.npy(sources, "fine", np.arange(2))
        with pytest.raises(shmcache.InvalidKeyError):
            backend.put_file(bad, source)
        with pytest.raises(shmcache.InvalidKeyError):
            backend.info(bad)
        with pytest.raises(shmcache.InvalidKeyError):
            backend.evict(bad)

    def test_a_missing_key_is_key_not_found(self, backend: CacheControl, prefix: str) -> None:
        for call in (backend.info, backend.evict, backend.mapped_by):
            with pytest.raises(shmcache.KeyNotFoundError) as caught:
                call(f"{prefix}/missing")
            assert type(caught.value) is shmcache.KeyNotFoundError
            assert f"{prefix}/missing" in str(caught.value)

    def test_a_missing_source_is_source_not_found(
        self, backend: CacheControl, sources: Path, prefix: str
    ) -> None:
        with pytest.raises(shmcache.SourceNotFoundError) as caught:
            backend.put_file(f"{prefix}/k", sources / "missing.npy")
        assert isinstance(caught.value, FileNotFoundError)
        assert backend.list(prefix) == []

    def test_an_existing_key_needs_overwrite(
        self, backend: CacheControl, sources: Path, prefix: str
    ) -> None:
        key = f"{prefix}/again"
        backend.put_file(key, self.npy(sources, "one", np.arange(3)))
        with pytest.raises(shmcache.KeyExistsError):
            backend.put_file(key, self.npy(sources, "two", np.arange(5)))
        assert backend.info(key).shape == (3,)  # untouched
        assert backend.put_file(key, sources / "two.npy", overwrite=True) == [key]
        assert backend.info(key).shape == (5,)

    def test_stats_count_the_entries_and_their_bytes(
        self, backend: CacheControl, sources: Path, prefix: str
    ) -> None:
        before = backend.stats()
        array = np.arange(1 << 14, dtype=np.int64)
        keys = backend.put_file(f"{prefix}/s", self.npy(sources, "s", array))
        backend.put_file(f"{prefix}/t", self.npy(sources, "t", np.arange(3)))
        after = backend.stats()
        assert isinstance(after, StoreStats)
        assert after.root == str(backend.root) and after.budget is None
        assert after.entries == before.entries + len(keys) + 1
        assert after.used >= before.used + array.nbytes
        assert after.capacity > 0 and 0 <= after.free <= after.capacity

    def test_cleanup_frees_what_a_dead_writer_left(self, backend: CacheControl) -> None:
        backend.stats()  # the root exists
        dead = Layout(backend.root).tmp / DEAD_WRITER_DIR
        dead.mkdir(parents=True)
        (dead / "data.npy").write_bytes(b"x" * 4096)
        freed = backend.cleanup()
        assert isinstance(freed, int) and freed >= 4096
        assert not dead.exists()
        assert backend.cleanup() >= 0

    def test_mapped_by_lists_this_process_once_it_opens_the_entry(
        self, backend: CacheControl, sources: Path, prefix: str
    ) -> None:
        key = f"{prefix}/mapped"
        backend.put_file(key, self.npy(sources, "mapped", np.arange(1 << 12, dtype=np.int64)))
        assert os.getpid() not in backend.mapped_by(key)
        array = shmcache.Store(backend.root).open_array(key)
        assert os.getpid() in backend.mapped_by(key)
        assert int(array[-1]) == (1 << 12) - 1


class TestLocalStore(ControlContract):
    """The contract in this process: a local Store on a fresh root."""

    @pytest.fixture
    def backend(self, store: shmcache.Store) -> CacheControl:
        return store

    @pytest.fixture
    def expected_root(self, root: Path) -> Path:
        return root


class TestDaemonClient(ControlContract):
    """The contract through a real daemon (one per module), over its Unix socket."""

    @pytest.fixture
    def backend(self, daemon: Daemon) -> Iterator[CacheControl]:
        pytest.importorskip("fastapi")  # the daemon needs the service extra
        from shmcache.client import Client

        with Client(daemon.root) as client:
            yield client

    @pytest.fixture
    def expected_root(self, daemon: Daemon) -> Path:
        return daemon.root
