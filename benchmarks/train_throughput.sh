#!/usr/bin/env bash
# Tokens/s of the main job (examples/train.py) with ds_configs/zero2_coat.json against the BF16 + FusedAdam baseline
# (zero2_bf16) and FP8 optimizer states only (zero2_coat_optimizer_only), on one device, each run in its own process.
#   OUT=out bash benchmarks/train_throughput.sh                  # 125M Llama, 1024-token samples, 16 per step
#   SIZE=tiny SEQ=64 MB=2 STEPS=8 OUT=/tmp/o bash benchmarks/train_throughput.sh    # CPU smoke
# Run it from the repository root (its summary imports benchmarks.common). Writes $OUT/train_throughput.json (device,
# versions, commands, date, per-run tokens/s, memory, losses) and each run's console log. tokens/s is the median
# step after the first 3 (a step: data, fwd, bwd, optimizer, loss all-reduce).
set -u
SIZE=${SIZE:-125m} SEQ=${SEQ:-1024} MB=${MB:-16} STEPS=${STEPS:-60} OUT=${OUT:-benchmarks/results}
CONFIGS=${CONFIGS:-"zero2_bf16 zero2_coat zero2_coat_optimizer_only"}
export COAT_DATA_CACHE=${COAT_DATA_CACHE:-/tmp/coat_data_bench}
DATE=$(date -u +%FT%TZ)
mkdir -p "$OUT"
for c in $CONFIGS; do
  timeout "${RUN_TIMEOUT:-240}" deepspeed --num_gpus 1 examples/train.py --deepspeed "ds_configs/$c.json" \
    --model-size "$SIZE" --seq-len "$SEQ" --micro-batch "$MB" --steps "$STEPS" --eval-every 0 --eval-batches 2 \
    --save-every 0 --save-dir "/tmp/train_throughput_$c" > "$OUT/train_throughput_$c.log" 2>&1
  echo "$c rc=$?"
done
python3 - "$DATE" "$SIZE" "$SEQ" "$MB" "$STEPS" "$CONFIGS" <<'PY'
import json, os, sys
from benchmarks.common import device_name, versions
date, size, seq, mb, steps, configs = sys.argv[1:]
runs = {}
for c in configs.split():
    cmd = (f"deepspeed --num_gpus 1 examples/train.py --deepspeed ds_configs/{c}.json --model-size {size} "
           f"--seq-len {seq} --micro-batch {mb} --steps {steps} --eval-every 0 --eval-batches 2 --save-every 0")
    try:
        s = json.load(open(f"/tmp/train_throughput_{c}/summary.json"))
        train = [r for r in map(json.loads, open(f"/tmp/train_throughput_{c}/log.jsonl")) if r["kind"] == "train"]
    except OSError as e:
        runs[c] = {"command": cmd, "error": f"{e}; see train_throughput_{c}.log"}
        continue
    late = train[5:]
    runs[c] = {"command": cmd, **{k: s[k] for k in ("params", "tokens_per_step", "tokens_per_s", "peak_mem_gb",
                                                  "first_loss", "last_loss", "last_val_loss", "wall_s")},
               "tokens_per_s_mean_after_5": len(late) * s["tokens_per_step"] / sum(r["step_time_s"] for r in late)
               if late else None,
               "step_time_s": [round(r["step_time_s"], 4) for r in train], "loss": [round(r["loss"], 4) for r in train]}
bf16, coat = (runs.get(c, {}).get("tokens_per_s") for c in ("zero2_bf16", "zero2_coat"))
out = {"device": device_name(), "versions": versions(), "date": date,
       "command": f"CONFIGS=\"{configs}\" SIZE={size} SEQ={seq} MB={mb} STEPS={steps} bash benchmarks/train_throughput.sh",
       "tokens_per_s": "median over steps after the first 3; each step = data + fwd + bwd + optimizer + loss all-reduce",
       "coat_over_bf16_tokens_per_s": coat / bf16 if bf16 and coat else None, "runs": runs}
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "train_throughput.json"), "w"), indent=1)
print(json.dumps({c: [r.get("tokens_per_s"), r.get("peak_mem_gb"), r.get("last_loss")] for c, r in runs.items()}))
PY
