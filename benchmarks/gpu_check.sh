#!/usr/bin/env bash
# One call on a bare GPU machine: build the CUDA extension, run the whole GPU test suite (one pytest
# process per test file, so a crash is reported for its file and hides nothing else), run the main
# command on the GPU with every backend, run the op tests under compute-sanitizer memcheck, run the
# benchmarks, and write everything under $OUT. The summary is printed last.
#
#   OUT=/some/empty/dir bash benchmarks/gpu_check.sh
#
# Every stage is time-boxed so that one hang cannot eat the device budget (a device command may run
# 10 minutes, 600 s; with every box spent, kill grace included, the script ends by ~580 s): build 60 s,
# stage boundaries 60 s (~25 s: benchmarks/bench_stage_boundary.py, with the cluster modes), GPU suite
# 200 s (eight files at a time, each at most 120 s; 160 s measured at four on 2026-12-04), main command
# 110 s, the launch-configuration sweep at most 70 s while 120 s are left for the benchmarks after it
# (skipped under 30 s), the benchmarks what is left before 425 s (benchmarks/checklist.py's cases first: the
# open predictions, the step with the sweep's winners among them; skipped under 30 s; + 20 s grace), the
# hardware counters of a step's kernels (ncu) what is left before 490 s (at most 60 s, skipped under 25 s),
# step profile 40 s, decode profile 40 s, memcheck what is left before 560 s (at most 60 s, skipped under
# 20 s), the summary table, the plot 20 s if it can start by 560 s. On 2026-12-04 the benchmarks got 94 s,
# which timed two drafter steps and none of the rounds; with the suite eight files at a time the sweep should
# get its 70 s and the benchmarks ~105-125. The Hugging Face assisted-generation benchmark runs by hand
# (python -m benchmarks.bench_hf_assisted), and the whole sweep (~150 s) in a second device call:
#   PYTHONPATH=$PWD python -m benchmarks.tune_launch_configs --out $OUT/tune.json --tuned-out $OUT/tuned.json \
#       --time-budget 150 --jobs 16
# Exit status: 2 = no GPU; otherwise 0 only if every stage passed.
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python || command -v python3)}"
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
    echo "[gpu_check] no GPU: ${probe:-the python probe failed}. This script needs a CUDA device; nothing was run."
    exit 2
fi
OUT="${OUT:-$(pwd)/benchmarks/results/gpu_check_$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: > "$LOG"
say() { echo "[gpu_check $(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
export PYTHONPATH="$(pwd):$(pwd)/python_api${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch; print('device:', torch.cuda.get_device_name(), '| torch', torch.__version__, '| CUDA', torch.version.cuda)" | tee -a "$LOG"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$LOG"
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || echo unknown > "$OUT/commit.txt"
git status --porcelain > "$OUT/dirty.txt" 2>/dev/null

status=0
describe_rc() {  # how a command ended, from its exit status
    case $1 in
        0) echo "ok" ;;
        124|137) echo "TIMED OUT" ;;
        139) echo "CRASHED (segmentation fault)" ;;
        134) echo "CRASHED (abort)" ;;
        5) echo "no tests selected" ;;
        *) echo "FAILED rc=$1" ;;
    esac
}
stage() {  # stage NAME SECONDS LOGFILE CMD...
    local name=$1 limit=$2 logf=$3; shift 3
    local t0=$SECONDS
    say "stage $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$logf" 2>&1
    local rc=$?
    if [ $rc -ne 0 ]; then
        say "stage $name $(describe_rc $rc) after $((SECONDS - t0))s (log: $logf); last lines:"
        tail -n 15 "$logf" | tee -a "$LOG"
        status=1
    else
        say "stage $name ok in $((SECONDS - t0))s"
    fi
    return $rc
}

