"""How entries are mapped (``shmcache/_disk/attach.py``): copy-on-write for every reader,
one physical copy while nobody writes, a shared read-only fallback where the kernel
refuses private mappings, and the ``"shared"`` mode that issue 20 registers with a device.

Measured from the kernel's side: ``/proc/PID/smaps`` and ``/proc/PID/maps`` of real
processes, and a real ``RLIMIT_DATA`` (which counts private writable mappings exactly as
strict overcommit charges them) to make the kernel refuse.
"""

from __future__ import annotations

import mmap
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from service_helpers import clean_env

import shmcache
from shmcache._disk.attach import SHARED, attach_array, map_entry_file, overcommit_is_strict
from shmcache._disk.layout import ARRAY_FILE, ENV_ROOT, Layout
from shmcache._disk.mapped import MappedFile, is_shared_read_only

pytestmark = pytest.mark.skipif(
    overcommit_is_strict(),
    reason="strict overcommit (vm.overcommit_memory=2): entries are mapped shared read-only",
)
MiB = 1 << 20
PAGE = mmap.PAGESIZE


def _smaps_of(pid: int, path: str) -> dict[str, int]:
    """Sizes (bytes) summed over ``pid``'s mappings of ``path``, from /proc/PID/smaps."""
    sizes: dict[str, int] = {}
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            inside = line.endswith(path)
        elif inside and len(fields) == 3 and fields[2] == "kB":
            sizes[fields[0].rstrip(":")] = sizes.get(fields[0].rstrip(":"), 0) + int(fields[1]) * 1024
    return sizes


def _perms_of(path: str, pid: int | str = "self") -> set[str]:
    """Permissions ("rw-p", "r--s"...) of ``pid``'s mappings of ``path``."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split()[1] for line in lines if line.endswith(path)}


_READER = """
import sys
import numpy as np
import shmcache

array = shmcache.open_array("big")
print(float(array.sum(dtype=np.float64)), flush=True)  # touches every page
for command in sys.stdin:
    if command.strip() == "write":  # three pages, past numpy's read-only flag
        view = array.reshape(-1).view()
        view.setflags(write=True)
        view[[0, 10 * 1024, 20 * 1024]] = -1.0  # float32: 1024 a page
    print(float(array.sum(dtype=np.float64)), flush=True)
"""


@contextmanager
def _readers(root: Path, count: int) -> Iterator[list[subprocess.Popen[str]]]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _READER],
            env=clean_env({ENV_ROOT: str(root)}),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=60)


def _ask(proc: subprocess.Popen[str], command: str) -> float:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    return float(proc.stdout.readline())


def _run_ok(script: str, root: Path) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a fresh interpreter on ``root``; it must exit 0 (not -11, a SIGSEGV)
    and print "ok"."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=clean_env({ENV_ROOT: str(root)}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"exit code {done.returncode} (-11 is SIGSEGV)\n{done.stderr[-3000:]}"
    assert done.stdout.strip() == "ok"
    return done


def test_one_physical_copy_while_nobody_writes_and_only_written_pages_become_private(
    store: shmcache.Store,
) -> None:
    assert PAGE == 4096  # the reader script writes at float32 offsets 1024 apart
    data = np.arange(8 * MiB, dtype=np.float32)  # 32 MiB
    store.put_array("big", data)
    path = str(Layout(store.root).object_file(store.info("big").version, ARRAY_FILE))
    size = Path(path).stat().st_size
    total = float(data.sum(dtype=np.float64))
    with _readers(store.root, 4) as procs:
        for proc in procs:
            assert proc.stdout is not None and float(proc.stdout.readline()) == total
        before = [_smaps_of(proc.pid, path) for proc in procs]
        for sizes, proc in zip(before, procs, strict=True):
            assert _perms_of(path, proc.pid) == {"rw-p"}  # private, copy-on-write
            assert sizes["Rss"] >= size - PAGE  # every page mapped...
            assert sizes["Anonymous"] == 0 and sizes["Private_Dirty"] == 0  # ...none copied
        assert 0.95 * size <= sum(s["Pss"] for s in before) <= 1.05 * size  # one copy for four

        writer, others = procs[0], procs[1:]
        assert _ask(writer, "write") == total - (0 + 10 * 1024 + 20 * 1024) - 3  # its own pages
        assert all(_ask(proc, "read") == total for proc in others)  # the others: the original
        written = _smaps_of(writer.pid, path)
        assert written["Anonymous"] == 3 * PAGE  # the three written pages, no more
        assert all(_smaps_of(proc.pid, path)["Anonymous"] == 0 for proc in others)
        after = sum(_smaps_of(proc.pid, path)["Pss"] for proc in procs)
        assert after <= 1.05 * size + 3 * PAGE
    assert store.verify("big")


_CONTAINER_WRITES = """
import sys, warnings
import numpy as np
import torch
import shmcache

