"""Packed entries of one batch opened in one process share ONE mapping of each 64 MiB
window of its manifest (``_disk/mapped.SharedManifest``): a descriptor and a VMA per
window, not per key, so a process opens 100,000 small keys of a folder under ``ulimit -n 256`` and below
``vm.max_map_count``. The mapping lives while any array of it does; a file replaced at the
same path is never confused with it; eviction, replacement and damage behave as before.
Real files on the tmpfs, real subprocesses under a real descriptor limit."""

from __future__ import annotations

import gc
import os
import pickle
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from dataloader_datasets import PackedKeysDataset
from torch.utils.data import DataLoader

import shmcache
from shmcache import CorruptEntryError, KeyNotFoundError, Store
from shmcache._disk.attach import private_view
from shmcache._disk.layout import packed_range

WAIT_S = 900.0  # bound on every wait, so a broken build fails instead of hanging
LIMIT = 256
ITEMS = 224  # int32: a 1 KiB .npy (128-byte header)

pytestmark = pytest.mark.skipif(
    resource.getrlimit(resource.RLIMIT_NOFILE)[1] not in (resource.RLIM_INFINITY,)
    and resource.getrlimit(resource.RLIMIT_NOFILE)[1] < LIMIT,
    reason=f"hard descriptor limit below {LIMIT}",
)


def _folder(path: Path, count: int, fill: int = 0) -> Path:
    """``count`` 1 KiB ``.npy`` files; file ``f<i>`` holds ``ITEMS`` int32 ``i + fill``."""
    path.mkdir(parents=True)
    header = _npy_header()
    for i in range(count):
        (path / f"f{i}.npy").write_bytes(header + np.full(ITEMS, i + fill, np.int32).tobytes())
    return path


def _npy_header() -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, np.zeros(ITEMS, np.int32))
    return buffer.getvalue()[: -4 * ITEMS]


def _manifest_maps(root: Path) -> list[str]:
    """This process's /proc/self/maps lines of manifests under ``root``."""
    objects = os.path.realpath(root / "objects") + "/"
    with open("/proc/self/maps") as maps:
        return [line for line in maps if objects in line and "/manifest" in line]


def _manifest_fds(root: Path) -> int:
    """This process's descriptors open on manifests under ``root``."""
    objects = os.path.realpath(root / "objects") + "/"
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        count += target.startswith(objects) and "/manifest" in target
    return count


OPEN_ALL = textwrap.dedent(
    """
    import os, resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[3]), int(sys.argv[3])))
    import shmcache
    root, count = sys.argv[1], int(sys.argv[2])
    arrays = [shmcache.open_array(f"d/f{i}", root=root) for i in range(count)]
    wrong = [i for i, a in enumerate(arrays) if a.shape != (224,) or (a != i).any()]
    objects = os.path.realpath(os.path.join(root, "objects"))
    with open("/proc/self/maps") as maps:
        mapped = sum(1 for line in maps if objects in line)
    print(len(arrays), len(wrong), mapped, len(os.listdir("/proc/self/fd")), flush=True)
    """
)