# Build: Hopper only halves the nvcc time on an H200; override GEMMA4_MTP_CUDA_ARCHS elsewhere.
export MAX_JOBS="${MAX_JOBS:-16}" GEMMA4_MTP_CUDA_ARCHS="${GEMMA4_MTP_CUDA_ARCHS:-90a}"
stage build 60 "$OUT/build.log" "$PY" setup.py build_ext --inplace
"$PY" -c "import gemma4_mtp_kernels as g; [print(f'{k:7s} {v.available!s:5s} {v.detail}') for k, v in g.available_backends().items()]" 2>&1 | tee -a "$LOG"

# Stage boundaries while the GPU is otherwise idle: a launch, PDL and a grid barrier again (8 and 132
# programs, the same run's reference) against one cluster of 2-16 programs (a cluster barrier over global
# or distributed shared memory, or stores pushed between its SMs), what 1-132 SMs stream from L2 and DRAM,
# E2B layers' GEMVs, whole sliding layers and the step's 21 stages in one cluster (the shapes from
# drafter_shapes): what decides whether a drafter step in one cluster is worth writing (benchmarks/README.md,
# "A drafter step in one cluster"); and 31B's and E2B's glue GEMVs each on 64 and 128 SMs from a ring of bulk
# copies, L2 cold: what a rewrite of the glue's weight path would reach ("31B's GEMVs from a ring of bulk
# copies"); E2B's full-layer attention at 8K and 32K and 31B's full (8K) and sliding layers the same way, merged
# in clusters, on the CUDA cores and on tensor cores ("Full attention from a ring of bulk copies", "31B's
# attention from a ring of bulk copies"). ~35 s (its own nvcc build for 90a, ~60 chains of a few ms, ~1 GiB of
# stream buffers filled on the host, 0.5-32 MiB weights for the GEMVs, 16-64 MiB caches and their float64
# attention, 16 attention rows).
# Stopped by its own --time-limit before the box: a row that hangs costs only itself and the rows after it
# (stage_boundary.json keeps the rows before, "cut_short_in" names it).
stage stage-boundary 60 "$OUT/stage_boundary.log" "$PY" -m benchmarks.bench_stage_boundary \
    --out "$OUT/stage_boundary.json" --time-limit 52 \
    --args "programs=8,132 cluster_programs=2,4,8,16 stream_programs=1,8,16,132 wide_programs=64,128 \
attention_programs=64,128"

# The GPU suite: every test file's GPU-marked tests, one pytest process per file. A fatal error (a
# segmentation fault, an illegal address that poisons the context) ends only its own file. Eight files
# run at a time (2 CPU threads each), the longest first by the newest committed run's times
# (benchmarks.gpu_suite --order; files it did not time first): a bare machine compiles every Triton
# kernel a test launches, one compile after another in each process, so the suite is CPU-bound on a
# few cores. On 2026-12-04 four at a time took 160 s for 495 s of files (the longest 64 s), 22 files
# now; eight, the longest first, should end soon after the longest (~75-100 s).
mkdir -p "$OUT/pytest"
suite_t0=$SECONDS
: > "$OUT/gpu_suite.txt"
gpu_files=$(grep -l "mark.gpu" tests/test_*.py)
suite_files=$("$PY" -m benchmarks.gpu_suite --order $gpu_files 2>> "$LOG") || suite_files=$gpu_files
for f in $suite_files; do
    name=$(basename "$f" .py)
    while [ "$(jobs -rp | wc -l)" -ge 8 ]; do wait -n; done
    left=$(( 200 - (SECONDS - suite_t0) ))
    if [ $left -lt 10 ]; then
        continue  # reported as not run below
    fi
    [ $left -gt 120 ] && left=120
    (
        OMP_NUM_THREADS=2 timeout --kill-after=5 $left "$PY" -m pytest -q -m gpu -p no:cacheprovider \
            -o faulthandler_timeout=60 --junitxml="$OUT/pytest/$name.xml" "$f" > "$OUT/pytest/$name.log" 2>&1
        echo $? > "$OUT/pytest/$name.rc"
    ) &
