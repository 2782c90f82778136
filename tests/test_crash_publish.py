"""A directory put killed by ``kill -9`` at any instant (issue 18, item 7) leaves every
reader the whole old directory or the whole new one: single-key opens of every key,
``open_group`` and ``list``, before and after ``cleanup()``. Real writer processes, real
``SIGKILL``, a real root on the tmpfs; old (flat) roots stay readable and are migrated."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from shmcache import CacheRootError, CorruptEntryError, KeyNotFoundError, Store
from shmcache._disk import entry_tree, manifest
from shmcache._disk.entry_tree import CRASH_ENV
from shmcache._disk.layout import Layout
from shmcache._disk.writer import STAGING_SUFFIX, VersionWriter
from shmcache._store.maintenance import _STAGING_GRACE_S
from shmcache._store.writing import publish, version_meta

FILES = 300
KILLS = 36
WAIT_S = 120.0  # bound on every wait, so a broken build fails instead of hanging

_WRITER = """
import sys, time
import shmcache
store = shmcache.Store(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
start = time.monotonic()
store.put_file("d", sys.argv[2], overwrite=True)
print(time.monotonic() - start, flush=True)
"""


def _write_sources(directory: Path, value: int, files: int = FILES) -> Path:
    """``files`` small arrays whose every value is ``value``, in ``gen<value>``."""
    directory = directory / f"gen{value}"
    directory.mkdir(parents=True)
    for i in range(files):
        np.save(directory / f"f{i:04d}.npy", np.full(8, value, dtype=np.int64))
    return directory


def _start_writer(root: Path, source: Path, crash_at: str | None = None) -> subprocess.Popen[str]:
    env = {name: value for name, value in os.environ.items() if name != CRASH_ENV}
    if crash_at:
        env[CRASH_ENV] = crash_at
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(root), str(source)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


def _put_and_time(root: Path, source: Path) -> float:
    """Seconds a whole put takes in a writer process (from its start signal)."""
    proc = _start_writer(root, source)
    _go(proc)
    out, _ = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0
    return float(out.strip())


def _whole_value(root: Path, allowed: set[int]) -> int:
    """The one value every reader sees for ``d`` (it must be one of ``allowed``): a fresh
    store opens every key alone, the group, and the listing."""
    store = Store(root)
    singles = {int(store.open_array(f"d/f{i:04d}")[0]) for i in range(FILES)}
    assert len(singles) == 1, f"single-key opens saw a mixed directory: values {sorted(singles)}"
    value = singles.pop()
    assert value in allowed
    group = store.open_group("d")
    assert len(group) == FILES and {int(group[name][0]) for name in group} == {value}
    infos = store.list("d")
    assert len(infos) == FILES
    assert {Path(str(info.source)).parent.name for info in infos} == {f"gen{value}"}
    return value


def _stored_versions(root: Path) -> set[str]:
    """Every version ``objects/`` holds: a directory put's entries ``<batch>/<n>`` (issue
    22: one version directory and one manifest per directory put), other versions by name."""
    found = set()
    for name in os.listdir(root / "objects"):
        inside = os.listdir(root / "objects" / name)
        if "manifest" in inside:
            found |= {f"{name}/{entry}" for entry in inside if entry not in ("manifest", "packed")}
            found |= {f"{name}/{n}" for n in manifest.live_entries(str(root), name) or ()}  # packed
        else:
            found.add(name)
    return found


def _entry_of(version: str) -> str:
    """``<batch>/<n>`` of a packed entry's version (``<batch>/<n>.<offset>.<length>``)."""
    batch, slash, rest = version.partition("/")
    return f"{batch}/{rest.partition('.')[0]}" if slash else version


def _assert_no_orphan(root: Path, count: int) -> None:
    """``objects/`` holds exactly the versions the links point at, ``count`` of them."""
    linked = {_entry_of(info.version) for info in Store(root).list()}
    assert _stored_versions(root) == linked and len(linked) == count


def _check_whole_then_clean(root: Path, allowed: set[int]) -> int:
    before = _whole_value(root, allowed)
    Store(root).cleanup()
    staged = [name for name in os.listdir(root / "tmp") if name.endswith(STAGING_SUFFIX)]
    if staged:  # killed between creating its lock file and locking it: gone after the grace
        for name in staged:
            aged = time.time() - _STAGING_GRACE_S - 1
            os.utime(root / "tmp" / name, (aged, aged))
        Store(root).cleanup()
    after = _whole_value(root, allowed)
    assert after == before, "cleanup changed what readers see"
    assert os.listdir(root / "tmp") == []  # nothing of the dead writer is left
    _assert_no_orphan(root, FILES)  # nor an unreferenced version
    assert len(os.listdir(root / "objects")) == 1  # the one batch version of the directory
    return after


