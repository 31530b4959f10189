source benchmarks/gpu_env.sh && R=$PWD && cd "$DEEPINFER_SITE" && export TILELANG_CACHE_DIR=/tmp/tlcache
t0=$(date +%s)
timeout 330 python3 $R/benchmarks/dspark_gpu.py --model flash40 --batches 1 64 --profile 1:plain 1:0 64:plain 64:2 --out $OUT/dspark_gpu_flash40_profiled_h200.json > $OUT/dspark.log 2>&1; echo "dspark rc=$? $(( $(date +%s)-t0 ))s"; grep -v -i "tilelang\|warn" $OUT/dspark.log | tail -32
timeout 200 python3 $R/benchmarks/decode_gpu.py --model flash40 --batches 1 64 --contexts 4096 --variants graphs --prefill --profile 1:4096,64:4096 --out $OUT/decode_gpu_flash40_profiled_h200.json > $OUT/decode.log 2>&1; echo "decode rc=$? $(( $(date +%s)-t0 ))s"; grep -v -i "tilelang" $OUT/decode.log | tail -45
