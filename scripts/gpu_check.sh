#!/usr/bin/env bash
# GPU-direct checks on a GPU machine (issue 20), run from the repository root:
#   PYTHONUNBUFFERED=1 OUT=/some/dir bash scripts/gpu_check.sh    (OUT defaults to ./gpu-out)
# Installs shmcache editable (no dependencies: numpy and torch with CUDA are expected;
# nvidia-ml-py is used if present), then, writing each output under $OUT:
#   1. the machine (nvidia-smi, torch, ulimit -l) and doctor's gpu check
#   2. the `gpu`-marked tests, and the GPULoader tests on CPU
#   3. ls / top --once / doctor while a process pins an entry (the CUDA PINS and GPU columns),
#      and watch's gpu column over a process holding 256 MiB on the GPU
#   4. scripts/bench_gpu.py (1 GiB entries; QUICK=1: 256 MiB): transfer, random batches,
#      4 processes pinning one entry (PSS)
#   5. scripts/grid_search.py --loader gpu -n 4: the GPULoader epoch vs the DataLoader's
# About 4-6 minutes on one H100 (QUICK=1: less); each step has its own timeout (650 s in all
# at worst: give the call timeout_s=600 and look at what came back under $OUT).
set -u
OUT="${OUT:-./gpu-out}"
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || {
    echo "pip install failed: see $OUT/pip.log"; tail -20 "$OUT/pip.log"; exit 1; }
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
    python3 -c "import pynvml; print('nvidia-ml-py (pynvml) installed')" 2>&1 | tail -1
    echo "ulimit -l: $(ulimit -l)"
    echo "doctor's gpu check:"
    python3 -c "from shmcache._diagnose.gpu import gpu_report; print(gpu_report())"
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_gpu_cuda.py 2>&1 | tee "$OUT/pytest-gpu.txt"
tests_rc=${PIPESTATUS[0]}
# the CLI's own dependencies (typer, psutil) may be missing on a bare GPU machine (--no-deps)
cli=1
python3 -c "import typer, psutil" 2>/dev/null || { cli=0; echo "no typer/psutil: CLI steps skipped" | tee "$OUT/cli-skipped.txt"; }
pins_tests=""
[ "$cli" = 1 ] && pins_tests="tests/test_gpu_pins.py"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_loader.py $pins_tests 2>&1 \
    | tee "$OUT/pytest-loader.txt"
loader_rc=${PIPESTATUS[0]}
# 3. what ls, top and doctor show while a process pins an entry
ROOT="$(mktemp -d /dev/shm/gpu-check-XXXXXX)"
[ "$cli" = 1 ] && timeout 90 python3 - "$ROOT" >"$OUT/ls-top.txt" 2>&1 <<'EOF'
import subprocess, sys
import numpy as np, shmcache
root = sys.argv[1]
shmcache.put_array("feats", np.ones((1 << 16, 256), np.float32), root=root)
holder = subprocess.Popen(
    [sys.executable, "-c", "import sys, shmcache.torch as st; v = st.cuda_view('feats', root=sys.argv[1]);"
     " print(v.sum().item(), flush=True); sys.stdin.read()", root],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
print("holder read", holder.stdout.readline().strip())
for command in (["ls"], ["top", "--once"], ["doctor"]):
    done = subprocess.run([sys.executable, "-m", "shmcache", *command, "--root", root], capture_output=True, text=True)
    print(f"$ shmcache {' '.join(command)} (rc {done.returncode})\n{done.stdout}{done.stderr}")
holder.communicate("")
# watch's gpu column and GPU panel (filled where nvidia-ml-py is installed)
out = sys.argv[1] + "-watch"
grab = "import time, torch; x = torch.empty(256 << 20, dtype=torch.uint8, device='cuda'); time.sleep(3)"
done = subprocess.run([sys.executable, "-m", "shmcache", "watch", "--interval", "0.5", "--out", out, "--",
                       sys.executable, "-c", grab], capture_output=True, text=True)
print(f"$ shmcache watch -- (256 MiB on the GPU for 3 s) (rc {done.returncode})\n{done.stderr}")
import glob, shutil
for path in glob.glob(out + "/*.csv"):
    print(open(path).read().splitlines()[-1])
shutil.rmtree(out, ignore_errors=True)
EOF
show_rc=$?
[ "$cli" = 1 ] || show_rc=0
rm -rf "$ROOT"
[ -f "$OUT/ls-top.txt" ] && cat "$OUT/ls-top.txt"
quick=""
[ "${QUICK:-0}" = "1" ] && quick="--quick"
timeout 200 python3 scripts/bench_gpu.py $quick --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.txt"
bench_rc=${PIPESTATUS[0]}
timeout 120 python3 scripts/grid_search.py --loader gpu --experiments 4 $quick 2>&1 | tee "$OUT/grid_search.txt"
grid_rc=${PIPESTATUS[0]}
echo "gpu tests rc=$tests_rc, loader tests rc=$loader_rc, ls/top rc=$show_rc, bench_gpu rc=$bench_rc," \
    "grid_search rc=$grid_rc" | tee "$OUT/summary.txt"
[ "$tests_rc" = 0 ] && [ "$loader_rc" = 0 ] && [ "$show_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$grid_rc" = 0 ]