def test_a_directory_put_killed_anywhere_is_seen_all_old_or_all_new(root: Path, tmp_path: Path) -> None:
    Store(root).put_file("d", _write_sources(tmp_path, 0))
    elapsed = _put_and_time(root, _write_sources(tmp_path, 1))
    current = _check_whole_then_clean(root, {1})
    rng = random.Random(18)
    outcomes = {"old": 0, "new": 0}
    last_old, first_new = 0.0, elapsed * 1.05  # the latest kill seen old, the earliest seen new
    for kill in range(KILLS):
        value = kill + 2
        source = _write_sources(tmp_path, value)
        proc = _start_writer(root, source)
        if kill < KILLS // 2:  # spread over the whole put
            delay = elapsed * 1.05 * (kill + rng.random()) / (KILLS // 2)
        else:  # then closing in on the instant it publishes (the outcomes bisect it)
            if last_old >= first_new:  # timing noise: widen again
                last_old, first_new = first_new * 0.95, last_old * 1.05
            delay = last_old + (first_new - last_old) * rng.random()
        _go(proc)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=WAIT_S)
        seen = _check_whole_then_clean(root, {current, value})
        last_old, first_new = _landed(outcomes, seen == value, delay, last_old, first_new)
        current = seen
    assert outcomes["old"] and outcomes["new"], outcomes  # the kills did land on both sides



def _landed(
    outcomes: dict[str, int], new: bool, delay: float, last_old: float, first_new: float
) -> tuple[float, float]:
    """Count on which side a kill after ``delay`` landed, and narrow the window the next
    kills aim at: the new ``(last_old, first_new)``."""
    if new:
        outcomes["new"] += 1
        return last_old, min(first_new, delay)
    outcomes["old"] += 1
    return max(last_old, delay), first_new

@pytest.mark.parametrize(
    ("step", "expected"),
    [
        ("batch-written", "old"),  # its entries and manifest written in tmp/
        ("batch-promoted", "old"),  # its batch renamed into objects/, no link to it yet
        ("tree-first-link", "old"),
        ("tree-before-exchange", "old"),
        ("tree-after-exchange", "new"),
    ],
)
def test_a_writer_killed_inside_the_swap_leaves_a_whole_directory(
    root: Path, tmp_path: Path, step: str, expected: str
) -> None:
    Store(root).put_file("d", _write_sources(tmp_path, 0))
    proc = _start_writer(root, _write_sources(tmp_path, 1), crash_at=step)
    _go(proc)
    proc.communicate(timeout=WAIT_S)
    assert proc.returncode == -signal.SIGKILL  # it died at that step
    assert _check_whole_then_clean(root, {0, 1}) == (0 if expected == "old" else 1)


def test_a_warm_reader_does_not_mix_when_the_writer_dies_before_bumping(root: Path, tmp_path: Path) -> None:
    """The writer dies between the exchange and the generation bump: a process that had
    half the keys warm must not keep those old while it opens the others new."""
    store = Store(root)
    store.put_file("d", _write_sources(tmp_path, 0))
    warm = [store.open_array(f"d/f{i:04d}") for i in range(0, FILES, 2)]
    assert {int(a[0]) for a in warm} == {0}
    proc = _start_writer(root, _write_sources(tmp_path, 1), crash_at="tree-after-exchange")
    _go(proc)
    proc.communicate(timeout=WAIT_S)
    assert proc.returncode == -signal.SIGKILL
    assert {int(store.open_array(f"d/f{i:04d}")[0]) for i in range(FILES)} == {1}
    store.cleanup()
    assert {int(store.open_array(f"d/f{i:04d}")[0]) for i in range(FILES)} == {1}


def _put_extras(root: Path, count: int) -> subprocess.Popen[str]:
    """A process that puts ``count`` keys one by one under ``d/extra``."""
    code = (
        "import numpy as np, shmcache\n"
        f"store = shmcache.Store({str(root)!r})\n"
        f"for i in range({count}):\n"
        "    store.put_array(f'd/extra/e{i:03d}', np.full(4, i))\n"
    )
    return subprocess.Popen([sys.executable, "-c", code], text=True)


