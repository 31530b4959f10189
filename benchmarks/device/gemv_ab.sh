#!/usr/bin/env bash
# One device call: the streamed GEMV candidate (linear.GEMV_STREAM=1) against the register GEMV on one machine: the
# GEMV's GPU tests (the candidate bitwise the register GEMV), the projections alone at one row, then the 40-layer B=1
# step, alternating 0 / 1 / 0 / 1; last the prefill MoE at 2K tokens with expert_gemm_kernel.BLOCKS_64 at 2 and 3.
# From the repo root on the device (carry [".devpack"]):  bash benchmarks/device/gemv_ab.sh
# Only the decode steps use the kernel manifest, and the first of them gets the long limit: a process that reads the
# manifest first builds all of its ~200 kernels (minutes on a fresh machine: the twenty-eighth session lost a whole
# call to short limits there). T0..T3: the steps' limits.
set -o pipefail
export PYTHONUNBUFFERED=1
source benchmarks/gpu_env.sh
f() { grep -v "\[TileLang:"; }
W=benchmarks/with_attrs.py
L=deepinfer.kernels.tilelang.linear.GEMV_STREAM
nvidia-smi --query-gpu=name --format=csv,noheader
(cd "$DEEPINFER_SITE" && timeout ${T0:-240} python3 -m pytest $GPU_TESTS/test_tilelang_linear.py -k gemv -n 4 -q \
  -p no:cacheprovider -o addopts= 2>&1 | f > $OUT/gemv_tests.log); grep -E "passed|failed|FAILED" $OUT/gemv_tests.log
for s in 0 1; do
  echo "== GEMV_STREAM=$s" >> $OUT/linear_ab.log
  timeout ${T1:-150} python3 $W $L=$s -- benchmarks/linear_gpu.py --batches 1 --out $OUT/linear_$s.json 2>&1 | f \
    >> $OUT/linear_ab.log
done
grep -E "^==| 1 gemv|rror" $OUT/linear_ab.log
cp benchmarks/jit/flash40.jsonl $OUT/jit.jsonl
limit=${T2:-360}
for s in 0 1 0 1; do
  echo "== GEMV_STREAM=$s" >> $OUT/decode_ab.log
  DEEPINFER_JIT_MANIFEST=$OUT/jit.jsonl timeout $limit python3 $W $L=$s -- benchmarks/decode_gpu.py --model flash40 \
    --batches 1 --contexts 4096 --variants graphs --steps 5 --warmup 2 --prefill --out $OUT/decode_$s.json 2>&1 | f \
    >> $OUT/decode_ab.log
  limit=90
done
grep -E "^==|^decode graphs|rror" $OUT/decode_ab.log
E=deepinfer.kernels.tilelang.expert_gemm_kernel.BLOCKS_64
for b in 2 3; do
  echo "== BLOCKS_64=$b" >> $OUT/moe_prefill_ab.log
  timeout ${T3:-120} python3 $W $E=$b -- benchmarks/prefill_kernels_gpu.py --tokens 2048 --rows 64 --block-m 64 \
    --gemm-heights 64 --out $OUT/pk_$b.json 2>&1 | f >> $OUT/moe_prefill_ab.log
done
grep -E "^==|^MoE|^fp4|rror" $OUT/moe_prefill_ab.log
echo "gemv_ab.sh done in $SECONDS s"
