#!/usr/bin/env python
"""Run every benchmark in ``scripts/``, each in its own subprocess, and summarize every
DESIGN.md performance target in one table and one ``summary.json``.

Each benchmark's output streams through and is also kept in ``<out>/<name>.log``; its
JSON (where it writes one) in ``<out>/<name>.json``; its plots under ``<out>``. The
exit status is 0 unless a benchmark crashed: timings never fail a run (CI runs
``--quick``). Every benchmark runs with a throwaway root of this run as its default root and
none of the caller's ``SHMCACHE_*`` settings: a daemon serving the user's own root is never
used or touched (``grid_search.py --root`` run directly measures through a daemon). Usage::

    python scripts/bench_all.py [--quick] [--out DIR] [--only a,b] [--skip a,b]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from _benchlib import Target, environment, mark, markdown_table

SCRIPTS = Path(__file__).resolve().parent
Parser = Callable[[str, dict[str, Any] | None], list[Target]]


@dataclass
class Step:
    name: str
    script: str
    args: list[str] = field(default_factory=list)
    json: bool = True
    """Whether the script takes ``--json PATH``."""
    out: bool = False
    """Whether the script takes ``--out DIR`` (plots)."""
    quick_flag: bool = True


# ---------------------------------------------------------------------- target extraction


def _from_own_report(_: str, report: dict[str, Any] | None) -> list[Target]:
    """Scripts that write ``--json``: the report carries their targets."""
    if report is None:
        return []
    return [Target(**t) for t in report.get("targets", [])]


def _from_grid_search(stdout: str, _: dict[str, Any] | None) -> list[Target]:
    targets: list[Target] = []
    cost = re.search(r"the data costs ([\d.]+)x of one copy across (\d+) processes", stdout)
    if cost:
        value = float(cost.group(1))
        targets.append(
            Target(
                "total PSS of the shared entry, 4 experiments x 4 workers <= 1.1x its size",
                f"grid search: PSS of the cache's pages over {cost.group(2)} processes / data size",
                value,
                f"{value:.2f}x (N copies: 4x)",
                value <= 1.1,
            )
        )
    total = re.search(
        r"total PSS ([\d,.]+) MiB vs ([\d,.]+) MiB with a copy per experiment: ([\d.]+)x", stdout
    )
    if total:
        value = float(total.group(3))
        targets.append(
            Target(
                "(information) total PSS of all processes vs a copy per experiment",
                f"grid search: {total.group(1)} MiB vs {total.group(2)} MiB",
                value,
                f"{value:.2f}x",
                None,
            )
        )
    return targets


def _from_api(stdout: str, _: dict[str, Any] | None) -> list[Target]:
    targets: list[Target] = []
    p99 = re.search(r"\| latency p99 \| ([\d.]+) ms \|", stdout)
    if p99:
        value = float(p99.group(1))
        targets.append(
            Target("control API p99 < 10 ms, 64 clients", "latency p99", value, f"{value:.2f} ms", value < 10)
        )
    rss = re.search(r"\| daemon RSS after \| ([\d.]+) MiB \|.*\(([+-][\d.]+)%\)", stdout)
    before = re.search(r"\| daemon RSS before \| ([\d.]+) MiB \|", stdout)
    ops = re.search(r"^(\d+) operations", stdout, re.MULTILINE)
    if rss:
        growth = float(rss.group(2)) / 100
        row = f"daemon RSS over {ops.group(1) if ops else '?'} operations"
        text = f"{before.group(1) if before else '?'} -> {rss.group(1)} MiB ({growth:+.1%})"
        targets.append(Target("daemon memory flat (growth < 5%)", row, growth, text, growth < 0.05))
    return targets


PARSERS: dict[str, Parser] = {
    "bench_attach": _from_own_report,
    "bench_cow_fork": _from_own_report,
    "bench_cow_spawn": _from_own_report,
    "bench_cow_forkserver": _from_own_report,
    "grid_search": _from_grid_search,
    "bench_spawn": _from_own_report,
    "bench_loader": _from_own_report,
    "bench_load": _from_own_report,
    "bench_ingest": _from_own_report,
    "bench_ingest_formats": _from_own_report,
    "bench_remote": _from_own_report,
    "bench_api": _from_api,
    "bench_gpu": _from_own_report,
    "soak_api": _from_own_report,
    "bench_team": _from_own_report,
}


def steps() -> list[Step]:
    found = [
        Step("bench_attach", "bench_attach.py"),
        Step("bench_cow_fork", "bench_cow.py", ["--start-method", "fork"], out=True),
        Step("bench_cow_spawn", "bench_cow.py", ["--start-method", "spawn"], out=True),
        Step("bench_cow_forkserver", "bench_cow.py", ["--start-method", "forkserver"], out=True),
        Step("grid_search", "grid_search.py", json=False),
        Step("bench_spawn", "bench_spawn.py", out=True),
        Step("bench_loader", "bench_loader.py", out=True),
        Step("bench_load", "bench_load.py"),
        Step("bench_ingest", "bench_ingest.py"),
        Step("bench_ingest_formats", "bench_ingest_formats.py"),
        Step("bench_remote", "bench_remote.py"),
        Step("bench_api", "bench_api.py", json=False),
        Step("bench_gpu", "bench_gpu.py"),  # "no GPU" in 2 s without one
        Step("soak_api", "soak_api.py"),
        Step("bench_team", "bench_team.py"),
    ]
    return [s for s in found if (SCRIPTS / s.script).exists()]


# ---------------------------------------------------------------------- running


def isolated_env(root: Path) -> dict[str, str]:
    """The environment of every benchmark: none of the caller's ``SHMCACHE_*`` settings and
    ``root`` as the default root, so no benchmark reaches the user's own cache or daemon."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMCACHE_")}
    return env | {"SHMCACHE_ROOT": str(root)}


