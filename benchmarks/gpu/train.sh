#!/usr/bin/env bash
# One GPU session for training throughput (issues: Train, 2-GPU training). Budget: about 4 minutes.
#
#   OUT=out TFM_GIT_REV=$(git rev-parse HEAD) bash benchmarks/gpu/train.sh        # 1 GPU
#   OUT=out GPUS=2 TFM_GIT_REV=... bash benchmarks/gpu/train.sh                    # 1 GPU, then 2
#   OUT=out SCORING=1 TFM_GIT_REV=... bash benchmarks/gpu/train.sh   # gather vs grouped scoring only
#
# SCORING=1: the grouped candidate scoring alone (benchmarks/kernels/bench_grouped_scoring.py: configurations, kernel
# profile), then training steps at 1024 rows (compiled) with it and with the gather kernels, on candidate sets
# replayed from a real model (benchmarks/data/smollm2_top512.npz); RUNS='uniform gather;replay grouped 8' picks
# other (candidates scoring [rows per group]) runs; PROFILE=1 adds the CUDA kernel table of 3 steps to each
# run's $OUT/<run>.stdout (where the ~36 ms of the step outside the scoring go); COMPILE_MODE=reduce-overhead
# (CUDA graphs) or max-autotune-no-cudagraphs picks the torch.compile mode. ~6 minutes.
#
# Weaver at the Qwen3.6-27B preset (56.7M parameters, hidden 5120, vocab 248320, 15 depths x 512 candidates)
# under DeepSpeed ZeRO-2 bf16, synthetic rows; global batches 64/128/256 on one GPU, then (GPUS=2) the same
# global batch on two GPUs through the deepspeed launcher, whose loss trace must match the 1-GPU run's.
# Wheels the image lacks (DeepSpeed and its needs) travel in .whl/; benchmarks/gpu/wheels.py installs them.
set -u -o pipefail
OUT=${OUT:-out}
GPUS=${GPUS:-1}
mkdir -p "$OUT" /tmp/logs
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/root/site:${PYTHONPATH:-}" NCCL_NVLS_ENABLE=0
python3 -m benchmarks.gpu.wheels /root/site deepspeed transformers >"$OUT/wheels.log" 2>&1 ||
  { cat "$OUT/wheels.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$OUT/session.txt" 2>&1
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_candidate_logits_grad.py \
  tests/test_kernels_candidate_logits.py >"$OUT/tests.log" 2>&1; tail -2 "$OUT/tests.log"
if [ "${SCORING:-0}" = 1 ]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_candidate_logits_grouped.py \
    >"$OUT/tests_grouped.log" 2>&1; tail -2 "$OUT/tests_grouped.log"
  timeout 200 python3 -m benchmarks.kernels.bench_grouped_scoring --out "$OUT/grouped_scoring.json" \
    >"$OUT/grouped_scoring.log" 2>&1; tail -4 "$OUT/grouped_scoring.log"
  IFS=';' read -ra R <<<"${RUNS:-replay grouped 4;replay gather}"
  for run in "${R[@]}"; do
    set -- $run
    name="train_gb1024_$1_$2${3:+_$3}"
    timeout 170 python3 -m benchmarks.pipelines.train_bench --preset qwen36_27b --global-batch 1024 --steps 10 \
      --warmup 3 --compile --compile-mode "${COMPILE_MODE:-default}" --candidates "$1" --step-scoring "$2" \
      --score-group "${3:-4}" --out "$OUT/$name.json" ${PROFILE:+--profile} 2>/tmp/logs/$name.err | tee "$OUT/$name.stdout" | tail -1 || tail -5 /tmp/logs/$name.err
  done
  exit 0
fi
for gb in 64 128 256; do
  timeout 150 python3 -m benchmarks.pipelines.train_bench --preset qwen36_27b --global-batch $gb --steps 20 --warmup 5 \
    --out "$OUT/train_1gpu_gb$gb.json" 2>/tmp/logs/gb$gb.err | tail -1 || tail -5 /tmp/logs/gb$gb.err
done
# the same step with the candidate rows materialised (weight[cand] + bmm), for the before/after
timeout 150 python3 -m benchmarks.pipelines.train_bench --preset qwen36_27b --global-batch 128 --steps 20 --warmup 5 \
  --torch-scores --out "$OUT/train_1gpu_gb128_torch.json" 2>/tmp/logs/torch.err | tail -1 || tail -5 /tmp/logs/torch.err
if [ "$GPUS" -ge 2 ]; then
  timeout 200 deepspeed --num_gpus 2 --master_port 29600 --module benchmarks.pipelines.train_bench \
    --preset qwen36_27b --global-batch 128 --steps 20 --warmup 5 --out "$OUT/train_2gpu_gb128.json" 2>/tmp/logs/2gpu.err | tail -1 || tail -5 /tmp/logs/2gpu.err
fi
