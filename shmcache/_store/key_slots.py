"""Where each key's lock is: one byte in one of :data:`KEY_LOCK_FILES` lock files.

The mapping is part of the root's format (every version that writes a root must lock a
key at the same byte): a 64-bit blake2b hash of the key, its low bits pick the file
(``locks/key-slots.NN.lock``), the other 58 the byte. A hash collision (odds 2^-58 per
pair) only makes two keys share a lock.
"""

from __future__ import annotations

import functools
import hashlib
import os

import numpy as np

from .._disk.layout import Layout

__all__ = ["KEY_LOCK_FILES", "key_slot", "key_slots", "lock_path", "slot_files"]

KEY_LOCK_FILES = 32
"""Lock files the key locks are spread over: the most descriptors a process holds for key
locks, whatever the number of keys."""


@functools.lru_cache(maxsize=64)
def slot_files(layout: Layout) -> tuple[str, ...]:
    """The paths of the root's key-slot lock files, by index (their names sort alike), as
    :func:`lock_path` spells them."""
    return tuple(lock_path(str(layout.key_slot_file(i))) for i in range(KEY_LOCK_FILES))


@functools.lru_cache(maxsize=256)
def lock_path(path: str) -> str:
    """``path`` with its symbolic links resolved: this process's record of held lock bytes
    is keyed by path, and fcntl locks of one process never exclude each other, so one root
    reached by two spellings (a symlink to it, say) must name each lock file once."""
    return os.path.realpath(path)


def key_slot(layout: Layout, key: str) -> tuple[str, int]:
    """The lock file and byte of ``key``: a 64-bit hash, its low bits pick the file."""
    digest = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return slot_files(layout)[digest % KEY_LOCK_FILES], digest >> 6


def key_slots(keys: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`key_slot` of each key as (file index, byte), sorted and each once (two keys
    may share a lock): a hash per key, the rest in numpy (a dict per key cost ~2x more)."""
    blake2b = hashlib.blake2b
    hasher = functools.partial(blake2b, digest_size=8)  # maps without a Python frame per key
    digests = np.frombuffer(b"".join(map(blake2b.digest, map(hasher, map(str.encode, keys)))), "<u8")
    files, offsets = digests % np.uint64(KEY_LOCK_FILES), digests >> np.uint64(6)
    order = np.lexsort((offsets, files))
    files, offsets = files[order], offsets[order]
    once = np.ones(len(files), dtype=bool)
    once[1:] = (files[1:] != files[:-1]) | (offsets[1:] != offsets[:-1])
    return files[once].astype(np.intp), offsets[once]
