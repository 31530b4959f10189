#!/usr/bin/env bash
# Four device calls (chain them: a warm machine keeps its kernel cache): the candidates against the defaults on one
# machine, each through with_attrs.py.
#   linear.GEMV_STREAM=1  the FP8 GEMV streaming its weight rows through a cp.async ring per warp (gemv_kernel.py)
#   moe.WARP_STREAM=1     the one-token routed FP4 passes, a private cp.async ring per warp (moe_warp_kernel.py)
#   expert_gemm_kernel.BLOCKS_64=3  the prefill MoE's 64-token tiles at three blocks an SM
#   moe_prefill.SYNC_FREE=1  the prefill MoE's tile lists sized on the host: no device sync in the call
# PART=1: their GPU tests. PART=2: the projections alone at one row and the MoE op alone at one token, per arm.
# PART=3: the 40-layer B=1 step with neither decode candidate, each, and both.
# PART=4: the prefill MoE at 2K tokens per BLOCKS_64, then the 6-layer prefill (8K, 32K) per SYNC_FREE.
# From the repo root on the device (carry [".devpack"]):  PART=1 bash benchmarks/device/candidates_ab.sh
# Only PART=3's decode steps read the kernel manifest, the first with a long limit: a process that reads it first
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
  (cd "$DEEPINFER_SITE" && timeout ${T0:-240} python3 -m pytest $GPU_TESTS/test_tilelang_linear.py \
    $GPU_TESTS/test_prefill_paths.py -k "gemv or grouped_moe" -n 4 -q -p no:cacheprovider -o addopts= 2>&1 \
    | f > $OUT/candidate_tests.log)
  # (its module fixture builds the file's 52 kernels on a thread pool first: one process, not one per worker)
  (cd "$DEEPINFER_SITE" && timeout ${T1:-300} python3 -m pytest $GPU_TESTS/test_tilelang_moe_kernel.py \
    -k warp_streamed -q -p no:cacheprovider -o addopts= 2>&1 | f >> $OUT/candidate_tests.log)
  grep -E "passed|failed|FAILED|ERROR" $OUT/candidate_tests.log | tail -12
elif [ "${PART}" = 2 ]; then
  for s in 0 1; do
    echo "== GEMV_STREAM=$s" >> $OUT/linear_ab.log
    timeout ${T2:-150} python3 $W $L=$s -- benchmarks/linear_gpu.py --batches 1 --out $OUT/linear_$s.json 2>&1 | f \
      >> $OUT/linear_ab.log
    echo "== WARP_STREAM=$s" >> $OUT/moe_ab.log
    timeout ${T2:-150} python3 $W $M=$s -- benchmarks/moe_gpu.py --batches 1 --out $OUT/moe_$s.json 2>&1 | f \
      >> $OUT/moe_ab.log
  done
  grep -E "^==| 1 gemv|rror" $OUT/linear_ab.log; grep -E "^==|^  kernel|^    kernel|rror" $OUT/moe_ab.log
elif [ "${PART}" = 3 ]; then
  cp benchmarks/jit/flash40.jsonl $OUT/jit.jsonl
  limit=${T3:-360}
  i=0
  for arm in "$L=0 $M=0" "$L=1 $M=0" "$L=0 $M=1" "$L=1 $M=1"; do
    echo "== $arm" >> $OUT/decode_ab.log
    DEEPINFER_JIT_MANIFEST=$OUT/jit.jsonl timeout $limit python3 $W $arm -- benchmarks/decode_gpu.py --model flash40 \
      --batches 1 --contexts 4096 --variants graphs --steps 5 --warmup 2 --prefill --out $OUT/decode_$i.json 2>&1 | f \
      >> $OUT/decode_ab.log
    limit=${T4:-90}; i=$((i + 1))
  done
  grep -E "^==|^decode graphs|rror" $OUT/decode_ab.log
else
  E=deepinfer.kernels.tilelang.expert_gemm_kernel.BLOCKS_64
  for b in 2 3; do
    echo "== BLOCKS_64=$b" >> $OUT/moe_prefill_ab.log
    timeout ${T5:-120} python3 $W $E=$b -- benchmarks/prefill_kernels_gpu.py --tokens 2048 --rows 64 --block-m 64 \
      --gemm-heights 64 --out $OUT/pk_$b.json 2>&1 | f >> $OUT/moe_prefill_ab.log
  done
  grep -E "^==|^MoE|^fp4|rror" $OUT/moe_prefill_ab.log
  P=deepinfer.kernels.tilelang.moe_prefill.SYNC_FREE
  limit=${T6:-240}
  for s in 0 1 0 1; do
    echo "== SYNC_FREE=$s" >> $OUT/prefill_ab.log
    timeout $limit python3 $W $P=$s -- benchmarks/prefill_gpu.py --model flash --tokens 8192 32768 --at-once 1 \
      --torch-tokens 0 --yoco-tokens 0 --mixed-tokens 0 --out $OUT/prefill6_$s.json 2>&1 | f >> $OUT/prefill_ab.log
    limit=${T7:-100}
  done
  grep -E "^==|x1:|rror" $OUT/prefill_ab.log
fi
echo "candidates_ab.sh PART=${PART:-1} done in $SECONDS s"
