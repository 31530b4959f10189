#!/usr/bin/env bash
# One device call (an H100 or an H200, ~3-5 min warm or cold): the decode attention, FP8 projection and prefill-path
# GPU test files, the decode attention kernel with its probes and candidates, and the prefill kernels (MoE paths, FP8
# projections).
# From the repo root on the device (carry [".devpack"]):  bash benchmarks/device/kernels.sh
# ATTRS: benchmarks/with_attrs.py overrides for the prefill kernels run (an A/B arm); T1..T3: each step's seconds;
# ATTN_BATCHES: the attention kernel's batches (default 1,8,64,256; 2048 and 8192 are prefill's one-split shapes);
# SWEEP=0: no other split counts; ATTN_PROBES: the probes timed (comma-separated; default all; "" for the candidates
# alone); PREFILL_KERNELS=0 skips the prefill kernels.
# A step that fails or times out is named at the end and the call exits 1 (device_steps.sh).
set -o pipefail
export PYTHONUNBUFFERED=1
source benchmarks/gpu_env.sh
source benchmarks/device_steps.sh
RUN=python3 && [ -n "${ATTRS:-}" ] && RUN="python3 benchmarks/with_attrs.py $ATTRS --"
R=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/tests.log
cd "$DEEPINFER_SITE"
timeout ${T1:-280} python3 -m pytest $GPU_TESTS/test_tilelang_{attention_decode,linear}.py \
  $GPU_TESTS/test_prefill_paths.py -n 4 -v -rf -p no:cacheprovider -o addopts= 2>&1 | tee -a $OUT/tests.log \
  | grep -E "FAILED|ERROR|passed|failed|error" | tail -30
check "kernel tests"
cd "$R"
# the kernel manifest: prebuilt in parallel, and what the run compiles besides is recorded (back under $OUT)
cp benchmarks/jit/flash40.jsonl $OUT/jit.jsonl && export DEEPINFER_JIT_MANIFEST=$OUT/jit.jsonl
SW=--sweep && [ "${SWEEP:-1}" = 0 ] && SW=
PN=() && [ -n "${ATTN_PROBES+set}" ] && PN=(--probe-names "$ATTN_PROBES")
# the smoke child's limit half the step's: a kernel that hangs is named as a hang, not a step timed out
timeout ${T2:-170} python3 benchmarks/attention_decode_gpu.py --batches ${ATTN_BATCHES:-1,8,64,256} --no-mtp \
  --probes $SW "${PN[@]}" --hang-limit $(( ${T2:-170} / 2 )) \
  --out $OUT/attn.json 2>&1 | grep -v "\[TileLang:" | tee $OUT/attn.log | tail -14
check "decode attention"
[ "${PREFILL_KERNELS:-1}" = 0 ] || timeout ${T3:-120} $RUN \
  benchmarks/prefill_kernels_gpu.py --tokens 2048 8192 --rows 8192 --gemm-heights --out $OUT/prefill_kernels.json 2>&1 \
  | grep -v "\[TileLang:" | tee $OUT/prefill_kernels.log | grep -v "^linear" | tail -12
check "prefill kernels"
finish kernels.sh
