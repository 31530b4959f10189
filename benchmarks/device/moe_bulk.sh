#!/usr/bin/env bash
# One device call: the routed experts' data paths (stream_probe_gpu.py), the bulk-copy MoE passes' GPU file, the
# MoE op with them (moe_gpu.py --variants bulk: the op and each pass beside the default's), and, if the bulk op beat
# the default at 8 and 64 tokens (and its GPU file passed), the 40-layer decode step with them (moe.BULK_TOKENS)
# against the default in the same call, then DSpark's rows with them.
# From the repo root on the device (carry [".devpack"]):  bash benchmarks/device/moe_bulk.sh
# PROBE_BATCHES / MOE_BATCHES (default 1,8,64,256 / 1,8,64,256,384); PROBE=0 skips the probe, STEP=0 the 40-layer
# arms (STEP_BATCHES, default "1 8 64"; BULK_TOKENS 0 against ON_TOKENS, default 256; DSPARK=0 skips DSpark's
# rows), TESTS=0 the GPU file; BULK_ARMS: "STAGES MAX_TOKENS;...", the op again with the bulk passes' ring so;
# PROBE_MODES: the probe's paths; T1..T6: limits. The GPU file runs without a kernel manifest (its kernels are
# its own), the op with the MoE's lines of benchmarks/jit/flash40.jsonl, the 40-layer arms with all of it.
set -o pipefail
export PYTHONUNBUFFERED=1
source benchmarks/gpu_env.sh
source benchmarks/device_steps.sh
# the op's steps build only the MoE's kernels (the whole 40-layer manifest, ~235 kernels, is a cold machine's minutes)
cp benchmarks/jit/flash40.jsonl $OUT/jit.jsonl
grep -E '"deepinfer.kernels.tilelang.moe' $OUT/jit.jsonl > $OUT/moe.jsonl
nvidia-smi --query-gpu=name --format=csv,noheader
[ "${PROBE:-1}" = 0 ] || timeout ${T1:-150} python3 benchmarks/stream_probe_gpu.py \
  --modes ${PROBE_MODES:-block,warp,rows,tile,tma2d} --batches ${PROBE_BATCHES:-1,8,64,256} --gemv wq_b,wo_b,wq_a \
  --out $OUT/stream_probe.json 2>&1 | grep -v "TileLang" | tee $OUT/stream_probe.log | tail -100
check "stream probe"
[ "${TESTS:-1}" = 0 ] || (cd "$DEEPINFER_SITE" && timeout ${T2:-150} python3 -m pytest \
  $GPU_TESTS/test_tilelang_moe_bulk.py -v -rf \
  -p no:cacheprovider -o addopts= 2>&1) | tee $OUT/gpu_tests_moe_bulk.log \
  | grep -E "PASS|FAIL|ERROR|passed|failed|Error" | tail -14
check "bulk GPU tests" && [ "${TESTS:-1}" != 0 ] && tests_ok=1
# the op's default row with the grouped GEMM's passes (BULK_TOKENS 0), its "bulk" row with the bulk kernel's
OFF="python3 benchmarks/with_attrs.py deepinfer.kernels.tilelang.moe.BULK_TOKENS=0 --"
DEEPINFER_JIT_MANIFEST=$OUT/moe.jsonl timeout ${T3:-150} $OFF benchmarks/moe_gpu.py \
  --batches ${MOE_BATCHES:-1,8,64,256,384} --variants bulk --out $OUT/moe_bulk.json 2>&1 | grep -v "TileLang" \
  | tee $OUT/moe_bulk.log | grep -E "B=|kernel|bulk|self-check|Error" | tail -48
check "MoE op with the bulk passes"
IFS=';' read -ra arms <<< "${BULK_ARMS:-}"
for arm in "${arms[@]}"; do  # "STAGES MAX_TOKENS": the bulk passes' ring beyond one token a call (config())
  set -- $arm; M=deepinfer.kernels.tilelang.moe_bulk_kernel
  echo "== bulk arm: stages $1, tokens a chunk $2" | tee -a $OUT/bulk_arms.log
  DEEPINFER_JIT_MANIFEST=$OUT/moe.jsonl timeout ${T6:-90} python3 benchmarks/with_attrs.py $M.STAGES=$1 \
    $M.MAX_TOKENS=$2 deepinfer.kernels.tilelang.moe.BULK_TOKENS=0 -- benchmarks/moe_gpu.py \
    --batches ${MOE_BATCHES:-1,8,64,256,384} --variants bulk \
    --out $OUT/moe_bulk_s$1_t$2.json 2>&1 | grep -v "TileLang" | tee -a $OUT/bulk_arms.log \
    | grep -E "^B=|^  (kernel|bulk) |routed|Error" | tail -24
  check "bulk arm $1 $2"
done
wins=$(python3 -c "import json; r={x['B']: x for x in json.load(open('$OUT/moe_bulk.json'))['rows']}; \
print(int(all(r.get(b, {}).get('bulk_us') and r[b]['bulk_us'] < r[b]['kernel_us'] for b in (8, 64))))" 2>/dev/null)
if [ "${STEP:-1}" = 1 ] && { [ "${tests_ok:-0}" = 1 ] || [ "${TESTS:-1}" = 0 ]; } && [ "$wins" = 1 ]; then
  W="python3 benchmarks/with_attrs.py"
  export DEEPINFER_JIT_MANIFEST=$OUT/jit.jsonl
  for arm in off on; do  # the same call: the routed passes without and with the bulk kernel up to ON_TOKENS
    attrs="deepinfer.kernels.tilelang.moe.BULK_TOKENS=$([ $arm = on ] && echo ${ON_TOKENS:-256} || echo 0)"
    echo "== arm $arm: $attrs" | tee -a $OUT/arms.log
    timeout ${T4:-170} $W $attrs -- benchmarks/decode_gpu.py --model flash40 --batches ${STEP_BATCHES:-1 8 64} \
      --contexts 4096 --variants graphs --steps 5 --warmup 2 --prefill --out $OUT/decode_$arm.json 2>&1 \
      | grep -v "TileLang" | tee -a $OUT/arms.log | grep -E "^decode|Error" | tail -4
    check "40-layer decode, bulk $arm"
  done
  [ "${DSPARK:-1}" = 0 ] || timeout ${T5:-120} $W deepinfer.kernels.tilelang.moe.BULK_TOKENS=${ON_TOKENS:-256} -- \
    benchmarks/dspark_gpu.py --model flash40 --batches 1 64 --accepted 0 2 --varlen --out $OUT/dspark_bulk.json \
    2>&1 | grep -v "TileLang" | tee $OUT/dspark_bulk.log | grep -E "^\| 40|Error|target" | tail -10
  check "DSpark with the bulk passes"
else
  echo "40-layer arms not run (STEP=${STEP:-1}, GPU file passed: ${tests_ok:-0} (TESTS=${TESTS:-1})," \
    "bulk op faster at 8 and 64: ${wins:-?})"
fi
finish moe_bulk.sh