def test_single_key_puts_under_the_prefix_during_directory_puts_are_kept(root: Path, tmp_path: Path) -> None:
    """A directory put copies its prefix; single-key puts into it meanwhile are not lost,
    and a directory put does not delete keys of the prefix that it does not hold."""
    store = Store(root)
    sources = [_write_sources(tmp_path, value) for value in range(6)]
    store.put_file("d", sources[0])
    extras = _put_extras(root, 200)
    for source in sources[1:]:
        store.put_file("d", source, overwrite=True)
    assert extras.wait(WAIT_S) == 0
    keys = {info.key for info in store.list("d")}
    assert {f"d/extra/e{i:03d}" for i in range(200)} <= keys
    assert len(keys) == FILES + 200
    assert {int(store.open_array(f"d/f{i:04d}")[0]) for i in range(FILES)} == {5}
    assert int(store.open_array("d/extra/e123")[0]) == 123


def test_evicting_one_key_of_a_group(store: Store, tmp_path: Path) -> None:
    store.put_file("d", _write_sources(tmp_path, 0, files=5))
    store.evict("d/f0001")
    with pytest.raises(KeyNotFoundError):
        store.open_array("d/f0001")
    assert sorted(store.open_group("d")) == ["f0000", "f0002", "f0003", "f0004"]
    assert [e.key for e in store.list("d")] == ["d/f0000", "d/f0002", "d/f0003", "d/f0004"]
    store.put_file("d", _write_sources(tmp_path, 1, files=5), overwrite=True)
    assert len(store.open_group("d")) == 5 and int(store.open_array("d/f0001")[0]) == 1


def test_keys_and_groups_of_the_same_name_coexist(store: Store) -> None:
    store.put_array("feats", np.arange(3))
    store.put_array("feats/x", np.arange(4))
    assert len(store.open_array("feats")) == 3 and len(store.open_array("feats/x")) == 4
    assert list(store.open_group("feats")) == ["x"]
    store.evict("feats")
    assert [e.key for e in store.list()] == ["feats/x"]


def _flatten(root: Path) -> None:
    """Turn a root into the format before the tree (flat links ``entries/a~b``)."""
    entries = root / "entries"

    def move(directory: Path, prefix: str) -> None:
        for path in list(directory.iterdir()):
            if path.is_symlink():
                if directory != entries:
                    version = os.readlink(path).partition("/objects/")[2]
                    os.symlink(f"../objects/{version}", entries / f"{prefix}{path.name}")
                    path.unlink()
            else:
                move(path, f"{prefix}{path.name}")
                path.rmdir()

    move(entries, "")
    (root / "format").unlink()


def _put_one_version_per_entry(store: Store, source: Path) -> None:
    """A directory put as shmcache before issue 22 stored it: a version per entry."""
    for path in sorted(source.iterdir()):
        store.put_file(f"d/{path.stem}", path)


def _old_root(root: Path, tmp_path: Path) -> None:
    store = Store(root)
    _put_one_version_per_entry(store, _write_sources(tmp_path, 0, files=5))
    store.put_array("top", np.arange(2))
    store.put_array("a/b/c", np.arange(3))
    _flatten(root)
    assert sorted(os.listdir(root / "entries")) == ["a~b~c", *(f"d~f{i:04d}" for i in range(5)), "top"]


def _assert_old_root_content(root: Path) -> None:
    store = Store(root)
    assert [int(store.open_array(f"d/f{i:04d}")[0]) for i in range(5)] == [0] * 5
    assert len(store.open_array("a/b/c")) == 3 and len(store.open_array("top")) == 2
    assert sorted(store.open_group("d")) == [f"f{i:04d}" for i in range(5)]
    assert [e.key for e in store.list()] == ["a/b/c", *(f"d/f{i:04d}" for i in range(5)), "top"]
    assert store.exists("a/b/c") and store.info("d/f0003").key == "d/f0003"


def test_an_old_flat_root_is_readable_as_it_is(root: Path, tmp_path: Path) -> None:
    _old_root(root, tmp_path)
    _assert_old_root_content(root)
    assert not (root / "format").exists()  # reading changed nothing


def test_cleanup_migrates_an_old_flat_root(root: Path, tmp_path: Path) -> None:
    _old_root(root, tmp_path)
    Store(root).cleanup()
    assert sorted(os.listdir(root / "entries")) == ["a~", "d~", "top"]
    assert (root / "format").read_text().strip() == "2"
    _assert_old_root_content(root)
    assert os.readlink(root / "entries" / "a~" / "b~" / "c").startswith("../../../objects/")
    assert (root / "entries" / "a~" / "b~" / "c" / "data.npy").is_file()  # the link resolves


