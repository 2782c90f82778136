#!/usr/bin/env python
"""Grid search across GPUs over one shared copy of the dataset.

Loads a synthetic classification dataset (float32 features, int64 labels) into the
cache once, then runs N experiment processes at the same time, one per visible GPU
(``CUDA_VISIBLE_DEVICES`` round-robin; without GPUs, N CPU processes, default 4). Each
trains a small MLP with its own learning rate through a 4-worker DataLoader over
``shmcache.torch.CachedDataset``: every experiment and every worker maps the same
pages. While all of them are alive (after training, persistent workers still up) the
PSS of every process is read from ``/proc/PID/smaps``; the total, and the part of it
that is the cache's pages, are compared with 1x and N x the data's size.

``--loader gpu`` runs the grid twice over the same entries: each experiment reads its
batches through ``shmcache.torch.GPULoader`` (gathered on its GPU over the registered
pages, no worker process), then through the DataLoader as above, and compares the epoch
times (issue 20's target: GPULoader epoch <= 0.5x the DataLoader's). Without a GPU it
says "no GPU" and runs both on ``device="cpu"`` (the same code; the ratio then measures the
CPU gather, not the GPU target), so the comparison runs anywhere.

The dataset goes in through the daemon (``shmcache.client.Client.put_file``) when one
answers for ``--root`` (default: ``$SHMCACHE_ROOT`` or the default root; the entries are
evicted at the end); otherwise into a temporary root under /dev/shm, in-process,
removed at the end. Usage::

    python scripts/grid_search.py [--quick] [--experiments N] [--rows R] [--dim D]
                                  [--epochs E] [--workers W] [--root R] [--loader gpu]
                                  [--loss-every-step]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from _benchlib import MiB, markdown_table, process_tree, read_memory, scratch_dir
from shmcache.client import Client

import shmcache
from shmcache._disk.layout import ENV_ROOT
from shmcache.errors import DaemonUnavailableError, ShmCacheError

CLASSES = 10
LEARNING_RATES = (0.3, 0.1, 0.03, 0.01, 0.003, 0.001)
HIDDEN = (256, 128)


@dataclass(frozen=True)
class Experiment:
    """What one experiment process is told."""

    index: int
    root: str
    features: str
    labels: str
    lr: float
    hidden: int
    epochs: int
    batch_size: int
    workers: int
    device: str
    loader: str = "dataloader"
    """"dataloader" (``workers`` worker processes) or "gpu" (``GPULoader``, none)."""
    loss_every_step: bool = False
    """Read each step's loss on the host (``loss.item()``: a GPU sync per step), rather than
    keeping the losses on the device and reading them once per epoch."""


# ---------------------------------------------------------------------- one experiment (child)


def run_experiment(exp: Experiment) -> int:
    """Train, report on stdout, keep the workers alive until told to exit on stdin."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    from shmcache.torch import CachedDataset, GPULoader, as_tensor, collate

    torch.set_num_threads(1)
    torch.manual_seed(exp.index)
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    started = time.perf_counter()
    device = torch.device(exp.device)
    dataset = CachedDataset(exp.features, exp.labels, root=exp.root)
    loader: Any
    if exp.loader == "gpu":
        loader = GPULoader(
            dataset, exp.batch_size, shuffle=True, generator=torch.Generator().manual_seed(exp.index),
            device=device,
        )
    else:
        loader = DataLoader(
            dataset,
            batch_size=exp.batch_size,
            shuffle=True,
            num_workers=exp.workers,
            persistent_workers=exp.workers > 0,
            collate_fn=collate,
            generator=torch.Generator().manual_seed(exp.index),
            pin_memory=device.type == "cuda",
        )
    features = as_tensor(exp.features, root=exp.root)
    model = nn.Sequential(nn.Linear(features.shape[1], exp.hidden), nn.ReLU(), nn.Linear(exp.hidden, CLASSES))
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=exp.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    losses: list[float] = []
    steps = 0
    training = time.perf_counter()
    for _ in range(exp.epochs):
        on_device: list[torch.Tensor] = []
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            if exp.loss_every_step:
                losses.append(loss.item())
            else:
                on_device.append(loss.detach())
            steps += 1
        if on_device:  # one sync per epoch, inside the timed epoch
            losses.extend(torch.stack(on_device).tolist())
    epoch_s = (time.perf_counter() - training) / max(1, exp.epochs)
    with torch.no_grad():
        held_out = slice(0, min(8192, len(dataset)))
        labels = as_tensor(exp.labels, root=exp.root)[held_out].to(device)
        predicted = model(features[held_out].to(device)).argmax(1)
        accuracy = float((predicted == labels).float().mean())
    result = {
        "index": exp.index, "lr": exp.lr, "hidden": exp.hidden, "device": exp.device, "loader": exp.loader,
        "epoch_seconds": epoch_s,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        "steps": steps, "first_loss": losses[0], "last_loss": sum(losses[-10:]) / len(losses[-10:]),
        "accuracy": accuracy, "seconds": time.perf_counter() - started, "pid": os.getpid(),
    }
    print("TRAINED " + json.dumps(result), flush=True)
    sys.stdin.readline()  # the parent measures memory now, then says go
    if isinstance(loader, GPULoader):
        loader.close()  # drops its pins
    del loader  # stops the persistent workers
    return 0


