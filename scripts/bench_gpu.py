"""GPU-direct: how fast an entry reaches the GPU (issue 20 item 6).

1. Whole-entry transfer host -> GPU: from the cache's pages as they are (pageable), through
   a pinned copy (memcpy into a pinned buffer, then the copy; the pinned buffer alone for
   reference), and from the entry registered with CUDA (``shmcache.torch.pin``), with and
   without the registration's own cost (``to_cuda``).
2. Random batches of 256 / 4,096 / 65,536 rows of 1 KiB (and of 256 / 1,024 images of
   3x224x224 uint8), shuffled, delivered on the GPU:
   ``DataLoader(CachedDataset, num_workers=4, pin_memory=True)`` then ``.cuda()``, a
   gather on the CPU into a pinned buffer then ``.cuda(non_blocking=True)``, and
   ``GPULoader`` (one ``index_select`` on the GPU over the registered pages).
3. N processes (4) pinning one entry (``pin`` + ``cuda_view``, every page read on the GPU):
   the PSS of the cache's pages summed over them (target: 1x the entry, not N x) and the
   anonymous memory each one grew by (a copied page would land there).

Prints "no GPU" and exits 0 without CUDA. Run from the repository root::

    python scripts/bench_gpu.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

from _benchlib import Target, markdown_table, print_targets, read_memory, scratch_dir, write_report

GiB = 1 << 30
ROW = 1024  # bytes per row: 256 float32
BATCHES = (256, 4096, 65536)
IMAGE = 3 * 224 * 224  # bytes per image row
IMAGE_BATCHES = (256, 1024)  # 4,096 images (616 MB a batch) would not fit a --quick entry


def _no_gpu() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


def _median_seconds(run: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    run()
    sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def transfer(store: Any, size: int, repeats: int) -> tuple[list[list[object]], dict[str, float]]:
    import numpy as np
    import torch

    import shmcache.torch as st

    device = torch.device("cuda", torch.cuda.current_device())
    store.put_array("whole", np.ones(size // 4, dtype=np.float32))
    array = store.open_array("whole")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        host = torch.from_numpy(array)  # read-only: only read from
    target = torch.empty_like(host, device=device)
    pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    sync = torch.cuda.synchronize

    def pinned_copy() -> None:
        pinned.copy_(host)
        target.copy_(pinned, non_blocking=True)

    held = st.pin("whole", root=store.root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        registered = torch.from_numpy(held.array)
    seconds = {
        "pageable": _median_seconds(lambda: target.copy_(host), repeats, sync),
        "pinned copy (memcpy + H2D)": _median_seconds(pinned_copy, repeats, sync),
        "pinned buffer alone (H2D)": _median_seconds(
            lambda: target.copy_(pinned, non_blocking=True), repeats, sync
        ),
        "registered (pin held)": _median_seconds(
            lambda: target.copy_(registered, non_blocking=True), repeats, sync
        ),
    }
    held.release()
    seconds["to_cuda (register + H2D + unregister)"] = _median_seconds(
        lambda: st.to_cuda("whole", root=store.root), max(3, repeats // 2), sync
    )
    assert torch.equal(st.to_cuda("whole", root=store.root)[:1024].cpu(), host[:1024])
    base = seconds["pinned copy (memcpy + H2D)"]
    rows = [[name, f"{size / s / 1e9:.1f}", f"{base / s:.2f}x"] for name, s in seconds.items()]
    store.evict("whole")
    return rows, {name: size / s for name, s in seconds.items()}


def _rows_per_second(batches: Any, rows_wanted: int, batch: int, warm: int) -> float:
    """Rows per second over the batches after ``warm`` ones, each delivered on the GPU."""
    import torch

    iterator = iter(batches)
    for _ in range(warm):
        next(iterator)
    torch.cuda.synchronize()
    count = max(8, rows_wanted // batch)
    started = time.perf_counter()
    for _ in range(count):
        next(iterator)
    torch.cuda.synchronize()
    return count * batch / (time.perf_counter() - started)


def _forever(make: Callable[[], Any]) -> Any:
    while True:
        yield from make()


def random_batches(
    store: Any, rows: Any, batches: tuple[int, ...], rows_wanted: int
) -> tuple[list[list[object]], dict[int, float]]:
    """Rows per second delivered on the GPU, for each batch size, by each path."""
    import torch
    from torch.utils.data import DataLoader

    import shmcache.torch as st

    store.put_array("rows", rows, overwrite=True)
    count, row_bytes = len(rows), rows[0].nbytes
    dataset = st.CachedDataset("rows", root=store.root)
    device = torch.device("cuda", torch.cuda.current_device())
    table: list[list[object]] = []
    ratios: dict[int, float] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        column = torch.from_numpy(store.open_array("rows"))
    for batch in batches:
        loader = DataLoader(
            dataset,
            batch,
            shuffle=True,
            num_workers=4,
            pin_memory=True,
            collate_fn=st.collate,
            persistent_workers=True,
        )

        def through_workers(loader: Any = loader) -> Any:
            for item in loader:
                yield item.to(device, non_blocking=True)

        staging = torch.empty((batch, *column.shape[1:]), dtype=column.dtype, pin_memory=True)

        def cpu_pinned(batch: int = batch, staging: Any = staging) -> Any:
            order = torch.randperm(count)
            for start in range(0, count - batch + 1, batch):
                torch.index_select(column, 0, order[start : start + batch], out=staging)
                yield staging.to(device, non_blocking=True)
                torch.cuda.current_stream().synchronize()  # the buffer is reused next turn

        gpu = st.GPULoader(dataset, batch, shuffle=True)
        speeds = {
            "DataLoader(4 workers, pin_memory)": _rows_per_second(
                _forever(through_workers), rows_wanted, batch, 8
            ),
            "CPU gather into pinned": _rows_per_second(_forever(cpu_pinned), rows_wanted, batch, 2),
            "GPULoader": _rows_per_second(_forever(lambda gpu=gpu: iter(gpu)), rows_wanted, batch, 2),
        }
        first = next(iter(st.GPULoader(dataset, batch, device=device)))
        assert torch.equal(first.cpu(), column[:batch])
        del first
        gpu.close()
        del loader
        base = speeds["DataLoader(4 workers, pin_memory)"]
        ratios[batch] = speeds["GPULoader"] / base
        for name, speed in speeds.items():
            table.append(
                [
                    f"{batch:,}",
                    name,
                    f"{speed / 1e6:.3f}",
                    f"{speed * row_bytes / 1e9:.1f}",
                    f"{speed / base:.2f}x",
                ]
            )
    store.evict("rows")
    return table, ratios


PINNERS = 4
_PINNER = """
import sys, torch, shmcache.torch as st
def anonymous():
    for line in open('/proc/self/smaps_rollup'):
        if line.startswith('Anonymous:'):
            return int(line.split()[1]) * 1024
