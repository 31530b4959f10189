#!/usr/bin/env bash
# Three device calls (chain them: a warm machine keeps its kernel cache), each arm through with_attrs.py:
#   moe.WARP_DOWN=0     the warp-streamed up pass feeding the grouped GEMM's down pass (default 1: both warp passes)
#   moe.WARP_TOKENS=8   the warp-streamed passes up to 8 tokens a call (default 1), e.g. DSpark's B=1 verification
#   moe.WARP_EARLY=1    under the graph (PDL on), the warp down pass's first weight stages before its wait (default 0)
#   mhc.GEMV_TOKENS=8   the mHC mixes up to 8 tokens a call as one GEMV launch (mhc_gemv_kernel.py; default 0)
#   rowwise.ROPE_ONE_CHUNK_BELOW=65536  rope launches of fewer 16-byte chunks one chunk a thread (default 0: four)
#   linear.DENSE_ROWS=512  the smaller projections dequantised for cuBLAS from 512 rows again (default 256), at DSpark's
#                       B=64 verification (64 x 3-4 rows), where the twenty-ninth session saw its step rise
# PART=1: the candidates' GPU tests, then the MoE op alone at 1, 2, 4 and 8 tokens and the mHC kernels per arm.
# PART=2: the 40-layer step at B=1 and 8, the defaults then each decode candidate alone. PART=3: DSpark at B=1 per
# WARP_TOKENS, at B=64 per DENSE_ROWS.
# From the repo root on the device (carry [".devpack"]):  PART=1 bash benchmarks/device/decode_ab.sh
# PART=2 and 3 read the kernel manifest, PART=2's first step with a long limit: a process that reads it first builds
# all its ~210 kernels (minutes on a fresh machine).
set -o pipefail
export PYTHONUNBUFFERED=1
source benchmarks/gpu_env.sh
f() { grep -v "\[TileLang:"; }
W=benchmarks/with_attrs.py
M=deepinfer.kernels.tilelang.moe
H=deepinfer.kernels.tilelang.mhc
R=deepinfer.kernels.tilelang.rowwise
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "${PART:-1}" = 1 ]; then
  (cd "$DEEPINFER_SITE" && timeout ${T0:-240} python3 -m pytest $GPU_TESTS/test_tilelang_moe_kernel.py \
    $GPU_TESTS/test_tilelang_mhc.py -k "warp_streamed or mixes" -q -p no:cacheprovider -o addopts= 2>&1 | f \
    > $OUT/candidate_tests.log)
  grep -E "passed|failed|FAILED|ERROR" $OUT/candidate_tests.log | tail -6
  i=0
  for arm in "$M.WARP_DOWN=1" "$M.WARP_DOWN=0" "$M.WARP_TOKENS=8" "$M.WARP_TOKENS=8 $M.WARP_DOWN=0"; do
    echo "== $arm" >> $OUT/moe_ab.log
    timeout ${T1:-90} python3 $W $arm -- benchmarks/moe_gpu.py --batches 1,2,4,8 --out $OUT/moe_$i.json 2>&1 | f \
      >> $OUT/moe_ab.log
    i=$((i + 1))
  done
  grep -E "^==|^B=|^  kernel|^    kernel routed|rror" $OUT/moe_ab.log
  for t in 0 8; do
    echo "== GEMV_TOKENS=$t" >> $OUT/mhc_ab.log
    timeout ${T2:-120} python3 $W $H.GEMV_TOKENS=$t -- benchmarks/kernels_gpu.py --only mhc --quick --no-torch \
      --out $OUT/mhc_$t.json 2>&1 | f >> $OUT/mhc_ab.log
  done
  grep -E "^==|^mhc_mixes|rror" $OUT/mhc_ab.log
elif [ "${PART}" = 2 ]; then
  cp benchmarks/jit/flash40.jsonl $OUT/jit.jsonl
  export DEEPINFER_JIT_MANIFEST=$OUT/jit.jsonl
  limit=${T3:-250}
  i=0
  for arm in "$M.WARP_DOWN=1" "$M.WARP_DOWN=0" "$M.WARP_EARLY=1" "$H.GEMV_TOKENS=8" \
    "$R.ROPE_ONE_CHUNK_BELOW=65536"; do
    echo "== $arm" >> $OUT/decode_ab.log
    timeout $limit python3 $W $arm -- benchmarks/decode_gpu.py --model flash40 --batches 1 8 --contexts 4096 \
      --variants graphs --steps 5 --warmup 2 --prefill --out $OUT/decode_$i.json 2>&1 | f >> $OUT/decode_ab.log
    limit=${T4:-85}; i=$((i + 1))
  done
  grep -E "^==|^decode graphs|rror" $OUT/decode_ab.log
else
  cp benchmarks/jit/flash40.jsonl $OUT/jit.jsonl
  export DEEPINFER_JIT_MANIFEST=$OUT/jit.jsonl
  for t in 1 8; do
    echo "== WARP_TOKENS=$t" >> $OUT/dspark_ab.log
    timeout ${T5:-150} python3 $W $M.WARP_TOKENS=$t -- benchmarks/dspark_gpu.py --model flash40 --batches 1 \
      --accepted 0 2 3 --varlen --out $OUT/dspark_b1_$t.json 2>&1 | f >> $OUT/dspark_ab.log
  done
  for r in 256 512; do
    echo "== DENSE_ROWS=$r" >> $OUT/dspark_ab.log
    timeout ${T6:-150} python3 $W deepinfer.kernels.tilelang.linear.DENSE_ROWS=$r -- benchmarks/dspark_gpu.py \
      --model flash40 --batches 64 --accepted 0 2 3 --varlen --out $OUT/dspark_b64_$r.json 2>&1 | f \
      >> $OUT/dspark_ab.log
  done
  grep -E "^==|^flash40 B=|rror" $OUT/dspark_ab.log
fi
echo "decode_ab.sh PART=${PART:-1} done in $SECONDS s"
