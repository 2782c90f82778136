#!/usr/bin/env python
"""GPU probe: can each kind of entry mapping be registered with CUDA without copying a page?

Issue 18 made every reader's mapping copy-on-write (``MAP_PRIVATE``, ``PROT_READ|PROT_WRITE``)
so that a write through a tensor cannot crash a process; GPU-direct (issue 20) needs
``cudaHostRegister`` of an entry's pages with no private copy. For each mapping mode of
``shmcache._disk.attach`` (``shared``: ``MAP_SHARED`` read-only; ``copy-on-write``: what
readers get) and each register flag (8 = ``cudaHostRegisterReadOnly``, 0 = default) this
prints: the return code, the seconds it took, the process's anonymous memory before and
after (a page copied out of the private mapping becomes anonymous), the H2D bandwidth from the registered
pages (a pinned buffer's is printed first), and whether the bytes on the GPU are right. Needs a CUDA GPU::

    python scripts/probe_gpu_mappings.py [--gib 2] [--root /dev/shm/gpu-probe-mappings]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

import shmcache
from shmcache._disk.attach import COPY_ON_WRITE, SHARED, MapMode, attach_array
from shmcache._disk.layout import ARRAY_FILE

MiB = 1 << 20


def _median_s(fn: Any, torch: Any, reps: int = 7) -> float:
    times = []
    for _ in range(reps + 1):
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def _anonymous_bytes() -> int:
    """This process's anonymous memory (``/proc/self/smaps_rollup``): a page copied out of
    a private file mapping becomes anonymous, while the cache's own pages (shmem) never are
    (USS cannot tell them apart: a shmem page only this process maps counts as unique)."""
    with open("/proc/self/smaps_rollup") as fp:
        for line in fp:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    return 0


def _case(root: str, mode: MapMode, flags: int) -> str:
    """One row: register the entry mapped with ``mode`` using ``flags`` (in a process of its
    own: a failed register leaves a sticky CUDA error behind)."""
    import torch

    store = shmcache.Store(root)
    version = store.info("x").version
    array = attach_array(str(store.root), version, ARRAY_FILE, "x", mode=mode)
    rows = array.shape[0]
    array.sum(axis=0)  # touch every page: shared with the cache, not private
    torch.zeros(1, device="cuda")
    ptr = array.__array_interface__["data"][0]
    before = _anonymous_bytes()
    started = time.perf_counter()
    rc = int(torch.cuda.cudart().cudaHostRegister(ptr, array.nbytes, flags))
    seconds = time.perf_counter() - started
    after = _anonymous_bytes()
    row = f"| {mode} | {flags} | {rc} | {seconds:.3f} | {before / MiB:,.0f} -> {after / MiB:,.0f} "
    if rc != 0:
        return row + "| - | - |"
    gpu = torch.empty(array.size, dtype=torch.float32, device="cuda")
    host = torch.from_numpy(array.reshape(-1))
    h2d_s = _median_s(lambda: gpu.copy_(host, non_blocking=True), torch)
    expected = torch.from_numpy(np.ascontiguousarray(array[:: max(1, rows // 1024)]))
    ok = bool(torch.equal(gpu.view(rows, -1)[:: max(1, rows // 1024)].cpu(), expected))
    torch.cuda.cudart().cudaHostUnregister(ptr)
    return row + f"| {array.nbytes / h2d_s / 1e9:.1f} | {ok} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--gib", type=float, default=2.0, help="entry size in GiB")
    parser.add_argument("--root", default="/dev/shm/gpu-probe-mappings")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # MODE:FLAGS, run by the parent
    args = parser.parse_args(argv)
    if args.case:
        mode, flags = args.case.split(":")
        print(_case(args.root, mode, int(flags)), flush=True)  # type: ignore[arg-type]
        return 0
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to probe")
        return 0
    shutil.rmtree(args.root, ignore_errors=True)
    rows = int(args.gib * (1 << 30)) // 1024
    shmcache.Store(args.root).put_array("x", np.arange(rows * 256, dtype=np.float32).reshape(rows, 256))
    pinned = torch.empty(rows * 256, dtype=torch.float32).pin_memory()
    gpu = torch.empty(rows * 256, dtype=torch.float32, device="cuda")
    pinned_s = _median_s(lambda: gpu.copy_(pinned, non_blocking=True), torch)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, entry {rows * 1024 / MiB:,.0f} MiB; "
          f"pinned buffer -> GPU {rows * 1024 / pinned_s / 1e9:.1f} GB/s")
    print("| mapping | flags | rc | register s | anonymous before -> after (MiB) | H2D GB/s | bytes ok |")
    print("|---|---:|---:|---:|---|---:|---|", flush=True)
    for mode in (SHARED, COPY_ON_WRITE):
        for flags in (8, 0):
            case = [sys.executable, __file__, "--root", args.root, "--case", f"{mode}:{flags}"]
            done = subprocess.run(case, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("|")]
            print(lines[-1] if lines else f"| {mode} | {flags} | crashed: {done.stderr.strip()[-200:]} |")
    shutil.rmtree(args.root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
