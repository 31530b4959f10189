#!/usr/bin/env bash
# One device call (~2-4 min on Firecracker, where ncu reads the counters): Nsight Compute on the decode attention
# kernel at prefill's one-split shape (benchmarks/attention_ncu_gpu.py; B=2048 queries, 32K context): the details
# page (throughputs, tensor pipe, warp stall reasons, shared-memory bank conflicts) as text and the stall samples of
# every SASS instruction as gzipped CSV, which place each warp role's waits where the probes only take differences.
# From the repo root on the device (carry [".devpack"]):  bash benchmarks/device/attention_ncu.sh
# ARMS: "default" and/or attention_decode_kernel.PROBES entries (default: "default"); B: queries; T1: each arm's limit.
# A step that fails or times out is named at the end and the call exits 1 (device_steps.sh).
set -o pipefail
export PYTHONUNBUFFERED=1
source benchmarks/gpu_env.sh
source benchmarks/device_steps.sh
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
[ -n "$NCU" ] || { echo "STEP FAILED: no ncu on this machine"; exit 1; }
REPS=$(mktemp -d)  # the reports stay on the machine; their text pages come back under $OUT
for arm in ${ARMS:-default}; do
  probe= && [ "$arm" != default ] && probe=$arm
  name=$(echo "$arm" | tr '+' '_')
  timeout ${T1:-240} "$NCU" --target-processes application-only --clock-control none \
    --kernel-name regex:sink_attention_decode --launch-skip 1 --launch-count 1 --set full --import-source no \
    -f -o "$REPS/$name" python3 benchmarks/attention_ncu_gpu.py --batch ${B:-2048} --probe "$probe" 2>&1 \
    | grep -v "\[TileLang:" | tail -6
  check "ncu $arm"
  "$NCU" --import "$REPS/$name.ncu-rep" --page details > $OUT/ncu_${name}_details.txt 2>&1
  check "ncu $arm details"
  "$NCU" --import "$REPS/$name.ncu-rep" --page source --print-source sass --csv 2>&1 \
    | gzip > $OUT/ncu_${name}_sass.csv.gz
  check "ncu $arm sass"
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Bank" \
    $OUT/ncu_${name}_details.txt | head -12
done
finish attention_ncu.sh