torch.zeros(1, device='cuda')
before = anonymous()
held = st.pin('shared', root=sys.argv[1])
view = st.cuda_view('shared', root=sys.argv[1])
total = float(view.view(-1, 1024).sum(dtype=torch.float64))  # every page read by the GPU
print(held.registered, anonymous() - before, total, flush=True)
sys.stdin.read()
"""


def pinning_pss(store: Any, size: int) -> tuple[list[list[object]], float]:
    """PINNERS processes pin one entry at once: the sum of their cache PSS vs the entry."""
    import subprocess

    import numpy as np

    store.put_array("shared", np.ones(size // 4, dtype=np.float32))
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _PINNER, str(store.root)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(PINNERS)
    ]
    try:
        answers = [child.stdout.readline().split() for child in children if child.stdout is not None]
        if len(answers) != PINNERS or any(len(a) != 3 for a in answers):
            raise RuntimeError(f"a pinning process failed: {answers}")
        memories = [read_memory(child.pid, store.root) for child in children]
    finally:
        for child in children:
            child.communicate("", timeout=120)
    assert all(float(a[2]) == size // 4 for a in answers), answers  # the GPU read the right bytes
    cache = sum(m.cache_pss for m in memories if m is not None)
    grown = max(int(a[1]) for a in answers)
    ratio = cache / size
    rows: list[list[object]] = [
        [
            PINNERS,
            f"{size / GiB:.2f} GiB",
            ", ".join(sorted({a[0] for a in answers})),
            f"{cache / GiB:.2f} GiB",
            f"{ratio:.2f}x",
            f"{grown / (1 << 20):.1f} MiB",
        ]
    ]
    store.evict("shared")
    return rows, ratio


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="256 MiB entries instead of 1 GiB")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args()
    missing = _no_gpu()
    if missing is not None:
        print(f"no GPU ({missing}): nothing measured")
        write_report(
            args.json,
            "bench_gpu",
            quick=args.quick,
            config={},
            results={"no_gpu": missing},
            targets=[],
            elapsed_s=0.0,
        )
        return 0
    import numpy as np
    import torch

    import shmcache

    started = time.perf_counter()
    size = GiB // 4 if args.quick else GiB
    rows_wanted = (1 << 17) if args.quick else (1 << 20)
    print(f"device: {torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})")
    with scratch_dir("bench-gpu-") as root:
        store = shmcache.Store(root)
        moved, bandwidth = transfer(store, size, 5 if args.quick else 9)
        print(f"\n## Whole entry ({size / GiB:.2f} GiB) host -> GPU, median\n")
        print(markdown_table(["path", "GB/s", "vs pinned copy"], moved, "lrr"))
        count = size // ROW
        rows = np.arange(count * (ROW // 4), dtype=np.float32).reshape(count, ROW // 4)
        batches, ratios = random_batches(store, rows, BATCHES, rows_wanted)
        del rows
        print(f"\n## Random batches of 1 KiB rows delivered on the GPU ({count:,} rows)\n")
        print(markdown_table(["batch", "path", "M rows/s", "GB/s", "vs DataLoader"], batches, "rlrrr"))
        images = np.random.default_rng(0).integers(0, 255, (size // IMAGE, 3, 224, 224), dtype=np.uint8)
        pictures, _ = random_batches(store, images, IMAGE_BATCHES, rows_wanted // 64)
        del images
        print(f"\n## Random batches of 3x224x224 uint8 images on the GPU ({size // IMAGE:,} images)\n")
        print(markdown_table(["batch", "path", "M rows/s", "GB/s", "vs DataLoader"], pictures, "rlrrr"))
        pinners, pss_ratio = pinning_pss(store, size)
        print(f"\n## {PINNERS} processes pinning one entry at once\n")
        print(markdown_table(
            ["processes", "entry", "registered", "cache PSS, all of them", "x the entry",
             "most anonymous growth"],
            pinners,
            "rrlrrr",
        ))
    registered = bandwidth["registered (pin held)"] / bandwidth["pinned buffer alone (H2D)"]
    targets = [
        Target(
            "registered transfer >= 0.9x pinned-copy bandwidth",
            "whole entry, registered vs pinned H2D",
            registered,
            f"{registered:.2f}x",
            registered >= 0.9,
        ),
        Target(
            "GPULoader >= 3x the DataLoader path at 4,096 rows",
            "random 4,096 x 1 KiB batches",
            ratios[4096],
            f"{ratios[4096]:.2f}x",
            ratios[4096] >= 3.0,
        ),
        Target(
            f"{PINNERS} processes pinning one entry keep 1x PSS",
            "sum of their cache PSS / the entry",
            pss_ratio,
            f"{pss_ratio:.2f}x",
            pss_ratio <= 1.1,
        ),
    ]
    print()
    print_targets(targets)
    write_report(
        args.json,
        "bench_gpu",
        quick=args.quick,
        config={"size": size, "rows_wanted": rows_wanted},
        results={
            "transfer_bytes_per_s": bandwidth,
            "gpuloader_vs_dataloader": ratios,
            "pinning_cache_pss_vs_entry": pss_ratio,
        },
        targets=targets,
        elapsed_s=time.perf_counter() - started,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
