#!/usr/bin/env bash
# The 2-GPU run behind benchmarks/results/zero_multi_gpu.json (after `. .whl/prelude.sh`), results in $OUT:
#   gpu_summary.json                   the gpu-marked launched jobs (trajectories, memory, checkpoints)
#   bench_coat.json / bench_fused.json  ZeRO-2 bf16 step time and per-rank state bytes, CoatAdamW vs FusedAdam
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/device.txt" 2>&1
# JIT builds first, side by side, so that no timed job pays for one (the wheelhouse's DeepSpeed has no prebuilt ops)
python3 -c "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()" > "$OUT/build.log" 2>&1 &
python3 -c "from coat_ds.kernels.loader import load_op; assert load_op('CoatAdamBuilder')" >> "$OUT/build.log" 2>&1 &
wait
COAT_ZERO_GPU_SUMMARY="$OUT/gpu_summary.json" timeout 160 python3 -m pytest tests/launched/test_deepspeed.py -m gpu -q -x \
  > "$OUT/pytest_gpu.log" 2>&1 || echo "pytest gpu failed: $?" >> "$OUT/errors.txt"
for opt in coat fused; do
  timeout 90 deepspeed --num_gpus 2 --master_port 29700 tests/ds_scripts/bench_zero2.py --opt $opt \
    --depth 12 --steps 8 --warmup 2 --out "$OUT/bench_$opt.json" > "$OUT/bench_$opt.log" 2>&1 || echo "bench $opt failed: $?" >> "$OUT/errors.txt"
done
tail -5 "$OUT/pytest_gpu.log"; cat "$OUT/errors.txt" 2>/dev/null; ls "$OUT"
