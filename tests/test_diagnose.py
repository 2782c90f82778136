"""``shmcache doctor``, ``top`` and ``watch``: real processes, real /proc, a real daemon."""

from __future__ import annotations

import csv
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import CLI, invoke, stale_socket
from service_helpers import mounted_tmpfs, running_daemon, temporary_root

import shmcache
from shmcache._diagnose.growth import GROWTH_MIN_BYTES, MAX_FIT_POINTS, judge, theil_sen
from shmcache._diagnose.procfs import read_memory
from shmcache._disk.layout import Layout

MiB = 1 << 20


def _doctor(*args: str) -> tuple[int, dict[str, dict[str, object]]]:
    result = invoke("doctor", "--json", *args)
    report = json.loads(result.stdout)
    assert report["ok"] == (result.exit_code == 0)
    return result.exit_code, {c["name"]: c for c in report["checks"]}


# ---------------------------------------------------------------------- doctor


def test_doctor_reports_every_check(root: Path) -> None:
    shmcache.put_array("x", np.arange(10), root=root)
    code, checks = _doctor("--root", str(root))
    expected = {"shm", "cgroup", "root", "daemon", "start_method", "open_files", "overcommit", "held"}
    assert expected <= set(checks)
    assert all(c["status"] in ("ok", "warn", "fail") for c in checks.values())
    assert code == (1 if any(c["status"] == "fail" for c in checks.values()) else 0)
    assert checks["root"]["status"] == "ok" and checks["root"]["details"]["mode"] == "0o700"  # type: ignore[index]
    assert "no daemon" in str(checks["daemon"]["summary"])
    human = invoke("doctor", "--root", str(root))
    assert re.search(r"^(ok|WARN|FAIL)\s+shm\s", human.stdout, re.MULTILINE)
    assert "failed" in human.stdout.splitlines()[-1]


@pytest.mark.skipif(
    Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None,
    reason="checks a machine without an NVIDIA driver",
)
def test_doctor_says_no_gpu_in_one_line_without_a_driver(root: Path) -> None:
    _, checks = _doctor("--root", str(root))
    assert checks["gpu"]["status"] == "ok" and checks["gpu"]["summary"] == "no GPU (no NVIDIA driver)"
    assert "memlock" in checks["gpu"]["details"]  # type: ignore[operator]
    human = invoke("doctor", "--root", str(root))
    assert re.search(r"^ok\s+gpu\s+no GPU \(no NVIDIA driver\)$", human.stdout, re.MULTILINE)


def test_doctor_fails_on_a_root_that_is_not_yours(root: Path, tmp_path: Path) -> None:
    if os.geteuid() == 0:
        root.mkdir(mode=0o700)
        os.chown(root, 65534, 65534)
        expected = "belongs to uid 65534"
    else:  # cannot give a directory away: a planted symlink fails the same check
        (tmp_path / "elsewhere").mkdir()
        root.symlink_to(tmp_path / "elsewhere")
        expected = "symlink"
    code, checks = _doctor("--root", str(root))
    assert code == 1
    assert checks["root"]["status"] == "fail" and expected in str(checks["root"]["summary"])
    assert checks["root"]["fix"]
    human = invoke("doctor", "--root", str(root))
    assert human.exit_code == 1 and "FAIL" in human.stdout and "fix:" in human.stdout


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "tiny", "size=16m") as mount_point:
        yield mount_point

def test_doctor_fails_on_a_docker_sized_tmpfs(tiny_tmpfs: Path) -> None:
    code, checks = _doctor("--root", str(tiny_tmpfs / "cache"))
    assert code == 1
    shm = checks["shm"]
    assert shm["status"] == "fail" and "64 MB" in str(shm["summary"]) and "--shm-size" in str(shm["fix"])


def test_doctor_reaches_a_running_daemon(root: Path) -> None:
    with running_daemon(root) as daemon:
        _, checks = _doctor("--root", str(root))
        assert checks["daemon"]["status"] == "ok"
        assert f"daemon pid {daemon.pid}" in str(checks["daemon"]["summary"])
    _, checks = _doctor("--root", str(root))  # stopped: the socket is gone, reported as optional
    assert checks["daemon"]["status"] == "ok" and "no daemon" in str(checks["daemon"]["summary"])


