#!/usr/bin/env python
"""Four users, one dataset: total memory with one shared (team) root vs a personal root
each, and the second user's time to first batch.

Team: the dataset is put once, through the root's daemon (the member fills the file the
daemon made), and every user's training read opens that one copy. Personal: every user
loads the dataset into a root of their own (``put_file`` from the same ``.npy`` source),
then reads it. Each reader runs a full pass of batches over the array (every page
touched), then waits until all four are done and reports its PSS of the cache's pages;
the sums are compared (target: team 1.0x the dataset, personal 4x). Time to first batch
is the second user's, from process start to its first batch: open only (team) vs load +
open (personal).

The four users are four processes of this user: other real users need a team declared in
the root-owned teams file (``docs/team.md``), which a benchmark should not write; the
memory and timings are the same (sharing is by file, not by uid). Usage::

    python scripts/bench_team.py [--quick] [--size-mib N] [--users 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np
from _benchlib import (
    Target,
    fmt_bytes,
    markdown_table,
    print_targets,
    read_memory,
    scratch_dir,
    serve,
    write_report,
)

MiB = 1 << 20
BATCH_ROWS = 4096
ROW = 1024  # float32 values per row: 4 KiB rows


def _reader(
    root: str, key: str, load_from: str | None, ready: Any, done: Any, results: Any, index: int, start: float
) -> None:
    """One user's training read: (load, when personal) open, first batch, a full pass; then
    report the PSS of the cache's pages while every reader still maps its data."""
    import shmcache

    if load_from is not None:
        shmcache.get_store(root).put_file(key, load_from)
    data = shmcache.open_array(key, root=root)
    first = float(data[:BATCH_ROWS].sum())  # the first batch
    first_batch_s = time.monotonic() - start
    total = first
    for i in range(BATCH_ROWS, data.shape[0], BATCH_ROWS):
        total += float(data[i : i + BATCH_ROWS].sum())
    ready.wait()  # every reader has read everything and still maps it
    memory = read_memory(os.getpid(), root)
    results.put((index, first_batch_s, memory.cache_pss if memory else 0, total))
    done.wait()


def _run(roots: list[str], key: str, load_from: str | None, users: int) -> dict[str, Any]:
    """``users`` readers, reader i on ``roots[i % len(roots)]``; the second starts after the
    first has read its first batch (a colleague starting on a warm cache)."""
    ctx = mp.get_context("fork")
    ready, done, results = ctx.Barrier(users + 1), ctx.Barrier(users + 1), ctx.Queue()
    processes = []
    for index in range(users):
        start = time.monotonic()
        process = ctx.Process(
            target=_reader,
            args=(roots[index % len(roots)], key, load_from, ready, done, results, index, start),
        )
        process.start()
        processes.append(process)
    ready.wait()
    rows = sorted(results.get(timeout=600) for _ in range(users))
    done.wait()
    for process in processes:
        process.join(60)
    return {
        "first_batch_s": [row[1] for row in rows],
        "cache_pss": [row[2] for row in rows],
        "pss_sum": sum(row[2] for row in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB instead of 2 GiB")
    parser.add_argument("--size-mib", type=int, default=None)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    size = (args.size_mib or (64 if args.quick else 2048)) * MiB
    began = time.monotonic()
    from shmcache._store.member_writes import MemberWriter

    rows = size // (ROW * 4)
    with scratch_dir("shmcache-bench-team-") as scratch:
        source = scratch / "dataset.npy"
        np.save(source, np.ones((rows, ROW), dtype=np.float32))
        nbytes = os.path.getsize(source)
        team_root = scratch / "team"
        with serve(team_root):
            put_start = time.monotonic()
            MemberWriter(team_root).put_file("dataset", source)  # once, through the daemon
            team_put_s = time.monotonic() - put_start
            team = _run([str(team_root)], "dataset", None, args.users)
        personal_roots = [str(scratch / f"user{i}") for i in range(args.users)]
        personal = _run(personal_roots, "dataset", str(source), args.users)
    team_x, personal_x = team["pss_sum"] / nbytes, personal["pss_sum"] / nbytes
    second_team, second_personal = team["first_batch_s"][1], personal["first_batch_s"][1]
    table = markdown_table(
        ("", "team root (one copy)", f"a personal root each ({args.users})"),
        [
            ("dataset", fmt_bytes(nbytes), fmt_bytes(nbytes)),
            ("PSS of the cache, all users", fmt_bytes(team["pss_sum"]), fmt_bytes(personal["pss_sum"])),
            ("x the dataset", f"{team_x:.2f}x", f"{personal_x:.2f}x"),
            (
                "2nd user's time to first batch",
                f"{second_team * 1000:.1f} ms",
                f"{second_personal * 1000:.1f} ms",
            ),
            ("the one put, through the daemon", f"{team_put_s:.2f} s", "-"),
        ],
    )
    print(f"{args.users} users (processes of one user, see the docstring), {fmt_bytes(nbytes)} dataset")
    print(table)
    targets = [
        Target(
            "A team: N users reading one dataset hold 1.0x its size, not Nx",
            f"{args.users} readers, PSS of the cache's pages / dataset size (team root)",
            team_x,
            f"{team_x:.2f}x (personal roots: {personal_x:.2f}x)",
            team_x <= 1.1,
        ),
        Target(
            "(information) 2nd user's time to first batch: team (open only) vs personal (load + open)",
            f"{fmt_bytes(nbytes)} dataset",
            second_team / second_personal if second_personal else 0.0,
            f"{second_team * 1000:.1f} ms vs {second_personal * 1000:.1f} ms",
            None,
        ),
    ]
    print_targets(targets)
    write_report(
        args.json,
        "bench_team",
        quick=args.quick,
        config={"size": nbytes, "users": args.users, "real_users": False},
        results={"team": team, "personal": personal, "team_put_s": team_put_s},
        targets=targets,
        elapsed_s=time.monotonic() - began,
    )


if __name__ == "__main__":
    main()