def test_the_first_writer_migrates_an_old_flat_root(root: Path, tmp_path: Path) -> None:
    _old_root(root, tmp_path)
    source = _write_sources(tmp_path, 1, files=5)
    code = f"import shmcache; shmcache.Store({str(root)!r}).put_file('d', {str(source)!r}, overwrite=True)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=WAIT_S)  # a process new to the root
    store = Store(root)
    assert sorted(os.listdir(root / "entries")) == ["a~", "d~", "top"]
    assert [int(store.open_array(f"d/f{i:04d}")[0]) for i in range(5)] == [1] * 5
    assert len(store.open_array("a/b/c")) == 3
    store.evict("a/b/c")
    with pytest.raises(KeyNotFoundError):
        store.open_array("a/b/c")  # no flat link left behind to come back


def test_cleanup_removes_empty_prefixes(store: Store, root: Path) -> None:
    store.put_array("x/y/z", np.arange(2))
    store.evict("x/y/z")
    assert os.listdir(root / "entries") == ["x~"]
    store.cleanup()
    assert os.listdir(root / "entries") == []


@pytest.mark.parametrize(("step", "expected"), [("tree-before-exchange", 0), ("tree-after-exchange", 1)])
def test_a_daemon_killed_inside_a_directory_load_leaves_a_whole_directory(
    root: Path, tmp_path: Path, step: str, expected: int
) -> None:
    """Through the daemon's load: the daemon dies by SIGKILL at that step of publishing a
    directory; readers see one whole directory, before and after the next daemon's start
    (which cleans up)."""
    from service_helpers import Daemon, wait_for

    Store(root).put_file("d", _write_sources(tmp_path, 0))
    source = _write_sources(tmp_path, 1)
    daemon = Daemon(root, "--allow-source", str(tmp_path), env={CRASH_ENV: step}).wait_ready()
    try:
        with daemon.client() as client:
            response = client.put("/v1/entries/d", json={"source": str(source), "overwrite": True})
            assert response.status_code == 202, response.text
        assert daemon.wait_exit(WAIT_S) == -signal.SIGKILL
    finally:
        daemon.stop()
    assert _whole_value(root, {0, 1}) == expected
    restarted = Daemon(root).wait_ready()  # its start cleans up after the dead one
    try:
        wait_for(lambda: os.listdir(root / "tmp") == [], timeout=WAIT_S, what="the start's cleanup")
        assert _whole_value(root, {0, 1}) == expected
        _assert_no_orphan(root, FILES)
    finally:
        restarted.stop()


def _write_version(writer: VersionWriter, key: str, array: np.ndarray) -> str:
    """A finished (unpublished) version of ``key`` holding ``array``."""
    version = writer.new_version()
    crc, header = writer.write_array(version, "data.npy", array)
    writer.write_meta(version, version_meta(key, "array", version, {"data": header}, {"data": crc}, False))
    return version


def _old_root_left_half_published(root: Path, tmp_path: Path) -> None:
    """What shmcache before the tree left when killed halfway through swapping the links of
    a directory one by one: 2 of 4 keys new, the others old, the rest staged in ``tmp/``."""

    _put_one_version_per_entry(Store(root), _write_sources(tmp_path, 0, files=4))
    _flatten(root)
    layout = Layout(root)
    writer = VersionWriter(layout)
    for i in range(4):
        key = f"d/f{i:04d}"
        version = _write_version(writer, key, np.full(8, 1, dtype=np.int64))
        writer.promote(version)
        staged = f"{layout.tmp}/{version}.link"
        os.symlink(f"../objects/{version}", staged)
        if i < 2:
            os.replace(staged, layout.flat_entry_link(key))
    os.close(writer._lock_fd)  # killed: the kernel drops its lock, its files stay


