"""Train a language model on a raw token file (nanoGPT's ``train.bin``) put once into shared
memory: every process, and every DataLoader worker, reads the same pages, and a batch of
random windows is one gather (nanoGPT's ``get_batch`` as a Dataset).

    python examples/train_tokens.py --tokens data/owt/train.bin      # uint16 token ids
    python examples/train_tokens.py --count 100000 --steps 2          # makes a tiny file first

Needs torch.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

import shmcache
from shmcache.torch import TokenWindows, collate


def make_tokens(path: Path, count: int, vocab: int) -> None:
    """A stand-in corpus: a repeating sequence a model can learn, written as nanoGPT does."""
    tokens = (np.arange(count) * 7 % vocab).astype(np.uint16)
    tokens.tofile(path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=Path, help="a raw token file of --dtype")
    parser.add_argument("--dtype", default="uint16")
    parser.add_argument("--count", type=int, default=1_000_000, help="tokens to make without --tokens")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        path = args.tokens or Path(scratch) / "train.bin"
        if args.tokens is None:
            make_tokens(path, args.count, args.vocab)
        shmcache.put_file("tokens/train", path, dtype=args.dtype, overwrite=True)  # one 1-D array
    windows = TokenWindows("tokens/train", args.block_size)
    print(f"{len(shmcache.open_array('tokens/train')):,} tokens, {len(windows):,} windows per epoch")

    loader = DataLoader(windows, batch_size=args.batch_size, collate_fn=collate, num_workers=args.workers)
    model = torch.nn.Sequential(torch.nn.Embedding(args.vocab, 32), torch.nn.Linear(32, args.vocab))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = 0
    for epoch in range(1_000_000):
        windows.set_epoch(epoch)  # other random windows each epoch
        for x, y in loader:
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.view(-1, args.vocab), y.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step % 10 == 0 or step == args.steps:
                print(f"step {step}: loss {loss.item():.4f}")
            if step == args.steps:
                return


if __name__ == "__main__":
    main()
