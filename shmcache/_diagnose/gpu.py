"""``shmcache doctor``'s GPU check: the driver, CUDA as torch sees it, whether the GPU can
register host memory read-only (what ``shmcache.torch.pin`` needs: the device attribute,
then a real read-only registration of a 64 MiB shared mapping, which a locked-memory limit
or a driver may refuse), ``ulimit -l`` (RLIMIT_MEMLOCK), and which live processes of the
root fell back to the pinned staging path, with the CUDA error each got (their
``pins/<pid>`` records).

The core never imports torch: CUDA is asked about in a child Python that imports
``shmcache.torch``, and only where an NVIDIA driver and torch are installed. Without a
driver the check is one line, "no GPU".
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from .._disk.pin_records import live_pins

__all__ = ["gpu_report"]

_PROBE = (
    "import json, mmap, numpy as np, torch, shmcache.torch as st\n"
    "from shmcache import _cuda\n"
    "ok = torch.cuda.is_available()\n"
    "ro = st.read_only_registration_supported() if ok else None\n"
    "error = None\n"
    "if ro:\n"
    "    size = 64 << 20\n"
    "    page = mmap.mmap(-1, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)\n"
    "    pointer = int(np.frombuffer(page, dtype=np.uint8).__array_interface__['data'][0])\n"
    "    dev = _cuda.cuda_device(None)\n"
    "    rc = _cuda._host_register(pointer, size, dev)\n"
    "    if rc == 0:\n"
    "        torch.cuda.cudart().cudaHostUnregister(pointer)\n"
    "    else:\n"
    "        error = _cuda.error_name(rc)\n"
    "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, 'available': ok,\n"
    "    'device': torch.cuda.get_device_name() if ok else None, 'read_only': ro,\n"
    "    'register_error': error}))\n"
)
_PROBE_TIMEOUT_S = 90.0
DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")


def _memlock() -> str:
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft // 1024} KiB"


def _driver() -> str | None:
    """The NVIDIA driver's version line, or None where there is no driver."""
    try:
        return DRIVER_VERSION_FILE.read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run(
            [smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def staged_pins(root: str | os.PathLike[str] | None) -> list[str]:
    """One phrase per live process of ``root`` whose CUDA registration failed (and which
    therefore copies through a pinned staging buffer), naming the CUDA error."""
    if root is None:
        return []
    phrases = []
    for pid, pins in sorted(live_pins(root).items()):
        failed = [pin for pin in pins if not pin.registered and pin.error]
        if failed:
            keys = ", ".join(sorted(pin.key for pin in failed)[:3]) + (", ..." if len(failed) > 3 else "")
            errors = ", ".join(sorted({pin.error for pin in failed}))
            phrases.append(f"process {pid} stages {len(failed)} entries ({keys}): {errors}")
    return phrases


def gpu_report(root: str | os.PathLike[str] | None = None) -> tuple[str, str, str, dict[str, Any]]:
    """(status, summary, fix, details) of the GPU check (``root``: whose pin records to read)."""
    memlock = _memlock()
    driver = _driver()
    staged = staged_pins(root)
    details: dict[str, Any] = {"driver": driver, "memlock": memlock, "staged": staged}
    if driver is None:
        return "ok", "no GPU (no NVIDIA driver)", "", details
    if importlib.util.find_spec("torch") is None:
        return "warn", f"driver {driver}; torch is not installed: no GPU-direct", "pip install torch", details
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S
        )
        found = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        found = None
    if found is None:
        return "warn", f"driver {driver}; asking torch about CUDA failed", "python -c 'import torch'", details
    details.update(found)
    where = f"driver {driver}, torch {found['torch']} (CUDA {found['cuda']}), ulimit -l {memlock}"
    if not found["available"]:
        fix = "install a CUDA build of torch; check nvidia-smi and CUDA_VISIBLE_DEVICES"
        return "warn", f"{where}: torch sees no CUDA device", fix, details
    if not found["read_only"]:
        summary = (
            f"{found['device']}: {where}; read-only host registration is NOT supported: "
            "GPULoader and to_cuda go through a pinned staging buffer, cuda_view is unavailable"
        )
        return "warn", summary, "a driver/GPU with cudaDevAttrHostRegisterReadOnlySupported", details
    if found.get("register_error"):
        summary = (
            f"{found['device']}: {where}; the device supports read-only host registration, but registering "
            f"a 64 MiB mapping failed with {found['register_error']}: pin, cuda_view and GPULoader fall back "
            "to a pinned staging buffer"
        )
        fix = "raise the locked-memory limit (ulimit -l unlimited, or memlock in limits.conf / the container)"
        return "warn", summary, fix, details
    summary = f"{found['device']}: {where}; read-only host registration works (pin, cuda_view, GPULoader)"
    if staged:
        summary += "; but " + "; ".join(staged) + " (pinned staging buffer instead)"
        return "warn", summary, "see the CUDA errors named; `ulimit -l`; the driver's log (dmesg)", details
    return "ok", summary, "", details
