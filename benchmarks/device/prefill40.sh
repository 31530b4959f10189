#!/usr/bin/env bash
# One device call (the 40-layer model: an H200, or an 80 GB H100): the prefill paths' GPU tests (their kernels held
# to the torch contracts before anything is timed; PATHS=0 skips), the prefill MoE's kernels alone if asked, the
# 40-layer prefill (8K, 32K, YOCO at 32K, mixed prefill + decode steps at 2K-16K budgets), the 6-layer model's 8K
# and 32K, each profiled per kernel at 8K and 32K, then the engine and model GPU files with the time left.
# From the repo root on the device (carry [".devpack"]):  bash benchmarks/device/prefill40.sh
# ATTRS: benchmarks/with_attrs.py overrides (an A/B arm); LIMIT: the call's seconds; TP, T0, T1, T2: the steps' limits
# (KERNELS=1: the kernel step, off by default: it compiles for minutes; 120 s cut it short on a cold H100).
# A step that fails or times out is named at the end and the call exits 1 (device_steps.sh).
set -o pipefail
export PYTHONUNBUFFERED=1
source benchmarks/gpu_env.sh
source benchmarks/device_steps.sh
RUN=python3 && [ -n "${ATTRS:-}" ] && RUN="python3 benchmarks/with_attrs.py $ATTRS --"
# the kernel manifest: prebuilt in parallel, and what the run compiles besides is recorded (back under $OUT)
cp benchmarks/jit/flash40.jsonl $OUT/jit.jsonl && export DEEPINFER_JIT_MANIFEST=$OUT/jit.jsonl
nvidia-smi --query-gpu=name --format=csv,noheader
[ "${PATHS:-1}" = 0 ] || (cd "$DEEPINFER_SITE" && timeout ${TP:-200} python3 -m pytest -q -rf -p no:cacheprovider \
  -o addopts= $GPU_TESTS/test_prefill_paths.py 2>&1) | grep -v "\[TileLang:" | tee $OUT/paths_tests.log \
  | grep -E "FAILED|ERROR|passed|failed" | tail -8
check "prefill paths tests"
# the prefill MoE and its expert GEMM alone (KERNELS=1 runs it): both tile heights against the streaming kernel
[ "${KERNELS:-0}" = 0 ] || timeout ${T0:-240} $RUN benchmarks/prefill_kernels_gpu.py --tokens 2048 8192 --rows 64 \
  --block-m 64 128 --out $OUT/prefill_kernels.json 2>&1 | grep -v "\[TileLang:" | tee $OUT/prefill_kernels.log \
  | grep -E "^MoE|^fp4|FAILED|Error" | tail -12
check "prefill kernels"
timeout ${T1:-330} $RUN \
  benchmarks/prefill_gpu.py --model flash40 --tokens 8192 32768 --at-once 1 --torch-tokens 0 --mixed-tokens 16384 \
  --mixed-chunks 2048 4096 8192 16384 --profile-tokens 8192 32768 --out $OUT/prefill.json 2>&1 \
  | grep -v "\[TileLang:" | tee $OUT/prefill.log | tail -30
check "40-layer prefill"
# the 6-layer model (the same width; issue 20 asks its 8K and 32K at >= 40% too)
timeout ${T2:-120} $RUN benchmarks/prefill_gpu.py --model flash --tokens 8192 32768 --at-once 1 --torch-tokens 0 \
  --yoco-tokens 0 --mixed-tokens 0 --profile-tokens 8192 32768 --out $OUT/prefill6.json 2>&1 \
  | grep -v "\[TileLang:" | tee $OUT/prefill6.log | grep -E "x1:|^target|FAILED|Error" | tail -8
check "6-layer prefill"
left=$(( ${LIMIT:-540} - SECONDS ))
if [ $left -gt 90 ]; then
  cd "$DEEPINFER_SITE" && timeout $left python3 -m pytest $GPU_TESTS/test_{engine_gpu,model_gpu}.py -n 2 \
    --dist loadgroup -v -rf -p no:cacheprovider -o addopts= 2>&1 | tee $OUT/engine_tests.log \
    | grep -E "FAILED|ERROR|passed|failed" | tail -12
  check "engine and model tests"
else
  echo "engine and model tests not run: $left s left"
fi
finish prefill40.sh
