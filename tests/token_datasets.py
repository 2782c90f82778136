"""Token datasets for the token file tests: Megatron indexed datasets written by hand."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

__all__ = ["write_megatron"]

CODES = {np.dtype("u1"): 1, np.dtype("<i4"): 4, np.dtype("<u2"): 8}


def write_megatron(
    prefix: Path, documents: list[list[list[int]]], dtype: str = "<u2", modes: bool = False
) -> tuple[Path, Path]:
    """A Megatron indexed dataset written by hand (``_IndexWriter``'s layout): documents
    made of sequences of tokens; returns the ``.bin`` and ``.idx`` paths."""
    token = np.dtype(dtype)
    sequences = [np.asarray(s, dtype=token) for doc in documents for s in doc]
    bounds = [0]
    for doc in documents:
        bounds.append(bounds[-1] + len(doc))
    lengths = np.array([len(s) for s in sequences], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64))]) * token.itemsize
    bin_path, idx_path = prefix.with_suffix(".bin"), prefix.with_suffix(".idx")
    bin_path.write_bytes(b"".join(s.tobytes() for s in sequences))
    head = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, CODES[token], len(sequences), len(bounds))
    body = lengths.tobytes() + pointers.astype("<i8").tobytes() + np.asarray(bounds, "<i8").tobytes()
    idx_path.write_bytes(head + body + (bytes(len(sequences)) if modes else b""))
    return bin_path, idx_path