def run_step(
    step: Step, quick: bool, out: Path, timeout: float | None, env: dict[str, str]
) -> dict[str, Any]:
    command = [sys.executable, str(SCRIPTS / step.script), *step.args]
    if quick and step.quick_flag:
        command.append("--quick")
    json_path = out / f"{step.name}.json"
    if step.json:
        json_path.unlink(missing_ok=True)
        command += ["--json", str(json_path)]
    if step.out:
        command += ["--out", str(out)]
    print(f"\n=== {step.name}: {' '.join(command[1:])}", flush=True)
    started = time.perf_counter()
    lines: list[str] = []
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert process.stdout is not None
    deadline = None if timeout is None else started + timeout
    for line in process.stdout:  # stream, and keep for parsing
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line)
        if deadline is not None and time.perf_counter() > deadline:
            process.kill()
            break
    try:
        returncode = process.wait(
            timeout=None if deadline is None else max(1.0, deadline - time.perf_counter())
        )
    except subprocess.TimeoutExpired:
        process.kill()
        returncode = process.wait()
    elapsed = time.perf_counter() - started
    stdout = "".join(lines)
    (out / f"{step.name}.log").write_text(stdout)
    report: dict[str, Any] | None = None
    if step.json and json_path.exists():
        with open(json_path) as fp:
            report = json.load(fp)
    try:
        targets = PARSERS[step.name](stdout, report) if returncode == 0 else []
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:  # a changed report format
        print(f"!! could not read the targets of {step.name}: {type(exc).__name__}: {exc}", flush=True)
        targets = []
    return {
        "name": step.name,
        "command": ["python", f"scripts/{step.script}", *command[2:]],
        "returncode": returncode,
        "elapsed_s": elapsed,
        "json": str(json_path) if report is not None else None,
        "log": str(out / f"{step.name}.log"),
        "targets": [asdict(t) for t in targets],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="every benchmark in its CI size")
    parser.add_argument(
        "--out", type=Path, default=Path("bench-results"), help="logs, JSON, plots, summary.json"
    )
    parser.add_argument("--only", default="", help="comma-separated benchmark names to run")
    parser.add_argument("--skip", default="", help="comma-separated benchmark names to leave out")
    parser.add_argument("--timeout", type=float, help="seconds allowed to each benchmark")
    args = parser.parse_args(argv)
    only = {n for n in args.only.split(",") if n}
    skip = {n for n in args.skip.split(",") if n}
    selected = [s for s in steps() if (not only or s.name in only) and s.name not in skip]
    missing = only - {s.name for s in steps()}
    if missing:
        parser.error(f"unknown benchmarks {sorted(missing)}; known: {[s.name for s in steps()]}")
    args.out.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = Path(tempfile.mkdtemp(prefix="shmcache-bench-root-", dir=base))  # 0700, ours
    try:
        env = isolated_env(root)
        results = [run_step(step, args.quick, args.out, args.timeout, env) for step in selected]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    elapsed = time.perf_counter() - started

    rows: list[list[object]] = []
    for result in results:
        if result["returncode"] != 0:
            rows.append(["(crashed)", result["name"], f"exit status {result['returncode']}", "", "✗"])
        for t in result["targets"]:
            measured = t["measured_text"] + (f" ({t['note']})" if t.get("note") else "")
            rows.append([t["target"], result["name"], t["row"], measured, mark(t["ok"])])
    print(f"\n=== summary ({'quick' if args.quick else 'full'}, {elapsed:.0f} s)\n")
    if args.quick:
        print(QUICK_NOTE + "\n")
    ok_column = "at this size" if args.quick else "ok"
    print(markdown_table(["target (DESIGN.md)", "benchmark", "row", "measured", ok_column], rows))
    checked = [t for r in results for t in r["targets"] if t["ok"] is not None]
    crashed = [r["name"] for r in results if r["returncode"] != 0]
    print(
        "\n"
        + verdict_line(sum(bool(t["ok"]) for t in checked), len(checked), args.quick)
        + (f"; crashed: {', '.join(crashed)}" if crashed else "")
        + "\n"
        + "\n".join(f"- {r['name']}: {r['elapsed_s']:.0f} s" for r in results)
    )
    summary = {
        "quick": args.quick,
        "environment": environment() | _versions(),
        "elapsed_s": elapsed,
        "benchmarks": results,
    }
    with open(args.out / "summary.json", "w") as fp:
        json.dump(summary, fp, indent=1)
    print(f"\nsummary: {args.out / 'summary.json'}")
    return 1 if crashed else 0


