#!/usr/bin/env bash
# Issue 15, build item 4: re-profile the H200 ranking table with the token-level corpus family
# and the candidates' current plans (bitmap steps), refit it, and score the new table, in one
# device call of BUDGET_S seconds (default 540) on one H200.
#
#   OUT=/path/to/out bash benchmarks/h200_selection_refresh.sh
#
# Stages, in order of value; each is bounded by its own budget and by what is left of BUDGET_S
# (a stage with no time left is skipped), and each resumes from what earlier calls brought back,
# so a call cut short is continued by running this again after copying the results in (below):
#   1. profile: the "tokens" family's train specs, every candidate (PROFILE_TOK_S, 300 s;
#      TOK_MASKS=N samples N of its 24 specs)
#   2. profile: the other families' 65 masks the table was fitted on (--max-masks 65), pairs
#      timed under another rule or on another plan (--remeasure-stale: all 455 of the committed
#      raw file, which predates rules and digests) (PROFILE_OLD_S, default 0: a later call)
#   3. fit the table on every mask of the raw file whose candidates share one timing rule
#   4. selection.py on the tokens test specs (SEL_TOK_S, 100 s)
#   5. selection.py on the other families' test specs (SEL_OLD_S, the rest)
# Selection always re-chooses with the new table and reuses only times taken on the same plan
# (plan digest) under the same rule: --reuse-times, never --resume.
#
# Predicted (CPU counts of issue 15; rates from session 3's profile, 1.2 s a pair, plus this
# box's planning times: token pairs ~1.7 s, token test pairs ~2.5 s): the whole refresh is
# 168 token pairs (~285 s) + 455 old pairs (~545 s) + fit + 42 token test pairs (~105 s) + 448
# old test pairs (64 masks, ~570 s) + process starts: ~1,600 s, three calls. The defaults are
# call 1 (~510 s): tokens profiled, table refit, tokens scored, the rest for a few old masks.
#   call 2: PROFILE_TOK_S=0 PROFILE_OLD_S=420 SEL_TOK_S=0 SEL_OLD_S=0 (old pairs, ~350 of 455)
#   call 3: PROFILE_TOK_S=0 PROFILE_OLD_S=130 SEL_TOK_S=0 (the rest; then ~30 old test masks)
# (each after copying the previous call's files back; selection rows of the same plan and rule
# are reused, so call 3 re-times none of call 1's).
#
# In $OUT (one archive, results.tgz): h200.jsonl (raw timings: every earlier record plus this
# call's), h200.json (the table), h200-selection-tokens.json, h200-selection.json, *.log,
# versions.txt. Copy back: h200.jsonl -> plan_tables/raw/h200.jsonl, h200.json ->
# plan_tables/h200.json, h200-selection*.json -> benchmarks/results/.
set -u
OUT=${OUT:?set OUT}
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
B=${BUDGET_S:-540}
END=$((SECONDS + B - ${RESERVE_S:-20}))       # the archive at the end
# A stage's grace past its --time-budget: process start (jax, CUDA, numba) and the work in
# flight when the budget runs out (profiler: one pair; selection: one mask's candidates and the
# selection-cost section).
PROFILE_GRACE_S=${PROFILE_GRACE_S:-30}; SELECTION_GRACE_S=${SELECTION_GRACE_S:-50}
C=${CANDIDATES:-mgpu_q128_kv128_s2_hm/merge mgpu_q128_kv128_s2_hm/split mgpu_q128_kv64_s2_hm/merge mgpu_q64x2_kv64_s2_hm/pack mgpu_q64x2_kv64_s2_hm/merge mgpu_q128_kv64_s2_skip/pack mgpu_q64x2pp_kv64_s2_hm/pack}
OLD="dense ditfastattn jenga moba natten radial sparge ssta sta svg svg2 vsa xattn"

# budget WANT GRACE: seconds a stage may measure: WANT, capped by what is left after its grace.
budget() { local left=$((END - SECONDS - $2)); [ "$1" -lt "$left" ] && echo "$1" || echo "$left"; }
# run LOG WANT GRACE CMD...: CMD with --time-budget under a hard limit of budget + GRACE;
# skipped when less than 10 s would be left to measure.
run() {
  local log=$1 b=$(budget $2 $3) g=$3; shift 3
  if [ "$b" -lt 10 ]; then echo "[refresh ${SECONDS}s] $log: skipped (no time left)" >> $OUT/stages.txt; return; fi
  echo "[refresh ${SECONDS}s] $log: budget ${b}s" >> $OUT/stages.txt
  timeout $((b + g)) "$@" --time-budget $b > $OUT/$log 2>&1
  echo "[refresh ${SECONDS}s] $log: exit $?" >> $OUT/stages.txt
}

python3 -c "import numba, numpy, jax; print('numba', numba.__version__, 'numpy', numpy.__version__, 'jax', jax.__version__)" > $OUT/versions.txt 2>&1
echo "code $(cat .snap_rev 2>/dev/null || git rev-parse HEAD 2>/dev/null)" >> $OUT/versions.txt
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem,temperature.gpu --format=csv >> $OUT/versions.txt 2>&1
mkdir -p $OUT/raw
cp plan_tables/raw/h200.jsonl $OUT/raw/h200.jsonl
# PROFILE_ARGS / SELECTION_ARGS: extra arguments (a CPU smoke run: "--iters 1 --warmup 1").
PROF="python3 -m tessera_jax.tools.profiler --gpu h200 --heads 2 --raw $OUT/raw --out $OUT/h200.json --remeasure-stale ${PROFILE_ARGS:-} --candidates $C"

run profile-tokens.log ${PROFILE_TOK_S:-300} $PROFILE_GRACE_S $PROF --families tokens ${TOK_MASKS:+--max-masks $TOK_MASKS}
run profile-old.log ${PROFILE_OLD_S:-0} $PROFILE_GRACE_S $PROF --families $OLD --max-masks 65
timeout 120 $PROF --fit-only > $OUT/fit.log 2>&1
echo "[refresh ${SECONDS}s] fit: exit $?" >> $OUT/stages.txt

SEL="python3 benchmarks/selection.py --table $OUT/h200.json --heads 2 --no-resume ${SELECTION_ARGS:-}"
prev() { [ -f "benchmarks/results/$1" ] && echo "--reuse-times benchmarks/results/$1"; }
[ -f $OUT/h200.json ] && run selection-tokens.log ${SEL_TOK_S:-100} $SELECTION_GRACE_S $SEL --families tokens \
  --sel-masks 0 $(prev h200-selection-tokens.json) --out $OUT/h200-selection-tokens.json
[ -f $OUT/h200.json ] && run selection.log ${SEL_OLD_S:-1000} $SELECTION_GRACE_S $SEL --families $OLD \
  $(prev h200-selection.json) --out $OUT/h200-selection.json

cp $OUT/raw/h200.jsonl $OUT/h200.jsonl && rm -r $OUT/raw
for f in $OUT/*.log; do echo "== $f"; tail -4 "$f"; done
cat $OUT/stages.txt
tar czf /tmp/results.tgz -C $OUT . && find $OUT -type f -delete && mv /tmp/results.tgz $OUT/
ls -la $OUT
