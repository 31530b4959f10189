#!/usr/bin/env bash
# One device call: the routed experts' data paths (stream_probe_gpu.py), the bulk-copy MoE passes' GPU file, and
# the MoE op with them (moe_gpu.py --variants bulk: the op and each pass beside the default's).
# From the repo root on the device (carry [".devpack"]):  bash benchmarks/device/moe_bulk.sh
# PROBE_BATCHES / MOE_BATCHES (default 1,8,64,256); T1..T3: step limits.
set -o pipefail
export PYTHONUNBUFFERED=1
source benchmarks/gpu_env.sh
source benchmarks/device_steps.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout ${T1:-200} python3 benchmarks/stream_probe_gpu.py --batches ${PROBE_BATCHES:-1,8,64,256} \
  --out $OUT/stream_probe.json 2>&1 | grep -v "TileLang" | tee $OUT/stream_probe.log | tail -72
check "stream probe"
(cd "$DEEPINFER_SITE" && timeout ${T2:-200} python3 -m pytest $GPU_TESTS/test_tilelang_moe_bulk.py -v -rf \
  -p no:cacheprovider -o addopts= 2>&1) | tee $OUT/gpu_tests_moe_bulk.log | grep -E "PASS|FAIL|ERROR|passed|failed|Error" \
  | tail -14
check "bulk GPU tests"
timeout ${T3:-160} python3 benchmarks/moe_gpu.py --batches ${MOE_BATCHES:-1,8,64,256} --variants bulk \
  --out $OUT/moe_bulk.json 2>&1 | grep -v "TileLang" | tee $OUT/moe_bulk.log | grep -E "B=|kernel|bulk|self-check|Error" \
  | tail -40
check "MoE op with the bulk passes"
finish moe_bulk.sh
