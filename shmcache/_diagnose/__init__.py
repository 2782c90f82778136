"""Diagnosis behind ``shmcache doctor``, ``top`` and ``watch``: why memory is where it is,
and whether it grows.

- ``procfs``: the one reader of a process's memory (``/proc/PID/smaps``) and process trees
- ``growth``: the verdict on a sampled series (robust slope, thresholds)
- ``doctor``: the environment checks
- ``top``: processes that map cache entries
- ``watch``: the CSV/plot recorder of a process tree
- ``gpu``: doctor's GPU check; ``nvml``: GPU memory per process (the ``gpu`` extra)

Only the CLI (and benchmark scripts) import these modules; ``import shmcache`` never does.
They import the core only, and psutil/matplotlib/httpx lazily where needed.
"""

from __future__ import annotations

__all__: list[str] = []