done
wait
for f in $suite_files; do
    name=$(basename "$f" .py)
    if [ ! -f "$OUT/pytest/$name.rc" ]; then
        echo "$name not run (suite time box spent)" >> "$OUT/gpu_suite.txt"
        status=1
        continue
    fi
    rc=$(cat "$OUT/pytest/$name.rc")
    echo "$name $(describe_rc $rc): $(tail -n 1 "$OUT/pytest/$name.log")" >> "$OUT/gpu_suite.txt"
    [ $rc -ne 0 ] && status=1
done
say "GPU suite done in $((SECONDS - suite_t0))s:"
tee -a "$LOG" < "$OUT/gpu_suite.txt"
# the verdict per (op, backend) that benchmarks.make_verified reads next to results.json
"$PY" -m benchmarks.gpu_suite "$OUT/pytest" --out "$OUT/gpu_suite.json" >> "$LOG" 2>&1 || status=1

# The main command on the GPU with each backend: chain and tree, greedy (must print "matches") and
# sampling; on a GPU each runs speculative and target-only decoding twice (a warm-up that compiles
# and captures, then the timed run: both replay CUDA graphs), and its wall-clock line is summarised.
# auto (the README's command) resolves to one of the two, so it runs the default chain only: 12 runs
# of ~11 s (~20 s for a backend's first) overran a 100 s box on 2026-12-04 and left cuda's unrun. A
# sampling run checks only that it runs (its tokens cannot be compared), which the GPU suite's sampling
# tests do for both backends, and decode-profile times the sampling rounds: sampling runs for triton's
# chain alone: 6 runs, ~80-90 s by the 2026-12-04 times (~20 s for the first, which compiles; ~11 s after;
# cuda's first was cut at 10 s), so box 110 s.
main_t0=$SECONDS
: > "$OUT/main_command.log"
for backend in auto triton cuda; do
    for shape in "--draft-tokens 4" "--tree 2,2,1"; do
        for temp in 0 0.8; do
            if [ $backend = auto ] && { [ "$shape" != "--draft-tokens 4" ] || [ $temp != 0 ]; }; then
                continue
            fi
            if [ $temp != 0 ] && { [ $backend != triton ] || [ "$shape" != "--draft-tokens 4" ]; }; then
                continue
            fi
            left=$(( 110 - (SECONDS - main_t0) ))
            if [ $left -lt 5 ]; then
                say "main command $backend $shape temperature $temp: not run (time box spent)"
                status=1
                continue
            fi
            echo "=== python -m gemma4_mtp generate --backend $backend $shape --temperature $temp" >> "$OUT/main_command.log"
            timeout --kill-after=5 $left "$PY" -m gemma4_mtp generate --backend $backend $shape --temperature $temp \
                --max-new-tokens 64 >> "$OUT/main_command.log" 2>&1
            rc=$?
            exact=$(tail -n 1 "$OUT/main_command.log")
            wall=$(grep "^wall clock" "$OUT/main_command.log" | tail -n 1 | sed 's/^wall clock *//')
            say "main command --backend $backend $shape --temperature $temp: $(describe_rc $rc) | $exact | $wall"
            [ $rc -ne 0 ] && status=1
        done
    done
done

