#!/usr/bin/env bash
# Two device calls: the decode candidates against the defaults on one machine, each through with_attrs.py.
#   linear.GEMV_STREAM=1  the FP8 GEMV streaming its weight rows through a cp.async ring per warp (gemv_kernel.py)
#   moe.WARP_STREAM=1     the one-token routed FP4 passes, a private cp.async ring per warp (moe_warp_kernel.py)
#   expert_gemm_kernel.BLOCKS_64=3  the prefill MoE's 64-token tiles at three blocks an SM
# PART=1: their GPU tests, then the projections alone at one row and the MoE op alone at one token, per arm.
# PART=2: the 40-layer B=1 step with neither, each, and both (then the defaults again), then the prefill MoE at 2K
# tokens per BLOCKS_64. From the repo root on the device (carry [".devpack"]):  PART=1 bash benchmarks/device/...
# Only PART=2's decode steps read the kernel manifest, the first with a long limit: a process that reads it first
# builds all its ~210 kernels (minutes on a fresh machine; the twenty-eighth session lost a call to short limits).
set -o pipefail
export PYTHONUNBUFFERED=1
source benchmarks/gpu_env.sh
f() { grep -v "\[TileLang:"; }
W=benchmarks/with_attrs.py
L=deepinfer.kernels.tilelang.linear.GEMV_STREAM
M=deepinfer.kernels.tilelang.moe.WARP_STREAM
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "${PART:-1}" = 1 ]; then
  (cd "$DEEPINFER_SITE" && timeout ${T0:-300} python3 -m pytest $GPU_TESTS/test_tilelang_linear.py \
    $GPU_TESTS/test_tilelang_moe_kernel.py -k "gemv or warp_streamed" -n 4 -q -p no:cacheprovider -o addopts= 2>&1 \
    | f > $OUT/candidate_tests.log); grep -E "passed|failed|FAILED|ERROR" $OUT/candidate_tests.log | tail -12
  for s in 0 1; do
    echo "== GEMV_STREAM=$s" >> $OUT/linear_ab.log
    timeout ${T1:-150} python3 $W $L=$s -- benchmarks/linear_gpu.py --batches 1 --out $OUT/linear_$s.json 2>&1 | f \
      >> $OUT/linear_ab.log
    echo "== WARP_STREAM=$s" >> $OUT/moe_ab.log
    timeout ${T1:-150} python3 $W $M=$s -- benchmarks/moe_gpu.py --batches 1 --out $OUT/moe_$s.json 2>&1 | f \
      >> $OUT/moe_ab.log
  done
  grep -E "^==| 1 gemv|rror" $OUT/linear_ab.log; grep -E "^==|^  kernel|^    kernel|rror" $OUT/moe_ab.log
else
  cp benchmarks/jit/flash40.jsonl $OUT/jit.jsonl
  limit=${T2:-360}
  i=0
  for arm in "$L=0 $M=0" "$L=1 $M=0" "$L=0 $M=1" "$L=1 $M=1" "$L=0 $M=0"; do
    echo "== $arm" >> $OUT/decode_ab.log
    DEEPINFER_JIT_MANIFEST=$OUT/jit.jsonl timeout $limit python3 $W $arm -- benchmarks/decode_gpu.py --model flash40 \
      --batches 1 --contexts 4096 --variants graphs --steps 5 --warmup 2 --prefill --out $OUT/decode_$i.json 2>&1 | f \
      >> $OUT/decode_ab.log
    limit=${T3:-90}; i=$((i + 1))
  done
  grep -E "^==|^decode graphs|rror" $OUT/decode_ab.log
  E=deepinfer.kernels.tilelang.expert_gemm_kernel.BLOCKS_64
  for b in 2 3; do
    echo "== BLOCKS_64=$b" >> $OUT/moe_prefill_ab.log
    timeout ${T4:-120} python3 $W $E=$b -- benchmarks/prefill_kernels_gpu.py --tokens 2048 --rows 64 --block-m 64 \
      --gemm-heights 64 --out $OUT/pk_$b.json 2>&1 | f >> $OUT/moe_prefill_ab.log
  done
  grep -E "^==|^MoE|^fp4|rror" $OUT/moe_prefill_ab.log
fi
echo "candidates_ab.sh PART=${PART:-1} done in $SECONDS s"