# ---------------------------------------------------------------------- the driver (parent)


def visible_gpus() -> list[str]:
    """GPU ids this process may use: ``CUDA_VISIBLE_DEVICES`` if set, else ``nvidia-smi -L``."""
    configured = os.environ.get("CUDA_VISIBLE_DEVICES")
    if configured is not None:
        return [g.strip() for g in configured.split(",") if g.strip() and not g.strip().startswith("-")]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(listed.stdout.splitlines()) if line.startswith("GPU ")]


def make_dataset(rows: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Features and labels a small MLP can learn: the argmax of a fixed random projection."""
    rng = np.random.default_rng(0)
    features = rng.standard_normal((rows, dim), dtype=np.float32)
    projection = rng.standard_normal((dim, CLASSES), dtype=np.float32)
    labels = (features @ projection).argmax(axis=1).astype(np.int64)
    return features, labels


def daemon_client(root: Path) -> Client | None:
    """A client of the daemon of ``root``, or None when none answers."""
    client = Client(root, timeout=2.0)
    try:
        client.health()
    except DaemonUnavailableError:
        client.close()
        return None
    client.timeout = 600.0
    client.close()  # the next call reconnects with the longer timeout
    return client


def load_through_daemon(client: Client, arrays: dict[str, np.ndarray]) -> None:
    """Save each array as .npy and have the daemon load it (``Client.put_file``: submit, wait)."""
    with scratch_dir("grid-search-src-", on_shm=False) as source_dir:
        for key, array in arrays.items():
            source = source_dir / (key.replace("/", "_") + ".npy")
            np.save(source, array, allow_pickle=False)
            client.put_file(key, source, overwrite=True)


@dataclass
class Snapshot:
    """Memory of every process of the grid at one moment."""

    processes: int = 0
    pss: int = 0
    cache_pss: int = 0
    uss: int = 0


def measure(pids: Sequence[int], root: Path) -> Snapshot:
    snap = Snapshot()
    for top in pids:
        for pid in process_tree(top):
            memory = read_memory(pid, root)
            if memory is None:
                continue
            snap.processes += 1
            snap.pss += memory.pss
            snap.cache_pss += memory.cache_pss
            snap.uss += memory.uss
    return snap


@dataclass
class GridRun:
    """One grid: each experiment's result, and memory with all of them alive."""

    results: dict[int, dict[str, Any]]
    snapshot: Snapshot
    peak: Snapshot
    codes: list[int]


def run_once(
    args: argparse.Namespace, n: int, root: Path, prefix: str, gpus: list[str], loader: str
) -> GridRun | None:
    """Run the N experiments with ``loader`` at once; None if one of them failed."""
    children: list[subprocess.Popen[str]] = []
    results: dict[int, dict[str, Any]] = {}
    trained = threading.Event()
    peak = Snapshot()
    try:
        for i in range(n):
            exp = Experiment(
                index=i, root=str(root), features=f"{prefix}/features", labels=f"{prefix}/labels",
                lr=LEARNING_RATES[i % len(LEARNING_RATES)], hidden=HIDDEN[(i // len(LEARNING_RATES)) % 2],
                epochs=args.epochs, batch_size=args.batch_size, workers=args.workers,
                device="cuda" if gpus else "cpu", loader=loader, loss_every_step=args.loss_every_step,
            )
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus[i % len(gpus)] if gpus else "")
            children.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--run-experiment", json.dumps(asdict(exp))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
            ))

        def read(child: subprocess.Popen[str]) -> None:
            assert child.stdout is not None
            for line in child.stdout:
                if line.startswith("TRAINED "):
                    result = json.loads(line[len("TRAINED "):])
                    results[result["index"]] = result
                    if len(results) == n:
                        trained.set()
            if child.wait() != 0:  # died before reporting: stop waiting for the others
                trained.set()

        readers = [threading.Thread(target=read, args=(c,), daemon=True) for c in children]
        for reader in readers:
            reader.start()
        pids = [c.pid for c in children]
        while not trained.wait(0.5):  # sample while training
            snap = measure(pids, root)
            if snap.pss > peak.pss:
                peak = snap
        if len(results) != n:
            failed = [c.pid for c in children if c.poll() not in (None, 0)]
            print(f"experiment processes {failed} failed", file=sys.stderr)
            return None
        snapshot = measure(pids, root)  # all trained, every worker still alive
        for child in children:
            assert child.stdin is not None
            child.stdin.write("exit\n")
            child.stdin.flush()
        codes = [child.wait(timeout=60) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    return GridRun(results, snapshot, peak, codes)


def report(run: GridRun, n: int, data_bytes: int, loader: str, workers_each: int) -> None:
    """The runs' table and the memory table of one grid."""
    results, snapshot, peak = run.results, run.snapshot, run.peak
    runs: list[list[object]] = []
    for i in sorted(results):
        r = results[i]
        device = r["device"]
        if device == "cuda":
            device += f" (CUDA_VISIBLE_DEVICES={r['cuda_visible_devices']})"
        runs.append([i, f"{r['lr']:g}", r["hidden"], device, r["steps"],
                     f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}", f"{r['accuracy']:.3f}",
                     f"{r['epoch_seconds']:.2f} s", f"{r['seconds']:.1f} s"])
    what = "GPULoader (no worker process)" if loader == "gpu" else f"DataLoader ({workers_each} workers each)"
    print(f"\n## {what}\n")
    print(markdown_table(
        ["run", "lr", "hidden", "device", "steps", "loss first -> last", "accuracy", "epoch", "time"], runs,
        "rrrlrlrrr",
    ))
    workers = snapshot.processes - n
    baseline = snapshot.pss - snapshot.cache_pss + n * data_bytes
    print()
    print(f"memory with all {n} experiments + {workers} workers alive ({snapshot.processes} processes, "
          f"PSS from /proc/PID/smaps):")
    measures = [
        [label, f"{value / MiB:,.1f}", f"{value / data_bytes:.2f}x", f"{value / (n * data_bytes):.2f}x"]
        for label, value in (
            ("data (one copy)", data_bytes),
            (f"{n} private copies (one per experiment)", n * data_bytes),
            ("PSS of the cache's pages, all processes", snapshot.cache_pss),
            ("total PSS, all processes", snapshot.pss),
            ("peak total PSS while training", peak.pss),
            (f"same processes if each experiment held its own copy (total - cache + {n} copies)", baseline),
        )
    ]
    print(markdown_table(["measure", "MiB", "x data (1 copy)", "x N copies"], measures, "lrrr"))
    overhead = (snapshot.pss - snapshot.cache_pss) / max(1, snapshot.processes)
    print(f"\nthe data costs {snapshot.cache_pss / data_bytes:.2f}x of one copy across {snapshot.processes} "
          f"processes (target <= 1.1x; N copies would be {n}x); the rest of the total is each process's own "
          f"interpreter, torch and batches: {overhead / MiB:,.1f} MiB per process on average")
    print(f"total PSS {snapshot.pss / MiB:,.1f} MiB vs {baseline / MiB:,.1f} MiB with a copy per experiment: "
          f"{snapshot.pss / baseline:.2f}x")


