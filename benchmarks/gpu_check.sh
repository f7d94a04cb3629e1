#!/usr/bin/env bash
# One call on a bare GPU machine: build the CUDA extension, run the GPU tests of both GPU backends,
# run the benchmarks, and write everything under $OUT. The summary table is printed last.
#
#   OUT=/some/empty/dir bash benchmarks/gpu_check.sh
#
# Stages are time-boxed (one hang must not eat the device budget; whole run < 8 min on an H200):
#   build 200 s, GPU tests 150 s, benchmarks what is left of 420 s (>= 100 s, + 30 s grace), plot 20 s.
# Exit status: 2 = no GPU; otherwise 0 only if every stage passed.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$(pwd)/benchmarks/results/gpu_check_$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT"
PY="${PYTHON:-$(command -v python || command -v python3)}"
LOG="$OUT/gpu_check.log"
: > "$LOG"
say() { echo "[gpu_check $(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }

probe=$("$PY" - 2>&1 <<'PYEOF'
try:
    import torch
except Exception as e:
    print(f"torch is not importable with this python ({type(e).__name__}: {e}); set PYTHON=/path/to/python")
    raise SystemExit(1)
if not torch.cuda.is_available():
    print(f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)")
    raise SystemExit(1)
PYEOF
)
if [ $? -ne 0 ]; then
    say "no GPU: ${probe:-the python probe failed}. This script needs a CUDA device; nothing was run."
    exit 2
fi
export PYTHONPATH="$(pwd):$(pwd)/python_api${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch; print('device:', torch.cuda.get_device_name(), '| torch', torch.__version__, '| CUDA', torch.version.cuda)" | tee -a "$LOG"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$LOG"

status=0
stage() {  # stage NAME SECONDS LOGFILE CMD...
    local name=$1 limit=$2 logf=$3; shift 3
    local t0=$SECONDS
    say "stage $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$logf" 2>&1
    local rc=$?
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        say "stage $name TIMED OUT after ${limit}s (log: $logf)"
        status=1
    elif [ $rc -ne 0 ]; then
        say "stage $name FAILED rc=$rc after $((SECONDS - t0))s (log: $logf); last lines:"
        tail -n 15 "$logf" | tee -a "$LOG"
        status=1
    else
        say "stage $name ok in $((SECONDS - t0))s"
    fi
    return $rc
}

# Build: Hopper only saves half the nvcc time on an H200; override GEMMA4_MTP_CUDA_ARCHS elsewhere.
export MAX_JOBS="${MAX_JOBS:-16}" GEMMA4_MTP_CUDA_ARCHS="${GEMMA4_MTP_CUDA_ARCHS:-90a}"
stage build 200 "$OUT/build.log" "$PY" setup.py build_ext --inplace
"$PY" -c "import gemma4_mtp_kernels as g; [print(f'{k:7s} {v.available!s:5s} {v.detail}') for k, v in g.available_backends().items()]" 2>&1 | tee -a "$LOG"

tests=$(ls tests/*_cuda.py tests/*_triton.py 2>/dev/null | tr '\n' ' ')
if [ -n "$tests" ]; then
    stage gpu-tests 150 "$OUT/pytest_gpu.log" "$PY" -m pytest -q -m gpu -p no:cacheprovider \
        --junitxml="$OUT/pytest_gpu.xml" $tests
    tail -n 3 "$OUT/pytest_gpu.log" | tee -a "$LOG"
else
    say "no tests/*_cuda.py or tests/*_triton.py files: GPU tests skipped"
fi

# The benchmarks get what the build and tests left of ~7 min (at least 100 s). run_all stops starting
# new cases after its budget (an equal share per op) and records the rest as "not run"; the JSON is
# rewritten after every case, so even a kill leaves the finished cases.
budget=$(( 420 - SECONDS )); [ $budget -lt 100 ] && budget=100
stage benchmarks $(( budget + 30 )) "$OUT/benchmarks.log" "$PY" -m benchmarks.run_all --out "$OUT/results.json" \
    --time-budget $budget
if [ -f "$OUT/results.json" ]; then
    if "$PY" -c "import matplotlib" 2>/dev/null; then
        stage plot 20 "$OUT/plot.log" "$PY" -m benchmarks.plot "$OUT/results.json" "$OUT/roofline.png"
    else
        say "matplotlib is not installed: no roofline.png (draw it later: python -m benchmarks.plot results.json out.png)"
    fi
    "$PY" -m benchmarks.run_all --table "$OUT/results.json" > "$OUT/summary.txt" 2>&1
fi
say "done in ${SECONDS}s, status $status; files in $OUT"
[ -f "$OUT/summary.txt" ] && cat "$OUT/summary.txt"
exit $status