@pytest.mark.parametrize("count", [3000, pytest.param(100_000, marks=pytest.mark.slow)])
def test_every_packed_key_of_a_put_opens_under_a_low_descriptor_limit(
    root: Path, tmp_path: Path, count: int
) -> None:
    """Before: one mapping (and on Python < 3.13 one descriptor) per key, so
    TooManyOpenFilesError after ~250 keys under ``ulimit -n 256``."""
    Store(root).put_file("d", _folder(tmp_path / "src", count))
    proc = subprocess.run(
        [sys.executable, "-c", OPEN_ALL, str(root), str(count), str(LIMIT)],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    opened, wrong, mapped, fds = (int(x) for x in proc.stdout.split())
    assert (opened, wrong) == (count, 0)
    assert mapped == (1 if count << 10 < 64 << 20 else 2)  # one VMA per 64 MiB window
    assert fds < LIMIT


def test_views_of_one_batch_share_one_mapping_that_goes_with_the_last(root: Path, tmp_path: Path) -> None:
    Store(root).put_file("d", _folder(tmp_path / "src", 50))
    store = Store(root)  # a reader of its own: dropping the store drops its cached arrays
    before = _manifest_fds(root)
    arrays = [store.open_array(f"d/f{i}") for i in range(50)]
    assert all(int(a[0]) == i for i, a in enumerate(arrays))
    assert len(_manifest_maps(root)) == 1
    # one for the header/live ``pread``s; Python < 3.13: and the mapping's own
    assert _manifest_fds(root) - before <= (1 if sys.version_info >= (3, 13) else 2)
    view = arrays[7][3:9]
    del arrays, store
    gc.collect()
    assert len(_manifest_maps(root)) == 1 and list(view) == [7] * 6  # a view keeps it
    del view
    gc.collect()
    assert _manifest_maps(root) == [] and _manifest_fds(root) == before


def test_evict_replace_and_batch_removal_leave_live_views_reading(
    store: Store, root: Path, tmp_path: Path
) -> None:
    store.put_file("d", _folder(tmp_path / "a", 6))
    reader = Store(root)
    held = [reader.open_array(f"d/f{i}") for i in range(3)]
    store.evict("d/f1")
    with pytest.raises(KeyNotFoundError):
        reader.open_array("d/f1")
    with pytest.raises(KeyNotFoundError):  # a new mapping of an evicted packed entry is refused
        pickle.loads(pickle.dumps(held[1]))
    with pytest.raises(KeyNotFoundError):
        private_view(held[1])
    assert int(pickle.loads(pickle.dumps(held[2][5:]))[0]) == 2  # a live one unpickles
    store.put_file("d", _folder(tmp_path / "b", 6, fill=100), overwrite=True)  # the old batch goes
    assert [int(reader.open_array(f"d/f{i}")[0]) for i in range(6)] == [100 + i for i in range(6)]
    assert [int(a[-1]) for a in held] == [0, 1, 2]  # the old bytes, from the unlinked manifest
    assert len(_manifest_maps(root)) == 2 and any(
        m.rstrip().endswith("(deleted)") for m in _manifest_maps(root)
    )
    del held, reader  # the arrays, and the reader's cached ones
    gc.collect()
    assert not any(m.rstrip().endswith("(deleted)") for m in _manifest_maps(root))


def test_a_manifest_replaced_at_the_same_path_is_never_mistaken_for_the_mapped_one(
    store: Store, root: Path, tmp_path: Path
) -> None:
    """The shared mapping is reused only for the file it was made from (``(device, inode)``,
    which no other file can have while the mapping holds the inode): a new file at the same
    path (a batch removed and one of the same name made, a root restored from a copy) gets
    a mapping of its own."""
    store.put_file("d", _folder(tmp_path / "a", 4))
    reader = Store(root)
    first = reader.open_array("d/f0")
    version = store.info("d/f2").version
    batch, _, offset, length = packed_range(version) or ("", 0, 0, 0)
    path = root / "objects" / batch / "manifest"
    data = bytearray(path.read_bytes())
    data[offset + 128 : offset + length] = np.full(ITEMS, 77, np.int32).tobytes()
    (root / "objects" / batch / "manifest.new").write_bytes(data)
    os.replace(root / "objects" / batch / "manifest.new", path)
    assert int(reader.open_array("d/f2")[0]) == 77  # the file now at the path, not the cached one
    assert int(first[0]) == 0 and len(_manifest_maps(root)) == 2


DAMAGED_OPEN = textwrap.dedent(
    """
    import os, sys, shmcache
    from shmcache import CorruptEntryError
    root, path, cut = sys.argv[1], sys.argv[2], int(sys.argv[3])
    first = shmcache.open_array("d/f0", root=root)  # the manifest mapped whole, before the damage
    os.truncate(path, cut)
    try:
        shmcache.open_array("d/f150", root=root)
    except CorruptEntryError as exc:
        print("typed", exc, flush=True)
    """
)


def test_a_manifest_truncated_after_it_was_mapped_is_a_typed_error_not_sigbus(
    store: Store, root: Path, tmp_path: Path
) -> None:
    store.put_file("d", _folder(tmp_path / "src", 200))
    packed = packed_range(store.info("d/f150").version)
    assert packed is not None
    path = root / "objects" / packed[0] / "manifest"
    proc = subprocess.run(
        [sys.executable, "-c", DAMAGED_OPEN, str(root), str(path), str(packed[2] + 16)],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("typed"), (proc.returncode, proc.stderr[-2000:])
    assert "truncated or damaged" in proc.stdout


def test_a_header_promising_more_than_its_packed_bytes_is_corrupt(
    store: Store, root: Path, tmp_path: Path
) -> None:
    """A window of the manifest is mapped: an entry whose header promises more than its range
    must not read its neighbours' bytes."""
    store.put_file("d", _folder(tmp_path / "src", 4))
    packed = packed_range(store.info("d/f1").version)
    assert packed is not None
    path = root / "objects" / packed[0] / "manifest"
    data = bytearray(path.read_bytes())
    header = bytes(data[packed[2] : packed[2] + 128])
    grown = header.replace(b"(224,)", b"(448,)")
    assert grown != header and len(grown) == len(header)
    data[packed[2] : packed[2] + 128] = grown
    with open(path, "r+b") as fp:  # in place: the same file
        fp.write(data)
    with pytest.raises(CorruptEntryError, match="truncated"):
        Store(root).open_array("d/f1")


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_dataloader_workers_open_many_packed_keys_over_one_mapping(
    store: Store, root: Path, tmp_path: Path, method: str
) -> None:
    count = 600
    store.put_file("d", _folder(tmp_path / "src", count))
    assert int(shmcache.open_array("d/f3", root=str(root))[0]) == 3  # mapped before fork: inherited
    dataset = PackedKeysDataset(str(root), "d", count)
    loader = DataLoader(
        dataset, batch_size=50, num_workers=2, multiprocessing_context=method, timeout=120, shuffle=True
    )
    values, manifests, pids = (torch.cat(parts) for parts in zip(*loader, strict=True))
    assert sorted(values.tolist()) == list(range(count))
    assert set(pids.tolist()) != {os.getpid()} and len(set(pids.tolist())) == 2
    assert manifests.max().item() == 1  # each worker: one mapping of the manifest, for 300 keys


def test_a_cold_open_through_the_shared_mapping_still_marks_the_batch_used(
    store: Store, root: Path, tmp_path: Path
) -> None:
    """The LRU touch stays: a cold open of another key of a mapped batch (no open, no
    mmap) still sets the manifest's use time, at most once a second per batch."""
    store.put_file("d", _folder(tmp_path / "src", 3))
    reader = Store(root)
    reader.open_array("d/f0")
    packed = packed_range(store.info("d/f1").version)
    assert packed is not None
    path = root / "objects" / packed[0] / "manifest"
    os.utime(path, (1_000_000, 1_000_000))  # an hour-old use, as LRU eviction reads it
    assert int(reader.open_array("d/f1")[0]) == 1
    assert os.stat(path).st_atime > 1_000_000 + 3600


def test_a_packed_view_held_for_a_device_is_over_a_mapping_of_its_own(
    store: Store, root: Path, tmp_path: Path
) -> None:
    """``pin``'s bookkeeping (``_cuda.hold``; mapped, not registered, on a CPU) of a view of
    a packed entry: the view's origin is found by its offset in the shared mapping, and
    the held array is the same bytes over a mapping of its own (the entry's range)."""
    from shmcache import _cuda

    store.put_file("d", _folder(tmp_path / "src", 8))
    array = Store(root).open_array("d/f5")
    view = array[10:20]
    with _cuda.hold(view, str(root), torch.device("cpu"), register=False) as held:
        assert held.key == "d/f5" and held.version == store.info("d/f5").version
        assert list(held.array) == [5] * 10
        assert held.array.base is not array.base and not held.array.flags.writeable


def _put_page_aligned(store: Store, tmp_path: Path) -> np.ndarray:
    """``d/b`` packed at manifest offset 4096 (a page boundary), after a 4,032-byte ``d/a``."""
    src = tmp_path / "aligned"
    src.mkdir()
    np.save(src / "a.npy", np.zeros(976, np.float32))
    np.save(src / "b.npy", np.arange(15000, dtype=np.float32))
    store.put_file("d", src)
    assert store.info("d/b").version.endswith(".4096.60128")
    return Store(store.root).open_array("d/b")


def test_private_views_of_an_entry_packed_at_a_page_boundary_are_its_bytes(
    store: Store, tmp_path: Path
) -> None:
    """``private_view`` (``as_tensor``) rebases the offset from the whole manifest to its
    own mapping even where the entry starts on a page (no shift): it once read 4 KiB on."""
    from shmcache.torch import as_tensor

    b = _put_page_aligned(store, tmp_path)
    for part in (b[:4], b[100:104], b[-3:], b[::5000], b):
        mine = private_view(part)
        assert np.array_equal(mine, part) and mine.flags.writeable
        assert torch.equal(as_tensor(part), torch.from_numpy(np.array(part)))
    mine = private_view(b[:4])
    mine[0] = -1.0
    assert b[0] == 0.0 and store.open_array("d/b")[0] == 0.0  # a write stays in the view


TRUNCATE_READER = textwrap.dedent(
    """
    import pickle, sys
    import shmcache
    from shmcache import ShmCacheError
    root, rounds = sys.argv[1], int(sys.argv[2])
    keep = shmcache.Store(root).open_array("d/f0")  # the manifest mapped
    blob = pickle.dumps(keep[1:])
    print("ready", flush=True)
    done = failed = 0
    for _ in range(rounds):
        st = shmcache.Store(root)  # cold opens every round
        for i in range(1, 200):
            try:
                st.open_array(f"d/f{i}")
                done += 1
            except (ShmCacheError, OSError):
                failed += 1
        try:
            pickle.loads(blob)
        except (ShmCacheError, OSError):
            failed += 1
    print("finished", done, failed, flush=True)
    """
)


def test_a_manifest_truncated_under_cold_opens_never_kills_the_reader(
    store: Store, root: Path, tmp_path: Path
) -> None:
    """A broken or hostile writer truncates a mapped manifest and writes it back, over and
    over, while a reader cold-opens its keys and unpickles a view: the open path reads
    header and live byte with ``pread`` (a short read is a typed error), never through the
    mapping (SIGBUS once the file shrank under it)."""
    store.put_file("d", _folder(tmp_path / "src", 200))
    packed = packed_range(store.info("d/f150").version)
    assert packed is not None
    path = root / "objects" / packed[0] / "manifest"
    data = path.read_bytes()
    proc = subprocess.Popen(
        [sys.executable, "-c", TRUNCATE_READER, str(root), "60"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        fd = os.open(path, os.O_RDWR)
        try:
            while proc.poll() is None:
                os.ftruncate(fd, 64)
                os.pwrite(fd, data, 0)
        finally:
            os.close(fd)
        out = proc.communicate(timeout=WAIT_S)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0 and out.startswith("finished"), (proc.returncode, out)


LIMITED_OPEN = textwrap.dedent(
    """
    import resource, sys
    import numpy as np, shmcache
    from shmcache._disk.mapped import is_shared_read_only
    root, which = sys.argv[1], sys.argv[2]
    shmcache.open_array("warm", root=root)  # imports and the root's tables: mapped already
    with open("/proc/self/status") as f:
        st = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f if l.startswith(("VmSize", "VmData"))}
    res = resource.RLIMIT_AS if which == "AS" else resource.RLIMIT_DATA
    room = (st["VmSize"] if which == "AS" else st["VmData"]) + (24 << 20)  # below the manifest
    resource.setrlimit(res, (room, resource.getrlimit(res)[1]))
    arrays = [shmcache.open_array(f"d/f{i}", root=root) for i in (7, 8, 900)]
    print([int(a[0]) for a in arrays], [is_shared_read_only(a) for a in arrays], flush=True)
    import pickle
    print(pickle.loads(pickle.dumps(arrays[0][3:6])).tolist(), flush=True)
    """
)


@pytest.mark.parametrize("which", ["AS", "DATA"])
def test_a_packed_key_opens_copy_on_write_without_room_for_its_whole_manifest(
    store: Store, root: Path, tmp_path: Path, which: str
) -> None:
    """Under ``ulimit -v`` (RLIMIT_AS) or ``ulimit -d`` (RLIMIT_DATA) with less room than
    the batch's manifest (~60 MB here), a small key still opens, copy-on-write: its own
    range is mapped instead of its window (once a raw ENOMEM, or shared read-only)."""
    src = tmp_path / "big-src"
    src.mkdir()
    for i in range(1000):
        np.save(src / f"f{i}.npy", np.full(7600, i, np.int64))  # 60,928 bytes: packed
    store.put_file("d", src)
    store.put_array("warm", np.zeros(3))
    proc = subprocess.run(
        [sys.executable, "-c", LIMITED_OPEN, str(root), which],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "[7, 8, 900] [False, False, False]"
    assert lines[1] == "[7, 7, 7]"


def test_the_sweep_rereads_warm_keys_whose_link_moved_without_a_bump(store: Store, root: Path) -> None:
    """A writer killed between its link swap and its generation bump leaves the key's slot
    unchanged: the once-a-second sweep readlinks a round-robin slice of the warm keys
    anyway, so a long-running reader corrects itself."""
    import time

    store.put_array("k", np.zeros(3, np.int64))
    store.put_array("other", np.ones(3, np.int64))
    store.put_array("poke", np.arange(2))
    assert store.open_array("k").tolist() == [0, 0, 0]  # warm
    link = root / "entries" / "k"
    os.symlink(os.readlink(root / "entries" / "other"), str(link) + ".new")
    os.replace(str(link) + ".new", link)  # the swap, and no bump (the writer died here)
    time.sleep(1.2)  # past the sweep's interval
    store.open_array("poke")  # a cold open: the sweep runs
    assert store.open_array("k").tolist() == [1, 1, 1]


def test_pins_of_packed_keys_map_their_own_range_not_the_manifest(store: Store, tmp_path: Path) -> None:
    """``pin``'s bookkeeping (``_cuda.hold``) maps each entry's range, as it did before the
    shared mapping, with views rebased through the file (the page-aligned entry too)."""
    from shmcache import _cuda
    from shmcache._disk.mapped import mapped_base

    b = _put_page_aligned(store, tmp_path)
    store.put_file("e", _folder(tmp_path / "src", 40))
    for part in (b, b[:4], b[7:11]):
        with _cuda.hold(part, str(store.root), torch.device("cpu"), register=False) as held:
            assert np.array_equal(held.array, part)
    arrays = [Store(store.root).open_array(f"e/f{i}") for i in range(40)]
    manifest = len(mapped_base(arrays[0]))
    held = [_cuda.hold(a[5:], str(store.root), torch.device("cpu"), register=False) for a in arrays]
    try:
        assert all(list(h.array) == [i] * (ITEMS - 5) for i, h in enumerate(held))
        assert all(len(mapped_base(h.array)) < 2 * 4096 < manifest for h in held)
    finally:
        for h in held:
            h.release()


def test_as_tensor_pin_and_private_view_of_empty_arrays(store: Store, tmp_path: Path) -> None:
    """An empty entry's array (of its own or packed) and an empty slice still live in the
    cache: ``as_tensor``/``private_view``/``pin`` take them; pickling sends them by value."""
    from shmcache import _cuda
    from shmcache.torch import as_tensor

    store.put_array("e", np.zeros(0, np.float32))
    src = tmp_path / "with-empty"
    src.mkdir()
    np.save(src / "empty.npy", np.zeros((0, 3), np.int16))
    np.save(src / "full.npy", np.arange(5))
    store.put_file("d", src)
    reader = Store(store.root)
    for array in (reader.open_array("e"), reader.open_array("d/empty"), reader.open_array("d/full")[5:]):
        assert as_tensor(array).shape == array.shape
        mine = private_view(array)
        assert mine.shape == array.shape and mine.flags.writeable
        with _cuda.hold(array, str(store.root), torch.device("cpu"), register=False) as held:
            assert held.array.shape == array.shape
        assert pickle.loads(pickle.dumps(array)).shape == array.shape


def test_a_big_manifest_is_mapped_in_64_mib_windows(store: Store, root: Path, tmp_path: Path) -> None:
    """A key of a big manifest maps its 64 MiB window (and the longest entry past it), not
    the whole file: an entry across a window's end is whole in its window; views of keys
    of either window pickle, ``private_view`` and pin by their offsets in the file."""
    from shmcache import _cuda
    from shmcache._disk.mapped import mapped_base

    src = tmp_path / "big-src"
    src.mkdir()
    for i in range(1150):  # 60,928 bytes each: a ~70 MB manifest
        np.save(src / f"f{i}.npy", np.full(7600, i, np.int64))
    store.put_file("d", src)
    spans = {i: packed_range(store.info(f"d/f{i}").version) for i in range(1150)}
    across = [i for i, p in spans.items() if p and p[2] < 64 << 20 < p[2] + p[3]]
    later = [i for i, p in spans.items() if p and p[2] > 64 << 20]
    assert len(across) == 1 and later
    reader = Store(root)
    for i in (0, across[0], later[0], later[-1]):
        array = reader.open_array(f"d/f{i}")
        assert array.shape == (7600,) and (array == i).all()
        assert len(mapped_base(array)) <= (64 << 20) + (64 << 10) + 4096
        view = array[100:104]
        assert pickle.loads(pickle.dumps(view)).tolist() == [i] * 4
        assert private_view(view).tolist() == [i] * 4
        with _cuda.hold(view, str(root), torch.device("cpu"), register=False) as held:
            assert held.array.tolist() == [i] * 4
    del held, view, array  # the last pin's own range mapping
    gc.collect()
    assert len(_manifest_maps(root)) == 2  # the two windows (the reader keeps its arrays)


NO_ADDRESS_SPACE = textwrap.dedent(
    """
    import resource, sys
    import shmcache
    root = sys.argv[1]
    shmcache.open_array("warm", root=root)  # imports and the root's tables: mapped already
    with open("/proc/self/status") as f:
        size = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (size + (24 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
    try:
        shmcache.open_array("big", root=root)
    except shmcache.MappingRefusedError as exc:
        print("refused:", exc, flush=True)
    """
)


def test_an_entry_of_its_own_with_no_address_space_left_is_a_typed_refusal(store: Store, root: Path) -> None:
    """Under ``ulimit -v`` with less room than an entry of its own (not packed), both the
    copy-on-write mapping and the shared read-only fallback are refused with ENOMEM: the
    open is a :class:`MappingRefusedError` naming the limit (once a raw ``OSError``)."""
    store.put_array("big", np.zeros(64 << 20, np.uint8))
    store.put_array("warm", np.zeros(3))
    proc = subprocess.run(
        [sys.executable, "-c", NO_ADDRESS_SPACE, str(root)], capture_output=True, text=True, timeout=WAIT_S
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("refused:"), proc.stdout
    assert "'big'" in proc.stdout and "ulimit -v" in proc.stdout