def median_epoch(run: GridRun) -> float:
    times = sorted(r["epoch_seconds"] for r in run.results.values())
    return times[len(times) // 2]


def run_grid(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    gpus = visible_gpus()
    n = args.experiments or (len(gpus) if gpus else 4)
    rows = args.rows or (32_768 if args.quick else 1_048_576)
    features, labels = make_dataset(rows, args.dim)
    data_bytes = features.nbytes + labels.nbytes

    daemon_root = Path(args.root) if args.root else shmcache.default_root()
    prefix = f"grid-search-{os.getpid()}"
    keys = {f"{prefix}/features": features, f"{prefix}/labels": labels}
    temporary = contextlib.ExitStack()  # the temporary root, if there is one
    load_started = time.perf_counter()
    daemon = daemon_client(daemon_root)
    if daemon is not None:
        root = daemon_root
        how = f"through the daemon on {daemon.socket_path}"
        load_through_daemon(daemon, keys)
    else:
        root = temporary.enter_context(scratch_dir("shmcache-grid-"))
        how = f"in-process into temporary root {root} (no daemon on {Client(daemon_root).socket_path})"
        for key, array in keys.items():
            shmcache.put_array(key, array, root=root)
    load_s = time.perf_counter() - load_started
    del features, labels, keys  # from here on, the only copy is the cache's

    loaders = ["gpu", "dataloader"] if args.loader == "gpu" else ["dataloader"]
    print(f"# grid_search{' (quick)' if args.quick else ''}: {n} experiments, "
          f"{len(gpus) or 'no'} visible GPUs, {args.workers} DataLoader workers each, {os.cpu_count()} CPUs, "
          f"{args.epochs} epoch(s), losses read {'every step' if args.loss_every_step else 'once per epoch'}")
    if args.loader == "gpu" and not gpus:
        print("no GPU: GPULoader and the DataLoader both run on device cpu "
              "(the ratio below is not the GPU target)")
    print(f"dataset: {rows:,} x {args.dim} float32 + labels = {data_bytes / MiB:,.1f} MiB, "
          f"loaded once {how} in {load_s:.2f} s")

    runs: dict[str, GridRun] = {}
    try:
        for loader in loaders:
            run = run_once(args, n, root, prefix, gpus, loader)
            if run is None:
                return 1
            runs[loader] = run
            report(run, n, data_bytes, loader, args.workers)
    finally:
        temporary.close()
        if daemon is not None:
            for key in (f"{prefix}/features", f"{prefix}/labels"):
                try:
                    daemon.evict(key)
                except ShmCacheError as exc:
                    print(f"could not evict {key}: {exc}", file=sys.stderr)
            daemon.close()
    if "gpu" in runs:
        gpu, cpu = median_epoch(runs["gpu"]), median_epoch(runs["dataloader"])
        device = "cuda" if gpus else "cpu"
        print(f"\nepoch (median of {n}): GPULoader {gpu:.2f} s vs DataLoader ({args.workers} workers) "
              f"{cpu:.2f} s on {device}: {gpu / cpu:.2f}x (target <= 0.5x on a GPU)")
    codes = [code for run in runs.values() for code in run.codes]
    print(f"done in {time.perf_counter() - started:.1f} s; exit codes {codes}")
    return 0 if all(code == 0 for code in codes) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small run (32 MiB of data, < 30 s on 2 cores)")
    parser.add_argument("--experiments", "-n", type=int, help="default: one per visible GPU, else 4")
    parser.add_argument("--rows", type=int, help="rows of data (default 1,048,576; --quick 32,768)")
    parser.add_argument("--dim", type=int, default=256, help="features per row (float32)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=4, help="DataLoader workers per experiment")
    parser.add_argument(
        "--root", help=f"cache root whose daemon loads the data (default ${ENV_ROOT}, else the default root)"
    )
    parser.add_argument(
        "--loader", choices=("dataloader", "gpu"), default="dataloader",
        help="gpu: a GPULoader grid, then the DataLoader's, and their epoch times compared",
    )
    parser.add_argument(
        "--loss-every-step", action="store_true",
        help="read each step's loss with loss.item() (a GPU sync per step) instead of once per epoch",
    )
    parser.add_argument("--run-experiment", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_experiment:
        return run_experiment(Experiment(**json.loads(args.run_experiment)))
    return run_grid(args)


if __name__ == "__main__":
    sys.exit(main())
