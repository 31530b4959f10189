#!/usr/bin/env bash
# One device call: the GPU test files, their kernels first built in parallel on every core from the kernel manifests
# (benchmarks/jit/*.jsonl; a fresh machine otherwise compiles them one at a time inside each test process, minutes).
# What the tests compile besides is recorded in $OUT/jit_tests.jsonl (commit it as benchmarks/jit/gpu_tests.jsonl so
# the next warm-up builds those too; each test process reads only that file's lines, not the whole manifest).
# From the repo root on the device (carry [".devpack"]):  bash benchmarks/device/gpu_tests.sh
# FILES: test files under tests/gpu (default: every one); K: a pytest -k expression; N: pytest workers (default 4);
# ALONE: files of FILES run after the others in one worker (default: test_engine_batch_invariance.py, its ~68 GB
# Flash-width model, and test_expert_parallel_gpu.py, NCCL's buffers beside its Flash-width model; each ran an 80 GB
# H100 out of memory beside three workers); LIMIT: the call's seconds (default 540; the tests take what the warm-up
# leaves); T0: the warm-up's limit. A step that fails or times out is named at the end and the call exits 1
# (device_steps.sh).
set -o pipefail
export PYTHONUNBUFFERED=1
source benchmarks/gpu_env.sh
source benchmarks/device_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader
DEEPINFER_JIT_MANIFEST=$OUT/jit.jsonl timeout ${T0:-300} python3 benchmarks/jit_warm.py benchmarks/jit/*.jsonl \
  --out $OUT/jit_warm.json 2>&1 | grep -v "\[TileLang:" | tail -3
check "kernel warm-up"
names=${FILES:-$(cd $GPU_TESTS && ls test_*.py)}
alone=${ALONE-test_engine_batch_invariance.py test_expert_parallel_gpu.py}
shared=""; single=""
for f in $names; do
  if [[ " $alone " == *" $f "* ]]; then single+=" $GPU_TESTS/$f"; else shared+=" $GPU_TESTS/$f"; fi
done
export DEEPINFER_JIT_MANIFEST=$OUT/jit_tests.jsonl
cd "$DEEPINFER_SITE"
run() {  # workers, files: pytest within the call's time left, its log appended; under a minute left: not run, and
  # said (s43: a forced minute for the ALONE files ran the call past the device tool's limit, and its tail was lost)
  local left=$(( ${LIMIT:-540} - SECONDS ))
  if [ $left -lt 60 ]; then
    echo "STEP FAILED: not run, $left s left: $2"; FAILED_STEPS+=("not run: $2"); return
  fi
  timeout $left python3 -m pytest $2 -n $1 --dist loadgroup -v -rf -p no:cacheprovider -o addopts= ${K:+-k "$K"} \
    2>&1 | grep -v "\[TileLang:" >> $OUT/gpu_tests.log
  check "pytest -n $1"
}
[ -z "$shared" ] || run ${N:-4} "$shared"
[ -z "$single" ] || run 1 "$single"
grep -E "FAILED|ERROR|passed|failed|error" $OUT/gpu_tests.log | tail -30
finish gpu_tests.sh
