"""Checksums recorded at put time are zlib's CRC-32 of the file's bytes, whichever
implementation computed them (ISA-L's when ``isal`` is installed) and however the write
was pipelined (one thread writing, another checksumming the piece before)."""

from __future__ import annotations

import sys
import threading
import zlib
from pathlib import Path

import numpy as np

from shmcache import Store
from shmcache._disk import checksum
from shmcache._disk.checksum import crc32, crc32_combine, parse_checksums
from shmcache._disk.meta import read_meta


def test_crc32_is_zlibs_and_chains() -> None:
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
    pieces = [data[:1], data[1:70_000], data[70_000:]]
    value = 0
    for piece in pieces:
        value = crc32(piece.data, value)
    assert value == zlib.crc32(data.data)


def test_crc32_combine_is_the_crc_of_the_two_joined() -> None:
    """Lengths with few and many bits set, none, one byte, past 2**32 (zeros: their CRC is
    chained cheaply); the squared operators are kept between calls and reused."""
    rng = np.random.default_rng(1)
    for first, second in [(0, 0), (1, 1), (5, 7), (100, 4096), (3, 1_000_003), (0, 1 << 20), (77, 3_456_789)]:
        a, b = rng.bytes(first), rng.bytes(second)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), second) == zlib.crc32(a + b), (first, second)
    zeros, value = bytes(1 << 24), 0
    for _ in range(257):  # 2**32 + 2**24 zero bytes
        value = zlib.crc32(zeros, value)
    header = b"\x93NUMPY header"
    chained = zlib.crc32(header)
    for _ in range(257):
        chained = zlib.crc32(zeros, chained)
    assert crc32_combine(zlib.crc32(header), value, 257 << 24) == chained


def _recorded_matches_file(store: Store, root: Path, key: str) -> bool:
    version = store.info(key).version
    meta = read_meta(store.layout, version)
    assert meta is not None and meta.checksum is not None
    recorded = parse_checksums(meta.checksum)["data"]
    return recorded == zlib.crc32((root / "objects" / version / "data.npy").read_bytes())


def test_crc32_combine_is_right_after_threads_first_use_it_together() -> None:
    """Threads that first need the zero-byte operators at once square them one at a time:
    two appending together shifted every later operator, for the rest of the process."""
    a, b = b"0123456789abcdef" * 1000, b"tail" * 333
    reference = crc32(a + b)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # makes the race likely; it exists at any interval
    wrong: list[int] = []
    try:
        for _ in range(10):
            checksum._ZERO_BYTES.clear()
            barrier = threading.Barrier(4)

            def work(barrier: threading.Barrier = barrier) -> None:
                barrier.wait()
                crc32_combine(1, 2, (1 << 40) - 1)  # all 40 operators

            threads = [threading.Thread(target=work) for _ in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            wrong.append(crc32_combine(crc32(a), crc32(b), len(b)) != reference)
            wrong.append(len(checksum._ZERO_BYTES) != 40)
    finally:
        sys.setswitchinterval(interval)
        checksum._ZERO_BYTES.clear()
    assert not any(wrong)


def test_pipelined_put_array_records_the_crc_of_the_file(store: Store, root: Path) -> None:
    big = np.random.default_rng(1).random((48 << 20) // 8)  # 48 MiB: written in pipelined pieces
    store.put_array("big", big)
    strided = np.arange(6 << 20, dtype=np.int64).reshape(-1, 4)[:, ::2]  # copied in row chunks
    store.put_array("strided", strided)
    fortran = np.asfortranarray(np.arange(12.0).reshape(3, 4))
    store.put_array("fortran", fortran)
    for key, expected in (("big", big), ("strided", strided), ("fortran", fortran)):
        assert _recorded_matches_file(store, root, key)
        assert store.verify(key)
        np.testing.assert_array_equal(store.open_array(key), expected)
