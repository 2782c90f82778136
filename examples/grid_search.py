"""A grid search on one machine: the dataset goes into shared memory once, then N experiments
train on it at the same time, one per GPU when there are GPUs (else N CPU processes). Every
experiment and every one of its DataLoader workers maps the same pages: one copy in RAM.

    python examples/grid_search.py                              # 4 experiments (or one per GPU)
    python examples/grid_search.py --rows 2000 --steps 5        # a tiny run

Run it again and the data is not loaded again: ``shmcache.cache`` finds it in the cache
(``shmcache evict --prefix grid`` frees it).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp

import numpy as np
import torch
from torch.utils.data import DataLoader

import shmcache
from shmcache.torch import CachedDataset, collate


def load_dataset(rows: int, features: int) -> tuple[np.ndarray, np.ndarray]:
    """Stands for the slow part (reading files, decoding): runs once, whoever asks first."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, features), dtype=np.float32)
    y = (x @ rng.standard_normal(features, dtype=np.float32) > 0).astype(np.int64)
    return x, y


def experiment(lr: float, device: str, args: argparse.Namespace, results: mp.Queue) -> None:
    """Train one model on the cached data; report (lr, device, final loss, accuracy)."""
    torch.manual_seed(0)
    data = CachedDataset({"x": "grid/x", "y": "grid/y"})  # pickles as its keys, maps lazily
    loader = DataLoader(data, batch_size=256, shuffle=True, num_workers=args.workers, collate_fn=collate)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.features, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2)
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss = torch.tensor(0.0)
    batches = itertools.chain.from_iterable(itertools.repeat(loader))  # epochs until --steps
    for batch in itertools.islice(batches, args.steps):
        x, y = batch["x"].to(device), batch["y"].to(device)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():  # accuracy on the first rows, read straight from the cache
        x = torch.from_numpy(shmcache.open_array("grid/x")[:1000].copy()).to(device)
        y = torch.from_numpy(shmcache.open_array("grid/y")[:1000].copy()).to(device)
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    results.put((lr, device, loss.item(), accuracy))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experiments", type=int, default=0, help="default: one per GPU, else 4")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200, help="training steps per experiment")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per experiment")
    args = parser.parse_args()

    version = (args.rows, args.features)  # another size is another dataset: cache() reloads
    loaded = shmcache.cache("grid/x", lambda: load_dataset(*version)[0], version=version)
    shmcache.cache("grid/y", lambda: load_dataset(*version)[1], version=version)
    print(f"dataset: {loaded.shape} float32, {loaded.nbytes / 2**20:.1f} MiB, one copy in shared memory")

    gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    count = args.experiments or len(gpus) or 4
    devices = [gpus[i % len(gpus)] if gpus else "cpu" for i in range(count)]
    rates = [0.3 / 3**i for i in range(count)]
    context = mp.get_context("spawn")  # CUDA cannot be used in a forked child
    results = context.Queue()
    processes = [
        context.Process(target=experiment, args=(lr, device, args, results))
        for lr, device in zip(rates, devices, strict=True)
    ]
    for process in processes:
        process.start()
    rows = [results.get() for _ in processes]
    for process in processes:
        process.join()
        if process.exitcode != 0:
            raise SystemExit(f"an experiment failed with exit code {process.exitcode}")
    for lr, device, loss, accuracy in sorted(rows, key=lambda row: -row[3]):
        print(f"lr {lr:<10.5g} {device:<7} loss {loss:.4f}  accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