def test_doctor_warns_about_a_stale_daemon_socket(root: Path) -> None:
    stale_socket(Layout(root).socket)
    _, checks = _doctor("--root", str(root))
    daemon = checks["daemon"]
    assert daemon["status"] == "warn" and "nothing answers" in str(daemon["summary"])
    assert "shmcache serve" in str(daemon["fix"])


# ---------------------------------------------------------------------- top


def test_top_once_shows_a_process_that_maps_an_entry(root: Path) -> None:
    shmcache.put_array("feats/a", np.ones((256, 1024), dtype=np.float32), root=root)
    reader = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, shmcache
            a = shmcache.open_array("feats/a", root={str(root)!r})
            print(float(a.sum()), flush=True)
            sys.stdin.read()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert reader.stdout is not None and float(reader.stdout.readline()) == 256 * 1024
        result = invoke("top", "--once", "--root", str(root))
        assert result.exit_code == 0, result.output
        line = next(row for row in result.stdout.splitlines() if row.startswith(f"{reader.pid} "))
        assert "1: feats/a" in line and "MiB" in line
        assert "1 processes map entries" in result.stdout
    finally:
        reader.communicate("")
    result = invoke("top", "--once", "--root", str(root))
    # (a row per process, its PID first: the root's random name may hold the PID's digits)
    rows = result.stdout.splitlines()
    assert result.exit_code == 0 and not [row for row in rows if row.startswith(f"{reader.pid} ")]


def test_top_names_the_packed_entry_a_process_maps_and_evicted_once_its_manifest_is(
    root: Path, tmp_path: Path
) -> None:
    """A directory put's small entries live in its manifest: top attributes a mapping of
    the manifest to the entries its range covers (not ``<evicted>``): a reader maps the
    manifest once per 64 MiB window for all its entries, so all of them; and only a mapping of no live
    entry's bytes to ``<evicted>``."""
    from shmcache._diagnose.top import mapping_processes

    source = tmp_path / "d"
    source.mkdir()
    for i in range(4):  # 16 KiB each
        np.save(source / f"f{i}.npy", np.full((64, 64), i, dtype=np.float32))
    store = shmcache.Store(root)
    store.put_file("d", source)
    assert "." in store.info("d/f2").version  # packed: <batch>/<n>.<offset>.<length>
    reader = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, shmcache
            a = shmcache.open_array("d/f2", root={str(root)!r})
            print(float(a[0, 0]), flush=True)
            sys.stdin.read()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert reader.stdout is not None and float(reader.stdout.readline()) == 2.0
        rows, _ = mapping_processes(store)
        keys = next(row.entries for row in rows if row.pid == reader.pid)
        assert "d/f2" in keys and "<evicted>" not in keys
        assert keys == ["d/f0", "d/f1", "d/f2", "d/f3"]  # one mapping of the manifest's only window
        for i in range(4):
            store.evict(f"d/f{i}")
        rows, _ = mapping_processes(store)
        assert next(row.entries for row in rows if row.pid == reader.pid) == ["<evicted>"]
    finally:
        reader.communicate("")


# ---------------------------------------------------------------------- watch

# A training-like script: the main process forks 2 workers that run for ~7 s. "leak"
# workers grow a Python list by 1 MiB every 0.125 s (~480 MiB/min); "shmcache" workers
# read rows of a cached 32 MiB array over and over (their private memory stays flat).
# 7 s leaves the verdict ~3.5 s after its warm-up: well above MIN_SPAN_S even when a
# loaded machine delays the first and last samples.
WORKLOAD = textwrap.dedent("""
    import multiprocessing as mp, sys, time
    import numpy as np, shmcache

    def work(mode, root):
        hoard = []
        array = shmcache.open_array("data", root=root) if mode == "shmcache" else None
        end = time.monotonic() + 7
        i = 0
        while time.monotonic() < end:
            if mode == "leak":
                hoard.append("x" * (1 << 20))
            else:
                hoard = [float(array[j].sum()) for j in range(i % 8192, 8192, 97)]
                i += 13
            time.sleep(0.125)

    if __name__ == "__main__":
        mode, root = sys.argv[1], sys.argv[2]
        if mode == "shmcache":
            shmcache.put_array("data", np.ones((8192, 1024), dtype=np.float32), root=root)
        workers = [mp.get_context("fork").Process(target=work, args=(mode, root)) for _ in range(2)]
        for w in workers:
            w.start()
        print("workers", *[w.pid for w in workers], flush=True)
        for w in workers:
            w.join()
        sys.exit(3)
""")