# The launch-configuration sweep (benchmarks/tune_launch_configs.py): the glue's, the pre-projection's and the
# attention's heuristics against variants (deeper K blocks and pipelines, tiles, splits), the 31B B = 1 glue
# first, whose GEMVs streamed 1.3-1.6 TB/s of 4.2 on 2026-12-04 (~190 us of the 31B step above its byte floor).
# Before the benchmarks, so that they time the step with its winners too: the variants >= 1.05x faster than
# the launcher's choice go into tuned.json (gemma4_mtp_kernels/triton/tuned.py), which bench_drafter_step's
# `triton_tuned` applies (GEMMA4_MTP_BENCH_TUNED_CONFIGS). At most 70 s, and only while 120 s are left for the
# benchmarks after it (skipped under 30): its 16 processes compile the variants first (40%), then ~0.3-0.5 s a
# variant times the 31B cases' ~100 variants. Its own clock starts after its imports and lets the case under
# way finish (up to ~8 s), and tuned.json is written at its end: it is told 10 s less than its box holds.
budget=$(( 425 - 120 - SECONDS )); [ $budget -gt 70 ] && budget=70
if [ $budget -ge 30 ]; then
    stage sweep $(( budget + 15 )) "$OUT/tune.log" "$PY" -m benchmarks.tune_launch_configs --out "$OUT/tune.json" \
        --tuned-out "$OUT/tuned.json" --time-budget $(( budget - 10 )) --jobs 16
else
    say "launch-configuration sweep not run: ${budget}s left of its time box"
fi
export GEMMA4_MTP_BENCH_TUNED_CONFIGS="$OUT/tuned.json"

# The benchmarks get what the stages above left before 425 s (none under 30 s); 16 processes first run every
# baseline of every case once, a baseline a task (at most 40% of that: compiles land in the on-disk caches;
# run_all.precompile), the checklist's cases first. The vLLM anchor runs when
# GEMMA4_MTP_VLLM_UNIFIED_ATTENTION names a copy of its kernel (benchmarks/vllm_anchor.py). run_all times
# benchmarks/checklist.py's cases first, then stops starting new cases after its budget (its share per op:
# half for the drafter step and rounds, run_all.WEIGHTS) and records the rest as "not run"; the JSON is
# rewritten after every case, so even a kill leaves the finished cases.
budget=$(( 425 - SECONDS ))
rc=0
if [ $budget -ge 30 ]; then
    stage benchmarks $(( budget + 20 )) "$OUT/benchmarks.log" "$PY" -m benchmarks.run_all --out "$OUT/results.json" \
        --time-budget $budget --precompile-jobs 16
    rc=$?
else
    say "benchmarks not run: ${budget}s left of their time box"
    status=1
fi
# A sticky CUDA error (an illegal address in an unverified kernel) makes every later call of the process
# fail: run_all then exits 3 naming the baseline in results.json, and the rest runs in a fresh process
# without the baselines starting with that name (cuda also drops cuda_eager), while time is left.
skip=""
while [ $rc -eq 3 ] && [ $(( 425 - SECONDS )) -ge 30 ]; do
    lost=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['context_lost']['baseline'])" \
        "$OUT/results.json")
    skip="${skip:+$skip,}$lost"
    budget=$(( 425 - SECONDS ))
    say "benchmarks: the CUDA context was lost in baseline $lost; resuming without baselines starting with $skip"
    stage benchmarks-resume $(( budget + 20 )) "$OUT/benchmarks_resume.log" "$PY" -m benchmarks.run_all \
        --out "$OUT/results.json" --resume --skip-baselines "$skip" --time-budget $budget
    rc=$?
done

# Why each kernel of a step takes what it takes (benchmarks/ncu_step.py): Nsight Compute's counters for every
# kernel of one eager triton step, 31B then E2B, each in its own ncu process with half of the box: duration
# alone, DRAM bytes and share of the peak, L2 hits, occupancy, waves, warp stall reasons (benchmarks/README.md,
# "Hardware counters per kernel"). What is left before 490 s, at most 60 (skipped under 25): ahead of the
# profiles and of memcheck, whose window it shortens: no run has yet said why a kernel is slow.
budget=$(( 490 - SECONDS )); [ $budget -gt 60 ] && budget=60
if ! command -v ncu > /dev/null; then
    say "ncu not found: hardware-counter stage skipped"
elif [ $budget -lt 25 ]; then
    say "hardware counters not taken: ${budget}s left of their time box"
