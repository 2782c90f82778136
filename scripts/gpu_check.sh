#!/usr/bin/env bash
# GPU-direct checks on a GPU machine (issue 20), run from the repository root:
#   OUT=/some/dir bash scripts/gpu_check.sh        (OUT defaults to ./gpu-out)
# Installs shmcache editable (no dependencies: numpy and torch with CUDA are expected),
# runs the `gpu`-marked tests and scripts/bench_gpu.py (1 GiB entries; QUICK=1: 256 MiB), and writes
# their outputs, the machine's description and the exit codes under $OUT. ~2-4 minutes.
set -u
OUT="${OUT:-./gpu-out}"
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || {
    echo "pip install failed: see $OUT/pip.log"; tail -20 "$OUT/pip.log"; exit 1; }
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
    echo "ulimit -l: $(ulimit -l)"
    echo "doctor's gpu check:"
    python3 -c "from shmcache._diagnose.gpu import gpu_report; print(gpu_report())"
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_gpu_cuda.py 2>&1 | tee "$OUT/pytest-gpu.txt"
tests_rc=${PIPESTATUS[0]}
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_loader.py 2>&1 | tee "$OUT/pytest-loader.txt"
loader_rc=${PIPESTATUS[0]}
quick=""
[ "${QUICK:-0}" = "1" ] && quick="--quick"
timeout 300 python3 scripts/bench_gpu.py $quick --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.txt"
bench_rc=${PIPESTATUS[0]}
echo "gpu tests rc=$tests_rc, loader tests rc=$loader_rc, bench_gpu rc=$bench_rc" | tee "$OUT/summary.txt"
[ "$tests_rc" = 0 ] && [ "$loader_rc" = 0 ] && [ "$bench_rc" = 0 ]
