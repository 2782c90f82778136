"""Blobs entries from URLs: the entry a local put makes of the same files, read from objects.

- A prefix holding no array or table objects (a folder of images, texts...), or any prefix
  with ``as_="blobs"``: every object a blob named by its path under the prefix, as a local
  directory's files are (``blobs``).
- WebDataset ``.tar`` shards: a ``.tar`` object, or a brace pattern or glob of them
  (``s3://b/shards/{000..099}.tar``): every member a blob, names kept. The member headers
  are parsed by ``tar_shards``' own reader (the same checks: truncated archives, names, links,
  compressed shards, a name twice...) over ranged reads of the object; the members are then
  fetched by ranged reads (neighbouring small members in one request of up to ``_PART``
  bytes) and written with ``pwrite`` at their offsets of ``bytes.npy``: never extracted,
  never a local copy of a shard.

Parts arrive in any order; the CRC-32 recorded for ``verify`` is computed in order behind
them. Every object is looked up again after the fetch: one whose size or ETag changed fails
the load and nothing is published.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from .._disk.checksum import TrailingCrc
from .._disk.fs import full_is_cache_full
from .blobs import BlobSources, Progress, _check_name, _names_arrays
from .remote import DEFAULT_WORKERS, IN_FLIGHT_BYTES, check_objects_unchanged
from .remote_parts import ByteBudget, read_range
from .remote_plan import RemoteItem, RemotePlan
from .tar_shards import check_shard_name, collect_members, read_members

__all__ = ["plan_remote_blobs"]

_PART = 8 << 20
"""Bytes per ranged read: a big member in several, neighbouring small ones in one."""
_GAP = 64 << 10
"""Bytes between two members (headers, padding) read rather than split into two requests."""
_HEADER_BLOCK = 1 << 20
"""Bytes per ranged read of the member headers (read ahead: small members' headers are close)."""


def plan_remote_blobs(plan: RemotePlan, what: str) -> BlobSources:
    """The blobs entry of ``plan``'s objects (items of kind ``blob`` or ``shard``), checked:
    names, sizes, and for shards every member header."""
    objects = plan.items
    if objects[0].kind == "shard":
        for obj in objects:
            check_shard_name(obj.url)
        shards = ((obj.url, read_members(_reader(plan, obj), obj.size, obj.url)) for obj in objects)
        names, sizes, spans, owners = collect_members(shards, what)
    else:
        names = [_check_name(obj.member, obj.url) for obj in objects]
        sizes = [obj.size for obj in objects]
        spans, owners = [0] * len(objects), list(range(len(objects)))
    source = BlobSources(plan.url, names, sizes, None, None, _names_arrays(names, sizes, what))
    source.fetch = _Fetch(plan, owners, spans, sizes).run
    return source


def _reader(plan: RemotePlan, obj: RemoteItem) -> Any:
    """``read(n, offset)`` of ``obj``, by ranged reads of ``_HEADER_BLOCK`` kept one at a time
    (the headers of a shard are read in order)."""
    cached = [-1, b""]

    def read(nbytes: int, offset: int) -> bytes:
        start = int(cached[0])  # type: ignore[call-overload]
        block = cached[1]
        assert isinstance(block, bytes)
        if start < 0 or offset < start or offset + nbytes > start + len(block):
            end = min(obj.size, offset + max(nbytes, _HEADER_BLOCK))
            block = bytes(read_range(plan.fs, obj, offset, end, plan.secrets))
            cached[0], cached[1], start = offset, block, offset
        return block[offset - start : offset - start + nbytes]

    return read


class _Fetch:
    """The blobs fetched into ``bytes.npy``: tasks of one ranged read each, written at their
    offsets; the CRC advanced over the prefix of the file that is complete."""

    def __init__(self, plan: RemotePlan, owners: list[int], spans: list[int], sizes: list[int]) -> None:
        self.plan = plan
        self.tasks: list[tuple[int, int, int, list[tuple[int, int, int]]]] = []
        """``(object, read start, read end, [(start in the read, length, offset in the file)])``."""
        out = 0
        for owner, span, size in zip(owners, spans, sizes, strict=True):
            last = self.tasks[-1] if self.tasks else None
            if (
                last is not None
                and last[0] == owner
                and 0 <= span - last[2] <= _GAP
                and span + size - last[1] <= _PART
            ):
                copies = last[3] + [(span - last[1], size, out)]
                self.tasks[-1] = (owner, last[1], span + size, copies)
            else:
                for lo in range(0, size, _PART):  # a big member: several reads (an empty one: none)
                    length = min(_PART, size - lo)
                    self.tasks.append((owner, span + lo, span + lo + length, [(0, length, out + lo)]))
            out += size
        self.total = out
        self.lock = threading.Lock()
        self.finished: dict[int, int] = {}
        self.frontier = self.copied = 0

    def run(self, dst: int, base: int, target: Path, crc: TrailingCrc, progress: Progress | None) -> None:
        budget = ByteBudget(IN_FLIGHT_BYTES)
        stop = threading.Event()

        def fetch(task: tuple[int, int, int, list[tuple[int, int, int]]]) -> None:
            owner, start, end, copies = task
            if stop.is_set():
                return
            obj = self.plan.items[owner]
            with budget.holding(end - start):
                data = read_range(self.plan.fs, obj, start, end, self.plan.secrets)
                view = memoryview(data)
                with full_is_cache_full(target):
                    for at, length, out in copies:
                        part = view[at : at + length]
                        while part:
                            written = os.pwrite(dst, part, base + out)
                            part, out = part[written:], out + written
            first, last = copies[0], copies[-1]
            self._done(first[2], last[2] + last[1], crc, progress)

        workers = max(1, min(DEFAULT_WORKERS, len(self.tasks)))
        with ThreadPoolExecutor(workers, thread_name_prefix="shmcache-blobs") as pool:
            futures = [pool.submit(fetch, task) for task in self.tasks]
            wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f for f in futures if f.done() and f.exception() is not None), None)
            if failed is not None:
                stop.set()
                for future in futures:
                    future.cancel()
                raise failed.exception()  # type: ignore[misc]
        if self.frontier != self.total:  # every task ran, so this is a bug
            raise RuntimeError(f"{target}: wrote {self.frontier} of {self.total} bytes")
        check_objects_unchanged(self.plan, self.plan.items)

    def _done(self, start: int, end: int, crc: TrailingCrc, progress: Progress | None) -> None:
        if start == end:
            return
        with self.lock:
            self.finished[start] = end
            while self.frontier in self.finished and self.frontier < self.total:
                nxt = self.finished.pop(self.frontier)
                crc.advance(nxt - self.frontier)
                self.frontier = nxt
            self.copied += end - start
            if progress is not None:
                progress(self.copied, self.total)
