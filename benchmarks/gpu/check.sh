#!/usr/bin/env bash
# After a change to kernels, runtime or trainer: the GPU tests of every kernel, the engine, the fast backend, the
# Weaver and the rollout, then the headline figures once (GDN tree verify at 65 and 129 nodes, the Weaver training step at 1024
# rows, rollout tokens/s), to compare with the committed results. About 7 minutes on an H200; carry .whl (the
# engine tests need transformers >= 5.24).
#
#   OUT=out bash benchmarks/gpu/check.sh        # $OUT: gpu_tests.log, gdn.json, train.json, rollout.json, check.txt,
#                                               #   gpu_check_h200.json (benchmarks.gpu.check_report: against the
#                                               #   committed figures)
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/root/site:${PYTHONPATH:-}" TOKENIZERS_PARALLELISM=false
python3 -m benchmarks.gpu.wheels /root/site deepspeed transformers >/tmp/wheels.log 2>&1 || cat /tmp/wheels.log
T0=$(date +%s)
NPROC=$(python3 -c "import xdist" 2>/dev/null && echo "-n 6" || echo "")
timeout 300 python3 -m pytest -q -p no:cacheprovider $NPROC tests/test_kernels_*.py tests/test_engine*.py \
  tests/test_weaver.py tests/test_rollout*.py tests/test_target.py tests/test_acceptance.py $(ls tests/test_fast_*.py 2>/dev/null) \
  >"$OUT/gpu_tests.log" 2>&1
echo "tests: $(tail -1 "$OUT/gpu_tests.log") ($(( $(date +%s) - T0 )) s)" | tee "$OUT/check.txt"
timeout 150 python3 -m benchmarks.kernels.bench_gdn_tree --quick --n 65 129 --skip-check --no-fla \
  --out "$OUT/gdn.json" >/tmp/gdn.log 2>&1; echo "gdn: exit $? $(tail -3 /tmp/gdn.log | tr '\n' ' ')" | tee -a "$OUT/check.txt"
timeout 170 python3 -m benchmarks.pipelines.train_bench --preset qwen36_27b --global-batch 1024 --steps 10 \
  --warmup 3 --compile --candidates replay --out "$OUT/train.json" >/tmp/train.log 2>&1
echo "train: exit $? $(tail -1 /tmp/train.log)" | tee -a "$OUT/check.txt"
timeout 120 python3 -m benchmarks.runtime.rollout_bench --random-weights --big 0 --budget-s 90 \
  --out "$OUT/rollout.json" >/tmp/rollout.log 2>&1; echo "rollout: exit $? $(tail -2 /tmp/rollout.log | tr '\n' ' ')" | tee -a "$OUT/check.txt"
python3 -m benchmarks.gpu.check_report "$OUT" --out "$OUT/gpu_check_h200.json" | tee -a "$OUT/check.txt"
echo "done in $(( $(date +%s) - T0 )) s"