QUICK_NOTE = (
    "Quick sizes do not judge the targets: they check that every benchmark runs. At these sizes "
    "fixed costs (process start, imports, thread start-up) weigh more than at full size, so a ✗ "
    "below is not a miss. The targets are judged at full size: BENCHMARKS.md has the latest full "
    "numbers (python scripts/bench_all.py reproduces them)."
)


def verdict_line(met: int, checked: int, quick: bool) -> str:
    """The closing count; in the quick size, said so that a ✗ does not read as a failure."""
    if quick:
        return (
            f"{met}/{checked} rows reached their target at the quick size (not a verdict: "
            "full-size results are in BENCHMARKS.md)"
        )
    return f"{met}/{checked} targets met"


def _versions() -> dict[str, str]:
    """numpy/torch/shmcache versions, read in a subprocess (this runner imports none of them)."""
    code = (
        "import json, numpy, shmcache\n"
        "try:\n import torch; t = torch.__version__\nexcept ImportError:\n t = None\n"
        "print(json.dumps({'numpy': numpy.__version__, 'torch': t, 'shmcache': shmcache.__version__}))"
    )
    try:
        output = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
        versions: dict[str, str] = json.loads(output)
        return versions
    except (subprocess.CalledProcessError, json.JSONDecodeError):
        return {}


if __name__ == "__main__":
    sys.exit(main())