def test_verify_names_a_directory_an_older_version_left_half_published(
    root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _old_root_left_half_published(root, tmp_path)
    store = Store(root)
    assert [int(store.open_array(f"d/f{i:04d}")[0]) for i in range(4)] == [1, 1, 0, 0]  # as it was left
    for _ in range(2):  # cleanup keeps what shows it, so verify still names it afterwards
        with pytest.raises(CorruptEntryError, match=r"older shmcache.*put the directory again"):
            store.verify("d/f0000")
        assert store.verify("d/f0002")  # an entry of the old directory, intact
        with caplog.at_level("WARNING"):
            store.cleanup()
        assert "mixes old and new entries" in caplog.text
    store.put_file("d", _write_sources(tmp_path, 2, files=4), overwrite=True)
    store.cleanup()
    assert all(store.verify(f"d/f{i:04d}") for i in range(4))
    assert os.listdir(root / "tmp") == []
    _assert_no_orphan(root, 4)


def test_a_file_system_without_rename_exchange_fails_the_directory_put_and_changes_nothing(
    store: Store, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the kernel refuses ``RENAME_EXCHANGE`` (EINVAL: some network and FUSE file
    systems), a directory put fails with a typed error rather than swapping links one by
    one; the refusal is the only thing faked."""
    import ctypes
    import errno


    def refuse(olddirfd: int, old: bytes, newdirfd: int, new: bytes, flags: int) -> int:
        ctypes.set_errno(errno.EINVAL)
        return -1

    store.put_file("d", _write_sources(tmp_path, 0, files=4))
    monkeypatch.setattr(entry_tree, "_renameat2_function", refuse)
    with pytest.raises(CacheRootError, match=r"cannot exchange two directories atomically.*tmpfs"):
        store.put_file("d", _write_sources(tmp_path, 1, files=4), overwrite=True)
    assert [int(store.open_array(f"d/f{i:04d}")[0]) for i in range(4)] == [0] * 4
    assert os.listdir(root / "tmp") == []
    _assert_no_orphan(root, 4)


def _publish_batch(root: Path, arrays: dict[str, int]) -> None:
    """Publish ``key -> value`` arrays as one batch, as a directory put does."""

    layout = Layout(root)
    with VersionWriter(layout) as writer:
        versions = []
        for key, value in arrays.items():
            versions.append((key, _write_version(writer, key, np.full(2, value))))
        publish(layout, writer, versions, overwrite=True, lock_timeout=None)


def test_batches_under_a_new_nested_prefix_and_with_no_common_prefix(store: Store, root: Path) -> None:
    store.put_array("keep", np.full(2, 7))
    store.put_array("x/keep", np.full(2, 8))
    _publish_batch(root, {"a/b/c/one": 1, "a/b/c/two": 2})  # a new prefix two levels down
    _publish_batch(root, {"top": 3, "x/y/z": 4, "a/b/c/one": 5})  # no common prefix: entries/ swapped
    values = {e.key: int(store.open_array(e.key)[0]) for e in store.list()}
    assert values == {"a/b/c/one": 5, "a/b/c/two": 2, "keep": 7, "top": 3, "x/keep": 8, "x/y/z": 4}
    assert os.listdir(root / "tmp") == []
    store.cleanup()
    _assert_no_orphan(root, 6)


DAEMON_KILLS = 8


def test_a_daemon_killed_anywhere_in_a_directory_load_leaves_a_whole_directory(
    root: Path, tmp_path: Path
) -> None:
    """Through the daemon's load, at points spread over the load and then closing in on
    its publish: each killed daemon's successor starts (cleaning up), and readers see one
    whole directory before and after."""
    from service_helpers import Daemon, wait_job

    def start() -> Daemon:
        return Daemon(root, "--allow-source", str(tmp_path)).wait_ready()

    Store(root).put_file("d", _write_sources(tmp_path, 0))
    daemon = start()
    try:
        with daemon.client() as client:
            began = time.monotonic()
            body = {"source": str(_write_sources(tmp_path, 1)), "overwrite": True}
            job = client.put("/v1/entries/d", json=body)
            assert wait_job(client, job.json()["id"], timeout=WAIT_S)["state"] == "done"
            elapsed = time.monotonic() - began
        current = _whole_value(root, {1})
        rng = random.Random(7)
        outcomes = {"old": 0, "new": 0}
        last_old, first_new = 0.0, elapsed * 1.05
        for kill in range(DAEMON_KILLS):
            value = kill + 2
            source = _write_sources(tmp_path, value)
            if kill < DAEMON_KILLS // 2:
                delay = elapsed * 1.05 * (kill + rng.random()) / (DAEMON_KILLS // 2)
            else:
                if last_old >= first_new:
                    last_old, first_new = first_new * 0.95, last_old * 1.05
                delay = last_old + (first_new - last_old) * rng.random()
            with daemon.client() as client:
                started = time.monotonic()
                response = client.put("/v1/entries/d", json={"source": str(source), "overwrite": True})
                assert response.status_code == 202, response.text
                time.sleep(max(0.0, delay - (time.monotonic() - started)))
            daemon.signal(signal.SIGKILL)
            daemon.wait_exit(WAIT_S)
            seen = _whole_value(root, {current, value})
            daemon = start()  # its start cleans up after the killed one
            assert _whole_value(root, {current, value}) == seen
            last_old, first_new = _landed(outcomes, seen == value, delay, last_old, first_new)
            current = seen
    finally:
        daemon.stop()
    assert outcomes["old"] and outcomes["new"], outcomes  # the kills did land on both sides
    assert os.listdir(root / "tmp") == []
    _assert_no_orphan(root, FILES)