warnings.simplefilter("ignore", UserWarning)  # torch: "the given NumPy array is not writable"
targets = {
    "table column": shmcache.open_table("table").column("n"),
    "ragged item": shmcache.open_ragged("ragged")[1],
    "ragged values": shmcache.open_ragged("ragged").values,
    "blob": shmcache.open_blobs("blobs")["b"],
    "mapping row": shmcache.open_mapping("mapping")["a"],
    "group member": shmcache.open_group("group")["x"],
    "share of a list of dicts (table) column": shmcache.share("shared", [{"v": 1}, {"v": 2}]).column("v"),
}
for name, array in targets.items():
    assert isinstance(array, np.ndarray) and not array.flags.writeable, name
    torch.from_numpy(array).fill_(7)  # past numpy's flag
    assert (array == 7).all(), name  # the writer sees its write
for key in ("strings", "records", "table", "blobs", "mapping"):  # the buffers behind str/dict values
    entry = shmcache.open(key)
    files = [f for f in open("/proc/self/maps").read().splitlines() if entry._ref.version in f]
    assert files and all(line.split()[1] == "rw-p" for line in files), (key, files)
for key in ("strings", "records"):  # even a write into the raw mapping they decode from
    entry = shmcache.open(key)
    entry._buffer[entry._start] = ord("Z")
    assert entry._buffer[entry._start] == ord("Z")
print("ok")
"""


def _container_values(store: shmcache.Store) -> list[object]:
    return [
        store.open_table("table").column("n").tolist(),
        [a.tolist() for a in store.open_ragged("ragged")],
        bytes(store.open_blobs("blobs")["b"]),
        store.open_mapping("mapping")["a"].tolist(),
        store.open_group("group")["x"].tolist(),
        list(store.open_strings("strings")),
        list(store.open_records("records")),
    ]


def test_writes_through_containers_stay_in_the_writing_process(store: shmcache.Store) -> None:
    store.put_table("table", {"n": [1, 2, 3], "s": ["a", "b", "c"]})
    store.put_ragged("ragged", [np.zeros((2, 4)), np.ones((7, 4))])
    store.put_blobs("blobs", {"a": b"first", "b": b"second blob"})
    store.put_mapping("mapping", {"a": np.arange(3.0), "b": np.ones(3)})
    store.put_array("group/x", np.arange(10))
    store.put_array("group/y", np.arange(5))
    store.put_strings("strings", ["alpha", "beta"])
    store.put_records("records", [{"label": 3}, {"tags": ["cat"]}])
    before = _container_values(store)
    _run_ok(_CONTAINER_WRITES, store.root)
    assert _container_values(store) == before
    assert store.open("shared").column("v").tolist() == [1, 2]
    for key in ("table", "ragged", "blobs", "mapping", "group/x", "strings", "records", "shared"):
        assert store.verify(key), key


_REFUSED = """
import re, resource, sys, warnings
import numpy as np
import torch
import shmcache, shmcache.torch
from shmcache._disk.mapped import is_shared_read_only

def perms(key):
    version = shmcache.get_store().info(key).version
    return {l.split()[1] for l in open("/proc/self/maps").read().splitlines() if version in l}

