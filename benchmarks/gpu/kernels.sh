#!/usr/bin/env bash
# One GPU session for the Triton kernels: GPU tests of the three kernel test files, the GDN tree
# benchmark, the tree-attention benchmark at its default configurations and the candidate-logits
# benchmark. Everything goes to $OUT (default ./out); a short table is printed last. Budget: about
# 9 minutes on an H200.
#
#   OUT=out TFM_GIT_REV=$(git rev-parse HEAD) bash benchmarks/gpu/kernels.sh
#   KERNELS="gdn_tree" ...     # only these kernels' tests (and phase 3 only with tree_attention)
#
# Phase 1 runs the tests in parallel with a compile/autotune warm-up of the GDN benchmark (same
# kernels and shapes, no timing), so that the timed phases hit the Triton caches (fla autotune
# results included). Phase 2 and 3 time on an otherwise idle GPU.
set -u
OUT=${OUT:-out}
L=/tmp/kernel_logs  # per-process logs; $OUT gets at most 8 files
mkdir -p "$OUT" $L
T0=$(date +%s)
left() { echo $((T0 + $1 - $(date +%s))); }
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:/root/site:${PYTHONPATH:-}"
python3 -m benchmarks.gpu.wheels /root/site >$L/wheels.log 2>&1 || cat $L/wheels.log   # fla for the baseline
KERNELS=${KERNELS:-gdn_tree tree_attention candidate_logits}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$OUT/session.txt" 2>&1

# phase 1: tests (GPU) + warm-up, in parallel
timeout 200 python3 -m benchmarks.kernels.bench_gdn_tree --warm >$L/warm.log 2>&1 &
for t in $KERNELS; do
  n=2; extra=""
  # the GDN kernels also inside the decoder: q/k/v come from the kernels before them (PDL ordering)
  [ $t = gdn_tree ] && n=6 && extra=tests/test_engine_gdn_triton.py
  (timeout 280 python3 -m pytest -q -p no:cacheprovider -n $n "tests/test_kernels_$t.py" $extra \
     >$L/test_$t.log 2>&1; echo "exit=$?" >>$L/test_$t.log) &
done
wait
for t in $KERNELS; do
  echo "===== tests/test_kernels_$t.py"; cat $L/test_$t.log
done >"$OUT/tests.log"
{ echo "===== warm-up (tail)"; tail -20 $L/warm.log; } >>"$OUT/session.txt"
echo "phase 1 done at $(( $(date +%s) - T0 ))s" | tee -a "$OUT/session.txt"

# phase 2: GDN benchmark (optional timings and checks stop at its budget)
B=$(left 420)
timeout $((B + 35)) python3 -m benchmarks.kernels.bench_gdn_tree --out "$OUT/gdn_tree_h200.json" \
  --budget-s $B --check-jobs 6 >"$OUT/bench_gdn.log" 2>&1
rc=$?; echo "phase 2 (budget ${B}s) done at $(( $(date +%s) - T0 ))s, exit $rc" | tee -a "$OUT/session.txt"

# phase 3: tree attention, default configurations on all cases
case " $KERNELS " in *" tree_attention "*)
timeout $(left 510) python3 -m benchmarks.kernels.bench_tree_attention --no-sweep \
  --out "$OUT/tree_attention_h200.json" >"$OUT/bench_ta.log" 2>&1
rc=$?; echo "phase 3 done at $(( $(date +%s) - T0 ))s, exit $rc" | tee -a "$OUT/session.txt";;
esac

# phase 4: candidate logits, all cases, and the sweep from SWEEP[$CL_SWEEP_FROM] (default: session 9's entries)
case " $KERNELS " in *" candidate_logits "*)
timeout $(left 585) python3 -m benchmarks.kernels.bench_candidate_logits --sweep-from ${CL_SWEEP_FROM:-13} \
  --out "$OUT/candidate_logits_h200.json" >"$OUT/bench_cl.log" 2>&1
rc=$?; echo "phase 4 done at $(( $(date +%s) - T0 ))s, exit $rc" | tee -a "$OUT/session.txt";;
esac

for t in $KERNELS; do
  echo "== test_kernels_$t: $(grep -E 'passed|failed|error' $L/test_$t.log | tail -1) $(tail -1 $L/test_$t.log)"
done
grep -hE "^(FAILED|ERROR)" $L/test_*.log | head -20
tail -3 $L/warm.log
sed -n '/^correctness:/,$p' "$OUT/bench_gdn.log"
[ -f "$OUT/bench_ta.log" ] && sed -n '/^ *L  *n  *triton/,$p' "$OUT/bench_ta.log"
[ -f "$OUT/bench_cl.log" ] && sed -n '/^ *M  *Kc/,$p' "$OUT/bench_cl.log" | grep -v sweep
grep phase "$OUT/session.txt"
