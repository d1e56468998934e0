#!/usr/bin/env bash
# One GPU session for the fast runtime (issue "Fast runtime", benchmark 1): the fast backend's GPU-marked tests, then
# benchmarks.runtime.runtime_bench on SmolLM2-135M (random weights in its shape unless TARGET / ADAPTER name
# prepared folders), batch 1, T = 0. About 6-8 minutes on an H200; carry .whl (transformers >= 5.24).
#
#   OUT=out TFM_GIT_REV=$(git rev-parse HEAD) bash benchmarks/gpu/runtime.sh   # $OUT: tests.log, runtime_h200.json,
#                                                                              #   bench.log, session.txt
#   ARGS="--new-tokens 64" ...                                                 # extra benchmark options
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
T0=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/root/site:${PYTHONPATH:-}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
python3 -m benchmarks.gpu.wheels /root/site transformers >/tmp/wheels.log 2>&1 || cat /tmp/wheels.log
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$OUT/session.txt" 2>&1

timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fast_*.py tests/test_kernels_rms_norm_rope.py tests/test_kernels_weaver_frontier.py \
  >"$OUT/tests.log" 2>&1
echo "tests: $(tail -1 "$OUT/tests.log") ($(( $(date +%s) - T0 )) s)" | tee -a "$OUT/session.txt"

EXTRA=()
[ -n "${TARGET:-}" ] && EXTRA+=(--target "$TARGET")
[ -n "${ADAPTER:-}" ] && EXTRA+=(--adapter "$ADAPTER")
timeout $(( 570 - ($(date +%s) - T0) )) python3 -m benchmarks.runtime.runtime_bench --out "$OUT/runtime_h200.json" \
  "${EXTRA[@]}" ${ARGS:-} >"$OUT/bench.log" 2>&1
echo "bench: exit $? ($(( $(date +%s) - T0 )) s)" | tee -a "$OUT/session.txt"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -10
sed -n '/^engine /,$p' "$OUT/bench.log"
tail -5 "$OUT/bench.log" | grep -v "^engine" | grep -iE "error|Traceback" && tail -20 "$OUT/bench.log"
exit 0