else
    stage ncu $(( budget + 15 )) "$OUT/ncu.log" "$PY" -m benchmarks.ncu_step --out "$OUT/ncu_step.json" \
        --time-budget $budget
fi

# Where a graph-replayed step's time goes, kernel by kernel (E2B and 31B, triton with and without PDL,
# cuda): ~30 s, issue 11's next question (benchmarks/README.md, "Kernel by kernel").
stage step-profile 40 "$OUT/step_profile.log" "$PY" -m benchmarks.profile_step --out "$OUT/step_profile.json"

# Where a decode round's wall clock goes (host time per phase, GPU kernel time per round) for the main
# command's configurations: ~20 s; why a tree or a sampling round cost ~2x a greedy chain round on
# 2026-12-04 (benchmarks/README.md, "Decode rounds, phase by phase").
stage decode-profile 40 "$OUT/decode_profile.log" "$PY" -m benchmarks.profile_decode --out "$OUT/decode_profile.json"

# The op tests once under compute-sanitizer memcheck (out-of-bounds and misaligned accesses, errors of
# the kernels we launch); time-boxed, what finished is in the log.
left=$(( 560 - SECONDS )); [ $left -gt 60 ] && left=60
if ! command -v compute-sanitizer > /dev/null; then
    say "compute-sanitizer not found: memcheck stage skipped"
    status=1
elif [ $left -lt 20 ]; then
    say "memcheck not run: ${left}s left of its time box"
    status=1
else
    stage memcheck $left "$OUT/memcheck.log" compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 20 \
        "$PY" -m pytest -q -m gpu -p no:cacheprovider -x tests/test_q_only_attention_cuda.py \
        tests/test_fused_glue_cuda.py tests/test_fused_concat_down_proj_cuda.py tests/test_centroid_logits_cuda.py \
        tests/test_tree_verify_cuda.py tests/test_q_only_attention_triton.py tests/test_tree_verify_triton.py
fi

if [ -f "$OUT/results.json" ]; then
    "$PY" -m benchmarks.run_all --table "$OUT/results.json" > "$OUT/summary.txt" 2>&1
    # each open prediction against this run (in range, below, above, not measured)
    "$PY" -m benchmarks.checklist "$OUT/results.json" > "$OUT/checklist.md" 2>&1
    if ! "$PY" -c "import matplotlib" 2>/dev/null; then
        say "matplotlib is not installed: no roofline.png (draw it later: python -m benchmarks.plot results.json out.png)"
    elif [ $SECONDS -gt 560 ]; then
        say "no time left for the plot: draw it later (python -m benchmarks.plot results.json out.png)"
    else
        stage plot 20 "$OUT/plot.log" "$PY" -m benchmarks.plot "$OUT/results.json" "$OUT/roofline.png"
    fi
fi
say "done in ${SECONDS}s, status $status; files in $OUT"
{ echo "GPU suite (per file):"; cat "$OUT/gpu_suite.txt"; } >> "$OUT/summary.txt" 2>/dev/null
{ echo "Checklist:"; cat "$OUT/checklist.md"; } >> "$OUT/summary.txt" 2>/dev/null
{ echo "Stage boundaries:"; cat "$OUT/stage_boundary.log"; } >> "$OUT/summary.txt" 2>/dev/null
{ echo "Step profile:"; cat "$OUT/step_profile.log"; } >> "$OUT/summary.txt" 2>/dev/null
{ echo "Decode profile:"; cat "$OUT/decode_profile.log"; } >> "$OUT/summary.txt" 2>/dev/null
{ echo "Hardware counters (ncu):"; cat "$OUT/ncu.log"; } >> "$OUT/summary.txt" 2>/dev/null
{ echo "Launch-configuration sweep (launcher's choice -> fastest variant):"
  grep "µs ->\|^tuned configurations" "$OUT/tune.log"; } >> "$OUT/summary.txt" 2>/dev/null
[ -f "$OUT/summary.txt" ] && cat "$OUT/summary.txt"
exit $status