@dataclass(frozen=True)
class Watched:
    """One ``shmcache watch`` run of WORKLOAD: its exit code, stderr, the workers' pids
    and the output directory."""

    returncode: int
    stderr: str
    workers: list[int]
    out: Path


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Watched]]:
    """Both workloads watched at the same time (two independent ``shmcache watch`` runs)."""
    base = tmp_path_factory.mktemp("watch")
    script = base / "train.py"
    script.write_text(WORKLOAD)
    with temporary_root() as root:
        out = {mode: base / f"watch-{mode}" for mode in ("leak", "shmcache")}
        running = {
            mode: subprocess.Popen(
                [*CLI, "watch", "--interval", "0.25", "--out", str(out[mode]), "--root", str(root), "--",
                 sys.executable, str(script), mode, str(root)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            for mode in out
        }
        results = {}
        for mode, process in running.items():
            stdout, stderr = process.communicate(timeout=120)
            assert "workers" in stdout, stderr
            workers = [int(pid) for pid in stdout.split("workers", 1)[1].split()]
            results[mode] = Watched(process.returncode, stderr, workers, out[mode])
        yield results


def _verdicts(stderr: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in re.finditer(r"^shmcache watch: pid (\d+) \(.*?\): (.*)$", stderr, re.M)}


def test_watch_flags_workers_that_grow_a_python_list(watched: dict[str, Watched]) -> None:
    done = watched["leak"]
    assert done.returncode == 3, done.stderr  # the command's exit code passes through
    verdicts = _verdicts(done.stderr)
    for pid in done.workers:
        assert verdicts[pid].startswith("growing at "), done.stderr
    assert "shmcache.share" in done.stderr and "Fixing DataLoader memory growth" in done.stderr
    [csv_path] = done.out.glob("*.csv")
    with open(csv_path) as fp:
        rows = list(csv.DictReader(fp))
    assert set(rows[0]) == {"time_s", "pid", "ppid", "cmd", "rss", "pss", "uss", "own", "cache_pss", "gpu"}
    if not Path("/proc/driver/nvidia/version").exists() and shutil.which("nvidia-smi") is None:
        assert all(r["gpu"] == "" for r in rows)  # no NVML here: empty, and said in one line
        assert "shmcache watch: no GPU (no NVIDIA driver)\n" in done.stderr
    for pid in done.workers:
        uss = [int(r["uss"]) for r in rows if int(r["pid"]) == pid]
        assert len(uss) >= 8 and max(uss) - min(uss) > 2 * GROWTH_MIN_BYTES
    assert {int(r["ppid"]) for r in rows if int(r["pid"]) in done.workers} == {done_pid(rows, done.workers)}
    png = csv_path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def done_pid(rows: list[dict[str, str]], workers: list[int]) -> int:
    """The watched command's own pid: the process that is no one's worker."""
    return next(int(r["pid"]) for r in rows if int(r["pid"]) not in workers)


def test_watch_finds_workers_reading_through_shmcache_flat(watched: dict[str, Watched]) -> None:
    done = watched["shmcache"]
    assert done.returncode == 3, done.stderr
    verdicts = _verdicts(done.stderr)
    assert len(verdicts) == 3
    for pid in done.workers:
        assert verdicts[pid].startswith("flat"), done.stderr
    [csv_path] = done.out.glob("*.csv")
    with open(csv_path) as fp:
        cache = [int(r["cache_pss"]) for r in csv.DictReader(fp) if int(r["pid"]) in done.workers]
    assert max(cache) > 0  # the workers' reads of the entry show up as cache pages
    assert "growing" not in done.stderr.split("(thresholds")[0]


def test_watch_forwards_sigint_and_returns_the_commands_code(tmp_path: Path) -> None:
    script = tmp_path / "wait.py"
    script.write_text(textwrap.dedent("""
        import signal, sys, time
        signal.signal(signal.SIGINT, lambda *_: sys.exit(42))
        print("ready", flush=True)
        time.sleep(60)
        sys.exit(1)
    """))
    watcher = subprocess.Popen(
        [*CLI, "watch", "--interval", "0.2", "--out", str(tmp_path / "w"), "--", sys.executable, str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
    )
    assert watcher.stdout is not None and watcher.stdout.readline().strip() == "ready"
    watcher.send_signal(signal.SIGINT)
    _, stderr = watcher.communicate(timeout=30)
    assert watcher.returncode == 42, stderr
    assert "exited with 42" in stderr


def test_watch_of_a_missing_command_fails_cleanly(tmp_path: Path) -> None:
    missing = f"no-such-command-{uuid.uuid4().hex[:6]}"
    result = invoke("watch", "--out", str(tmp_path), "--", missing)
    assert result.exit_code == 127 and "cannot run" in result.stderr


def test_watch_of_a_command_that_exits_at_once_plots_without_a_warning(tmp_path: Path) -> None:
    """No process lived long enough to be sampled: the plot has no line to label, and no
    matplotlib warning ("No artists with labels") reaches the user."""
    pytest.importorskip("matplotlib")
    done = subprocess.run(
        [*CLI, "watch", "--out", str(tmp_path), "--", "sh", "-c", "exit 3"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 3, done.stderr
    assert "Warning" not in done.stderr and list(tmp_path.glob("watch-*.png")), done.stderr


# A short DataLoader-like run, watched at the default interval. "cow": the main process
# builds 300k annotation dicts (~80 MiB), forks 2 workers that each read every dict and its
# path once in 10 batches (~2 s: each read writes reference counts, so pages are copied) and
# exit, reaped at once as a DataLoader's are.
# "heap": a lone process, no children. Both main processes also hoard 1 MiB every 0.1 s for
# 9 s (their own heap), so that their verdict comes from the slope after the warm-up: at 1 s
# intervals, 7 s left a loaded machine 3 samples after it, one short of a slope.
SHORT_WORKLOAD = textwrap.dedent("""
    import multiprocessing as mp, sys, time

    def load(records):
        n = len(records)
        total = 0
        for batch in range(10):
            for record in records[batch * n // 10 : (batch + 1) * n // 10]:
                total += len(record["path"]) + record["label"]
            time.sleep(0.15)

    if __name__ == "__main__":
        start = time.monotonic()
        workers = []
        if sys.argv[1] == "cow":
            records = [{"id": i, "path": f"img/{i:08d}.jpg", "label": i % 80} for i in range(300_000)]
            workers = [mp.get_context("fork").Process(target=load, args=(records,)) for _ in range(2)]
            for w in workers:
                w.start()
        print("workers", *[w.pid for w in workers], flush=True)
        hoard = []
        while time.monotonic() < start + 9:
            hoard.append("x" * (1 << 20))
            workers = [w for w in workers if w.is_alive()]  # reaps the workers that are done
            time.sleep(0.1)
""")


@pytest.fixture(scope="module")
def watched_short(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Watched]:
    """Both SHORT_WORKLOAD modes watched at the same time, at the default interval."""
    base = tmp_path_factory.mktemp("watch-short")
    script = base / "train.py"
    script.write_text(SHORT_WORKLOAD)
    out = {mode: base / f"watch-{mode}" for mode in ("cow", "heap")}
    running = {
        mode: subprocess.Popen(
            [*CLI, "watch", "--out", str(out[mode]), "--", sys.executable, str(script), mode],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for mode in out
    }
    results = {}
    for mode, process in running.items():
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 0 and "workers" in stdout, stderr
        workers = [int(pid) for pid in stdout.split("workers", 1)[1].split()]
        results[mode] = Watched(process.returncode, stderr, workers, out[mode])
    return results


def _rows(out: Path) -> list[dict[str, str]]:
    [csv_path] = out.glob("*.csv")
    with open(csv_path) as fp:
        return list(csv.DictReader(fp))


def test_watch_judges_short_lived_forked_workers_that_copy(watched_short: dict[str, Watched]) -> None:
    done = watched_short["cow"]
    verdicts = _verdicts(done.stderr)
    rows = _rows(done.out)
    assert len(done.workers) == 2
    for pid in done.workers:
        # judged on its short life (too short for a slope), with the numbers
        assert re.match(r"growing: its private memory rose \+\d+\.\d MiB in its short life "
                        r"\(\d+ samples over \d+\.\d s\), \d+% of the \d+\.\d MiB it started with",
                        verdicts[pid]), done.stderr
        assert "copy-on-write" in verdicts[pid]
        # sampled faster than the 1 s interval while young: the CSV's own stamps, not a clock
        times = [float(r["time_s"]) for r in rows if int(r["pid"]) == pid]
        gaps = sorted(b - a for a, b in itertools.pairwise(times))
        assert len(times) >= 4 and gaps[len(gaps) // 2] < 0.75, times
    main = verdicts[done_pid(rows, done.workers)]
    assert main.startswith("growing at ") and "its forked workers copy pages" in main, done.stderr
    assert "shmcache.share" in done.stderr and "tracemalloc" not in done.stderr


def test_watch_tells_a_lone_process_its_own_heap_grows(watched_short: dict[str, Watched]) -> None:
    done = watched_short["heap"]
    verdicts = _verdicts(done.stderr)
    assert done.workers == [] and len(verdicts) == 1, done.stderr
    [verdict] = verdicts.values()
    assert verdict.startswith("growing at ") and "its own heap" in verdict, done.stderr
    assert "tracemalloc.take_snapshot()" in done.stderr
    assert "forked workers" not in done.stderr and "shmcache.share" not in done.stderr


def _rollup() -> dict[bytes, int]:
    with open("/proc/self/smaps_rollup", "rb") as fp:
        lines = fp.read().splitlines()[1:]  # after the header line
    return {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(b":") for line in lines)}


def test_read_memory_agrees_with_the_kernels_own_sums() -> None:
    ballast = [{"i": i} for i in range(200_000)]  # a heap of some size, as a worker's would be
    for _ in range(20):  # PSS moves whenever another process maps or drops a shared library
        rollup = _rollup()  # (parallel test workers starting): compare within a quiet moment
        memory = read_memory(os.getpid())
        if _rollup() == rollup:
            break
    assert memory is not None and ballast
    assert abs(memory.rss - rollup[b"Rss"]) < MiB and abs(memory.pss - rollup[b"Pss"]) < MiB
    assert abs(memory.uss - rollup[b"Private_Clean"] - rollup[b"Private_Dirty"]) < MiB
    assert 0 < memory.own <= memory.uss


def test_a_zombie_has_no_memory_to_read() -> None:
    # a worker that exited but is not joined yet: zeros in its series would read as a drop
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        for _ in range(1000):
            with open(f"/proc/{child.pid}/stat", "rb") as fp:
                if fp.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    break
            time.sleep(0.01)
        else:
            pytest.fail("the child never exited")
        assert read_memory(child.pid) is None
    finally:
        child.wait()
    assert read_memory(os.getpid()) is not None


def test_watch_names_the_plot_extra_when_matplotlib_is_missing(tmp_path: Path) -> None:
    # sys.modules[name] = None makes ``import matplotlib`` raise ImportError: a real missing import
    without_matplotlib = "import sys; sys.modules['matplotlib'] = None; from shmcache.cli import main; main()"
    done = subprocess.run(
        [sys.executable, "-c", without_matplotlib, "watch", "--out", str(tmp_path), "--",
         sys.executable, "-c", "pass"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert ("plot skipped: matplotlib is not installed (pip install 'shmcache[plot]'; "
            "from a checkout: pip install -e '.[plot]')") in done.stderr
    assert list(tmp_path.glob("*.csv")) and not list(tmp_path.glob("*.png"))


def test_the_plot_extra_is_declared_and_in_dev() -> None:
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    assert any(r.startswith("matplotlib>=3.7") for r in extras["plot"])
    dev_self = next(r for r in extras["dev"] if r.startswith("shmcache["))
    assert "plot" in dev_self[len("shmcache[") : dev_self.index("]")].split(",")


# ---------------------------------------------------------------------- the verdict itself


def test_judge_separates_growth_from_noise() -> None:
    times = [i * 0.5 for i in range(40)]  # 20 s
    rng = np.random.default_rng(0)
    noisy_flat = [100 * MiB + float(rng.normal(0, 2 * MiB)) for _ in times]
    sawtooth = [100 * MiB + (i % 5) * 3 * MiB for i in range(len(times))]
    leak = [100 * MiB + t * MiB for t in times]  # 60 MiB/min
    spike = list(noisy_flat)
    spike[-1] += 500 * MiB  # one outlier at the end must not tilt the fit
    assert judge(1, times, noisy_flat).state == "flat"
    assert judge(1, times, sawtooth).state == "flat"
    assert judge(1, times, spike).state == "flat"
    verdict = judge(1, times, leak)
    assert verdict.state == "growing" and 55 * MiB < verdict.slope < 65 * MiB
    assert "growing at 60.0 MiB/min" in verdict.describe()
    assert judge(1, times[:3], leak[:3]).state == "short"
    step = [10 * MiB + min(t, 2.0) * 100 * MiB for t in times]  # +200 MiB in 2 s, then flat
    assert judge(1, times, step).state == "flat"  # a parent building its Dataset
    stepped = judge(2, times, step, forked=True)  # a forked worker that copied 200 MiB
    assert stepped.state == "stepped" and "+200.0 MiB" in stepped.describe()


def test_judge_a_life_too_short_for_a_slope() -> None:
    times = [i * 0.2 for i in range(10)]  # 1.8 s: no span left after the warm-up
    copying = [2 * MiB + t * 20 * MiB for t in times]  # +36 MiB
    jitter = [2 * MiB + (i % 3) * MiB for i in range(len(times))]
    start = 200 * MiB  # its RSS at the first sample, shared with its parent
    verdict = judge(2, times, copying, forked=True, start=start)
    assert verdict.state == "growing" and verdict.whole_life
    text = verdict.describe()
    assert "rose +36.0 MiB in its short life (10 samples over 1.8 s), 18% of the 200.0 MiB" in text
    two = judge(2, [0.0, 0.2], [2 * MiB, 40 * MiB], forked=True, start=start)  # two samples suffice
    assert two.state == "growing"
    assert judge(2, times, jitter, forked=True, start=start).state == "flat"
    assert judge(2, times, copying, forked=True, start=1000 * MiB).state == "flat"  # 3.6 % of what it has
    step = [2 * MiB, *[90 * MiB] * 9]  # a copy bigger than STEP_MIN_BYTES counts whatever it started with
    assert judge(2, times, step, forked=True, start=4000 * MiB).state == "growing"
    # not forked: an early rise may be its start-up (imports, loading data); flat is still flat
    unforked = judge(1, times, copying, start=start)
    assert unforked.state == "short" and "too short to tell start-up" in unforked.describe()
    assert judge(1, times, jitter).state == "flat"
    assert judge(1, times[:3], jitter[:3]).describe() == "too short to judge (3 samples over 0.4 s)"


def test_long_traces_are_thinned_before_the_fit() -> None:
    # Points the even thinning keeps lie on a line of slope 1; every other point is far
    # above it. Fitted on all points the median slope would follow the outliers.
    n = 5000
    kept = {round(i * (n - 1) / (MAX_FIT_POINTS - 1)) for i in range(MAX_FIT_POINTS)}
    times = [float(i) for i in range(n)]
    values = [float(i) if i in kept else 1e6 * i for i in range(n)]
    assert theil_sen(times, values) == pytest.approx(1.0)
    assert theil_sen(times[:MAX_FIT_POINTS], values[:MAX_FIT_POINTS]) > 1000  # unthinned: outliers win
