#!/usr/bin/env bash
# One device call (an H200 for the issues' targets; the 40-layer model also fits an 80 GB H100, ~50 GB): the 40-layer
# decode table (each batch's distinct routed experts counted: --routing), A/B arms (B=1 and 8 by default), DSpark's
# table, then the batch-invariance GPU file with the time left.
# From the repo root on the device (carry [".devpack"]):  bash benchmarks/device/decode40.sh
# BATCHES / CONTEXTS: the table's cells (default 1 8 64 256 / 4096 32768); ARMS: A/B arms, "name MOD.NAME=INT ..."
# separated by ';' (none by default), at ARM_BATCHES (default "1 8"; 4K); PROFILE: the table's cells profiled per
# kernel (B:CTX,...; default B=1, 8 and 256 at 4K, B=1 at 32K; "" for none); DSPARK=0 skips DSpark's table; MOE:
# batches of the MoE op alone with its per-pass breakdown and probes (e.g. "1,8"; none by default); DECODE=0 skips
# the decode table (the arms still run); DSPARK_ARMS: A/B arms as ARMS for DSpark's rows at DSPARK_ARM_BATCHES
# (default 1; zero, two and three drafts accepted, varlen); LIMIT: the call's seconds (the tests take what is left);
# T0: the kernel warm-up's limit (330 s); T1..T5: step limits (T1 300: the table, its profiles and the routing count;
# 240 ran out in the profile, s40). A step that fails or times out is named at the end and the call exits 1
# (device_steps.sh).
set -o pipefail
export PYTHONUNBUFFERED=1
source benchmarks/gpu_env.sh
source benchmarks/device_steps.sh
# the kernel manifest: prebuilt in parallel, and what the run compiles besides is recorded (back under $OUT)
cp benchmarks/jit/flash40.jsonl $OUT/jit.jsonl && export DEEPINFER_JIT_MANIFEST=$OUT/jit.jsonl
nvidia-smi --query-gpu=name --format=csv,noheader
# every kernel built first, in one process on every core: on a cold machine each arm's process otherwise spends its
# step limit compiling (s45: four arms of 150 s each timed out after "engine up", none timed); a warm cache is read
timeout ${T0:-330} python3 benchmarks/jit_warm.py benchmarks/jit/flash40.jsonl --out $OUT/jit_warm.json 2>&1 \
  | grep -v "\[TileLang:" | tail -3
check "kernel warm-up"
[ "${DECODE:-1}" = 0 ] || timeout ${T1:-300} python3 benchmarks/decode_gpu.py --model flash40 \
  --batches ${BATCHES:-1 8 64 256} --contexts ${CONTEXTS:-4096 32768} --variants graphs --steps 5 --warmup 2 --prefill \
  --profile "${PROFILE-1:4096,8:4096,256:4096,1:32768}" --routing --out $OUT/decode.json 2>&1 \
  | grep -v "\[TileLang:" | tee $OUT/decode.log | grep -E "^decode|^profile|^routing|WARNING|FAILED|Error|built" \
  | tail -18
check "decode table"
IFS=';' read -ra arms <<< "${ARMS:-}"
ARMS_DIR=$(mktemp -d)  # the arms' JSON stay on the machine (8 files come back): arms.log holds their rows
for arm in "${arms[@]}"; do
  set -- $arm; name=$1; shift
  echo "== arm $name: $*" | tee -a $OUT/arms.log
  timeout ${T2:-80} python3 benchmarks/with_attrs.py "$@" -- benchmarks/decode_gpu.py --model flash40 \
    --batches ${ARM_BATCHES:-1 8} \
    --contexts 4096 --variants graphs --steps 5 --warmup 2 --prefill --out "$ARMS_DIR/$name.json" 2>&1 \
    | grep -v "\[TileLang:" | tee -a $OUT/arms.log | grep -E "^decode|Error" | tail -4
  check "arm $name"
done
[ "${DSPARK:-1}" = 0 ] || timeout ${T3:-170} python3 benchmarks/dspark_gpu.py --model flash40 --batches 1 8 64 \
  --accepted 0 2 3 --varlen --out $OUT/dspark.json 2>&1 | grep -v "\[TileLang:" | tee $OUT/dspark.log | tail -16
check "DSpark table"
IFS=';' read -ra darms <<< "${DSPARK_ARMS:-}"
for arm in "${darms[@]}"; do
  set -- $arm; name=$1; shift
  echo "== dspark arm $name: $*" | tee -a $OUT/arms.log
  timeout ${T5:-80} python3 benchmarks/with_attrs.py "$@" -- benchmarks/dspark_gpu.py --model flash40 \
    --batches ${DSPARK_ARM_BATCHES:-1} --accepted 0 2 3 --varlen --out "$ARMS_DIR/dspark_$name.json" 2>&1 \
    | grep -v "\[TileLang:" | tee -a $OUT/arms.log | grep -E "^flash40|Error" | tail -8
  check "DSpark arm $name"
done
[ -z "${MOE:-}" ] || timeout ${T4:-90} python3 benchmarks/moe_gpu.py --batches $MOE --probes --out $OUT/moe.json 2>&1 \
  | grep -v "\[TileLang:" | tee $OUT/moe.log | grep -E "B=|kernel|FAILED|Error" | tail -24
check "MoE op"
left=$(( ${LIMIT:-540} - SECONDS ))
if [ $left -gt 90 ]; then
  cd "$DEEPINFER_SITE" && timeout $left python3 -m pytest $GPU_TESTS/test_engine_batch_invariance.py -v -rf \
    -p no:cacheprovider -o addopts= 2>&1 | tee $OUT/bi_tests.log | grep -E "FAILED|ERROR|passed|failed" | tail -12
  check "batch-invariance tests"
else
  echo "batch-invariance tests not run: $left s left"
fi
finish decode40.sh
