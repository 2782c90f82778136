"""``shmcache doctor``'s GPU check: the driver, CUDA as torch sees it, whether the GPU can
register host memory read-only (what ``shmcache.torch.pin`` needs), and ``ulimit -l``.

The core never imports torch: CUDA is asked about in a child Python that imports
``shmcache.torch``, and only where an NVIDIA driver and torch are installed. Without a
driver the check is one line, "no GPU".
"""

from __future__ import annotations

import importlib.util
import json
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["gpu_report"]

_PROBE = (
    "import json, torch, shmcache.torch as st\n"
    "ok = torch.cuda.is_available()\n"
    "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, 'available': ok,\n"
    "    'device': torch.cuda.get_device_name() if ok else None,\n"
    "    'read_only': st.read_only_registration_supported() if ok else None}))\n"
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


def gpu_report() -> tuple[str, str, str, dict[str, Any]]:
    """(status, summary, fix, details) of the GPU check."""
    memlock = _memlock()
    driver = _driver()
    details: dict[str, Any] = {"driver": driver, "memlock": memlock}
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
    summary = f"{found['device']}: {where}; read-only host registration works (pin, cuda_view, GPULoader)"
    return "ok", summary, "", details
