"""Train on a folder of images packed once into shared memory: one blobs entry holds every
file's bytes, and a Dataset decodes them in its DataLoader workers (no file opened per item).

    python examples/train_images.py --images data/train/      # one sub-folder per class
    python examples/train_images.py --count 32 --steps 2      # makes a tiny folder of JPEGs first

Needs pillow (``pip install pillow``) and torch.
"""

from __future__ import annotations

import argparse
import io
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

import shmcache


class Images(Dataset[tuple[torch.Tensor, int]]):
    """Decodes ``blobs[i]`` (a zero-copy view of the file's bytes); the label is its folder."""

    def __init__(self, key: str, size: int) -> None:
        self.blobs = shmcache.open_blobs(key)  # pickles by reference to the workers
        self.classes = sorted({name.split("/")[0] for name in self.blobs.names})
        self.size = size

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image = Image.open(io.BytesIO(self.blobs[i])).convert("RGB").resize((self.size, self.size))
        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255
        return pixels, self.classes.index(self.blobs.names[i].split("/")[0])


def make_images(folder: Path, count: int) -> None:
    """A stand-in dataset: red and blue JPEGs in two class folders."""
    rng = np.random.default_rng(0)
    for i in range(count):
        label = ("red", "blue")[i % 2]
        (folder / label).mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 80, (48, 64, 3), dtype=np.uint8)
        pixels[..., 0 if label == "red" else 2] += 150
        Image.fromarray(pixels).save(folder / label / f"{i:05d}.jpg")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=Path, help="a folder with one sub-folder per class")
    parser.add_argument("--count", type=int, default=256, help="images to make when --images is not given")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--size", type=int, default=32, help="images are resized to size x size")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        folder = args.images or Path(scratch)
        if args.images is None:
            make_images(folder, args.count)
        shmcache.put_blobs("images/train", folder, overwrite=True)  # every file, by relative path
    data = Images("images/train", args.size)
    print(f"{len(data)} images in {len(data.classes)} classes: {data.classes}")

    loader = DataLoader(data, batch_size=16, shuffle=True, num_workers=args.workers)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, len(data.classes)),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = 0
    while step < args.steps:
        for pixels, labels in loader:
            loss = torch.nn.functional.cross_entropy(model(pixels), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step % 10 == 0 or step == args.steps:
                print(f"step {step}: loss {loss.item():.4f}")
            if step == args.steps:
                break


if __name__ == "__main__":
    main()