small = shmcache.open_array("small")  # before the limit: copy-on-write
data_now = int(re.search(r"VmData:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
resource.setrlimit(resource.RLIMIT_DATA, (data_now + 16 * 2**20, resource.RLIM_INFINITY))

first, second = shmcache.open_array("big1"), shmcache.open_array("big2")  # 24 MiB each
for array_key, array in (("big1", first), ("big2", second)):
    assert is_shared_read_only(array) and perms(array_key) == {"r--s"}, array_key
    assert not array.flags.writeable
    assert float(array[-1, -1]) == array.size - 1
    try:
        array[0, 0] = 1
        raise SystemExit("numpy wrote to a shared read-only mapping")
    except ValueError:
        pass
assert not is_shared_read_only(small) and perms("small") == {"rw-p"}
try:
    shmcache.torch.as_tensor("big1")
    raise SystemExit("as_tensor gave a tensor over a shared read-only mapping")
except shmcache.MappingRefusedError as exc:
    assert isinstance(exc, MemoryError) and "vm.overcommit_memory=2" in str(exc), exc
ds = shmcache.torch.CachedDataset("big1")
rows = 0
for b in torch.utils.data.DataLoader(ds, num_workers=0, batch_size=None):  # rows are copies
    b.sub_(0.5)
    rows += 1
assert rows == len(first) and float(first[-1, -1]) == first.size - 1
print("ok")
"""


def test_a_refused_private_mapping_falls_back_to_shared_read_only_said_once(store: shmcache.Store) -> None:
    """Strict overcommit charges a private writable mapping in full, and so does
    RLIMIT_DATA: an entry bigger than the room left is mapped shared read-only."""
    big = np.arange(6 * MiB, dtype=np.float32).reshape(96, -1)  # 24 MiB
    store.put_array("big1", big)
    store.put_array("big2", big)
    store.put_array("small", np.arange(10))
    done = _run_ok(_REFUSED, store.root)
    assert done.stderr.count("refused a private copy-on-write mapping") == 1  # said once
    assert "mapped shared read-only" in done.stderr and "'big1'" in done.stderr
    assert store.verify("big1")


_STRICT = """
import numpy as np
import shmcache
from shmcache._disk import attach, mapped

assert attach._STRICT_OVERCOMMIT is False  # this machine's policy (the test checks it first)
attach._STRICT_OVERCOMMIT = True  # what reading vm.overcommit_memory=2 sets
first, second = shmcache.open_array("a"), shmcache.open_array("b")
assert mapped.is_shared_read_only(first) and mapped.is_shared_read_only(second)
assert not first.flags.writeable and first.tolist() == [0, 1, 2]
print("ok")
"""


def test_under_strict_overcommit_entries_are_mapped_shared_said_once(store: shmcache.Store) -> None:
    """Strict overcommit would charge each copy-on-write mapping in full, again at each fork
    (every DataLoader worker): entries are mapped shared read-only there. (This machine's
    policy cannot be changed by a test: the policy read is set in the child instead.)"""
    assert overcommit_is_strict(b"2\n") and not overcommit_is_strict(b"0\n")
    assert not overcommit_is_strict(b"1")
    store.put_array("a", np.arange(3))
    store.put_array("b", np.arange(4))
    done = _run_ok(_STRICT, store.root)
    assert done.stderr.count("vm.overcommit_memory=2 (strict overcommit)") == 1
    assert "mapped shared read-only" in done.stderr


def test_the_shared_mode_maps_read_only_and_shared_for_device_registration(store: shmcache.Store) -> None:
    """Issue 20 registers pages with cudaHostRegister read-only: no page may be copied."""
    store.put_array("k", np.arange(4096, dtype=np.int64))
    version = store.info("k").version
    path = str(Layout(store.root).object_file(version, ARRAY_FILE))
    mapping = map_entry_file(str(store.root), version, ARRAY_FILE, "k", mode=SHARED)
    array = attach_array(str(store.root), version, ARRAY_FILE, "k", mode=SHARED)
    assert isinstance(mapping, MappedFile) and mapping.shared
    assert is_shared_read_only(array) and not array.flags.writeable
    assert array[-1] == 4095
    assert _perms_of(path) >= {"r--s"}
    with pytest.raises(TypeError):  # the mapping itself refuses writes too
        mapping[0] = 1
    default = attach_array(str(store.root), version, ARRAY_FILE, "k")
    assert not is_shared_read_only(default) and not default.flags.writeable
    assert "rw-p" in _perms_of(path)
    with pytest.raises(ValueError, match="unknown mapping mode"):
        attach_array(str(store.root), version, ARRAY_FILE, "k", mode="rw")  # type: ignore[arg-type]


def test_an_unpickled_array_is_read_only_on_a_copy_on_write_mapping(store: shmcache.Store) -> None:
    import pickle

    store.put_array("k", np.arange(100))
    again = pickle.loads(pickle.dumps(store.open_array("k")[10:20]))
    assert isinstance(again.base, MappedFile) and not again.base.shared
    assert not again.flags.writeable and again.tolist() == list(range(10, 20))
