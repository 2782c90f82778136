"""GPU-direct bookkeeping on CPU (issue 20 items 1, 3, 4): what a failed CUDA registration
falls back to, how a pinned entry is kept by the budget, and the per-process ``pins/<pid>``
records that ``ls``, ``top`` and ``doctor`` read, with real processes and a real
``kill -9``. Two stand-ins, each for what this machine lacks and none for what a test
claims to check: ``FakeRegister`` plays ``cudaHostRegister``'s answers for the tests of
the fallback *decision*, and ``STAND_IN_NVML`` plays NVML for the plumbing of ``top``'s
and ``watch``'s GPU columns. CUDA and NVML themselves are tested on a GPU
(tests/test_gpu_cuda.py, through scripts/gpu_check.sh)."""

from __future__ import annotations

import csv
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import invoke

import shmcache
from shmcache import _cuda
from shmcache._diagnose.gpu import gpu_report, staged_pins
from shmcache._diagnose.nvml import GpuMemory
from shmcache._disk.pin_records import PINS_DIR, PinnedEntry, live_pins

MiB = 1 << 20
NO_DRIVER = not Path("/proc/driver/nvidia/version").exists() and shutil.which("nvidia-smi") is None


class FakeRegister:
    """Stands in for ``_cuda._host_register`` (the one CUDA call of a registration) and
    answers the cudaError_t codes it is given, in turn: the fallback decision is what is
    under test, not CUDA."""

    def __init__(self, *answers: int) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[int, int]] = []

    def __call__(self, pointer: int, nbytes: int, device: torch.device) -> int:
        self.calls.append((pointer, nbytes))
        return self.answers.pop(0)


def test_any_registration_failure_falls_back_to_staging_named_and_logged_once(
    store: shmcache.Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for key in "abc":
        store.put_array(key, np.arange(1000, dtype=np.float64))
    fake = FakeRegister(801, 2, 712)
    monkeypatch.setattr(_cuda, "_host_register", fake)
    monkeypatch.setattr(_cuda, "_FELL_BACK", [])
    caplog.set_level(logging.INFO, "shmcache.torch")
    held = [_cuda.hold(key, store.root, torch.device("cuda", 0), register=True) for key in "abc"]
    assert [h.registered for h in held] == [False, False, False]  # staged, not an error
    assert [h.error for h in held] == [
        "cudaErrorNotSupported",
        "cudaErrorMemoryAllocation",
        "cudaErrorHostMemoryAlreadyRegistered",
    ]
    assert [nbytes for _, nbytes in fake.calls] == [8000, 8000, 8000]  # the whole entry, once each
    assert np.array_equal(held[1].array, np.arange(1000, dtype=np.float64))  # the data is still there
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned  # once per process
    assert "'a'" in warned[0] and "cudaErrorNotSupported" in warned[0] and "staging" in warned[0]
    later = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("cudaErrorMemoryAllocation" in m for m in later)
    pid = os.getpid()
    recorded = sorted(live_pins(store.root)[pid], key=lambda p: p.key)
    assert [(p.key, p.registered, p.error) for p in recorded] == [
        ("a", False, "cudaErrorNotSupported"),
        ("b", False, "cudaErrorMemoryAllocation"),
        ("c", False, "cudaErrorHostMemoryAlreadyRegistered"),
    ]
    assert staged_pins(store.root) == [
        f"process {pid} stages 3 entries (a, b, c): cudaErrorHostMemoryAlreadyRegistered, "
        "cudaErrorMemoryAllocation, cudaErrorNotSupported"
    ]
    second = _cuda.hold("a", store.root, torch.device("cuda", 0), register=True)
    assert fake.calls[3:] == [] and second.error == "cudaErrorNotSupported"  # one try per mapping
    for h in [*held, second]:
        h.release()
    assert live_pins(store.root) == {} and not (store.root / PINS_DIR / str(pid)).exists()


def test_an_unsupported_gpu_records_why_nothing_was_registered(store: shmcache.Store) -> None:
    store.put_array("u", np.arange(8))
    with _cuda.hold("u", store.root, torch.device("cuda", 0), register=False) as held:
        assert not held.registered and held.error == _cuda.UNSUPPORTED
        [entry] = live_pins(store.root)[os.getpid()]
        assert entry == PinnedEntry(store.info("u").version, "u", False, _cuda.UNSUPPORTED)


HOLDER = textwrap.dedent("""
    import os, sys, torch
    from shmcache import _cuda
    held = _cuda.hold("held", sys.argv[1], torch.device("cpu"), register=False)  # pin's mapping
    if sys.argv[2] == "fork":
        child = os.fork()
        if child == 0:  # a forked child keeps running after its parent is killed
            sys.stdin.read()
            os._exit(0)
        print(child, flush=True)
    print("held", flush=True)
    sys.stdin.read()
""")


def _holder(root: Path, mode: str = "plain") -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _put(store: shmcache.Store, key: str) -> None:
    store.put_array(key, np.full(MiB, 1, np.uint8))
    time.sleep(0.05)  # distinct last-used times


def test_budget_never_evicts_an_entry_pinned_by_another_process_until_it_is_killed(root: Path) -> None:
    store = shmcache.Store(root, max_bytes=int(2.5 * MiB))
    _put(store, "held")
    holder = _holder(root)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        for key in ("x", "y", "z"):
            _put(store, key)
            assert sorted(e.key for e in store.list()) == sorted(["held", key])  # the oldest, kept
        listing = invoke("ls", "--root", str(root))
        assert listing.exit_code == 0, listing.output
        line = next(row for row in listing.stdout.splitlines() if row.startswith("held "))
        assert f"cuda {holder.pid}" in line
        top = invoke("top", "--once", "--root", str(root))
        assert "CUDA PINS" in top.stdout
        row = next(row for row in top.stdout.splitlines() if row.startswith(f"{holder.pid} "))
        assert "1: held (staged)" in row  # mapped for CUDA, not registered (a CPU)
        if NO_DRIVER:
            assert top.stdout.rstrip().splitlines()[-1] == "no GPU (no NVIDIA driver)"
    finally:
        holder.kill()  # SIGKILL: no atexit, the record stays behind
        holder.communicate()
    assert (root / PINS_DIR / str(holder.pid)).exists()
    assert live_pins(root) == {}  # its lock went with it: ignored, and swept
    assert not (root / PINS_DIR / str(holder.pid)).exists()
    assert "cuda" not in invoke("ls", "--root", str(root)).stdout
    _put(store, "v")
    _put(store, "w")
    assert sorted(e.key for e in store.list()) == ["v", "w"]  # no longer mapped: evictable


def test_a_forked_child_does_not_keep_its_parents_record_alive(root: Path) -> None:
    store = shmcache.Store(root)
    _put(store, "held")
    holder = _holder(root, "fork")
    assert holder.stdout is not None
    child = int(holder.stdout.readline())
    try:
        assert holder.stdout.readline().strip() == "held"
        assert list(live_pins(root)) == [holder.pid]
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
        os.kill(child, 0)  # the child lives on, with a copy of the parent's descriptors
        assert live_pins(root) == {}
    finally:
        holder.kill()
        holder.communicate()
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_record_under_a_temporary_name_of_a_dead_process_is_swept(root: Path) -> None:
    shmcache.Store(root).put_array("t", np.arange(3))
    pins = root / PINS_DIR
    pins.mkdir()
    code = "import os; print(os.getpid())"
    dead = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    left = pins / f".{int(dead.stdout)}.1"
    left.write_text("")
    mine = pins / f".{os.getpid()}.1"  # a live process between create and rename: kept
    mine.write_text("")
    assert live_pins(root) == {}
    assert not left.exists() and mine.exists()


@pytest.mark.skipif(not NO_DRIVER, reason="checks a machine without an NVIDIA driver")
def test_without_a_driver_gpu_memory_and_doctor_say_no_gpu_in_one_line(store: shmcache.Store) -> None:
    gpus = GpuMemory()
    assert not gpus.available and gpus.missing == "no GPU (no NVIDIA driver)" and gpus.by_pid() == {}
    status, summary, _, details = gpu_report(store.root)
    assert (status, summary) == ("ok", "no GPU (no NVIDIA driver)")
    assert details["memlock"] and details["staged"] == []


STAND_IN_NVML = '''
"""A stand-in for NVML's binding (pynvml): two GPUs, on which every process whose command
line holds the marker uses 100 + 28 MiB. It tests shmcache's plumbing, not NVML."""
import os
MARK = b"nvml-stand-in-user"
class NVMLError(Exception):
    pass
class _Process:
    def __init__(self, pid, used):
        self.pid, self.usedGpuMemory = pid, used
def nvmlInit():
    pass
def nvmlShutdown():
    pass
def nvmlDeviceGetCount():
    return 2
def nvmlDeviceGetHandleByIndex(index):
    return index
_SEEN = []
def nvmlDeviceGetComputeRunningProcesses(handle):
    # GPU 1 reports the processes GPU 0's query found: one /proc scan per sample, so a
    # process starting between the two queries never shows on one GPU only.
    if handle == 0:
        _SEEN[:] = []
        for name in os.listdir("/proc"):
            try:
                if name.isdigit() and MARK in open(f"/proc/{name}/cmdline", "rb").read():
                    _SEEN.append(int(name))
            except OSError:
                pass
    return [_Process(pid, (100 if handle == 0 else 28) << 20) for pid in _SEEN]
'''


def test_top_and_watch_show_what_nvml_reports_per_process(root: Path, tmp_path: Path) -> None:
    """With a stand-in NVML (and a stand-in nvidia-smi, which only says a driver is there):
    the GPU column of top, the gpu column of watch's CSV and its plot's GPU panel."""
    stand_in = tmp_path / "stand-in"
    stand_in.mkdir()
    (stand_in / "pynvml.py").write_text(STAND_IN_NVML)
    (stand_in / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (stand_in / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PYTHONPATH": f"{stand_in}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PATH": f"{stand_in}{os.pathsep}{os.environ['PATH']}", "SHMCACHE_ROOT": str(root)}
    shmcache.put_array("feats", np.ones((256, 1024), np.float32), root=root)
    user = (
        "import sys, shmcache; a = shmcache.open_array('feats'); print(a[0, 0], flush=True); sys.stdin.read()"
    )
    reader = subprocess.Popen([sys.executable, "-c", user, "nvml-stand-in-user"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert reader.stdout is not None and reader.stdout.readline().strip() == "1.0"
        top = subprocess.run([sys.executable, "-m", "shmcache", "top", "--once"], capture_output=True,
                             text=True, env=env, timeout=120)
        assert top.returncode == 0, top.stderr
        header, *rows = top.stdout.splitlines()
        assert header.split()[-2:] == ["GPU", "COMMAND"], top.stdout
        row = next(r for r in rows if r.startswith(f"{reader.pid} "))
        assert "128.0 MiB" in row, top.stdout  # 100 + 28 MiB, summed over the two GPUs
        assert "GPU memory of these: 128.0 MiB" in top.stdout and "no GPU" not in top.stdout, top.stdout
    finally:
        reader.communicate("")
    out = tmp_path / "watch"
    sleeper = "import time; time.sleep(1.5)"
    watch = ["watch", "--interval", "0.3", "--out", str(out), "--"]
    watch += [sys.executable, "-c", sleeper, "nvml-stand-in-user"]
    done = subprocess.run([sys.executable, "-m", "shmcache", *watch], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0 and "no GPU" not in done.stderr, done.stderr
    [csv_path] = out.glob("*.csv")
    with open(csv_path) as fp:
        rows = list(csv.DictReader(fp))
    # NVML is read once per round, before the tree walk: a process that execs between the two
    # reads 0 in that round (true at NVML's moment), and NVML's figure from the next round on.
    assert rows and {row["gpu"] for row in rows} <= {"0", str(128 << 20)}, (rows, done.stderr)
    last = {row["pid"]: row["gpu"] for row in rows}
    assert set(last.values()) == {str(128 << 20)}, (rows, done.stderr)
    if "plot:" in done.stderr:  # matplotlib installed: the GPU panel is drawn
        assert csv_path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_only_plain_files_are_read_as_records(root: Path) -> None:
    """A FIFO or a symlink under pins/ is skipped: ls must not block on it or follow it."""
    shmcache.Store(root).put_array("t", np.arange(3))
    pins = root / PINS_DIR
    pins.mkdir()
    os.mkfifo(pins / "4000001")
    (pins / "4000002").symlink_to("/dev/zero")
    code = f"from shmcache._disk.pin_records import live_pins; print(live_pins({str(root)!r}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "{}", done.stderr
    assert (pins / "4000001").exists() and (pins / "4000002").is_symlink()  # not ours to remove
