#!/usr/bin/env bash
# One device call, two GPUs (nvidia-h200-x2) or one: the lead's combined H200 runs.
#   bash benchmarks/h200_run.sh kernels   # GPU0: kernels.py; GPU1: profiler (new candidates), refit, selection
#   bash benchmarks/h200_run.sh check     # GPU0: kernels.py; GPU1: request_breakdown.py
#   bash benchmarks/h200_run.sh peers     # peers.py on two family halves (one per GPU), then the
#                                         # loops named in LOOPS0 / LOOPS1 (none by default)
#   bash benchmarks/h200_run.sh final     # both: profile halves + refit; GPU0: peers; GPU1: selection, loops
# Raw results, logs and the refitted table go to $OUT (copied into benchmarks/results/ and
# plan_tables/ afterwards). With one GPU the two halves run one after the other.
set -u
OUT=${OUT:?set OUT}
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
NGPU=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi.txt
python3 -c "import numba, numpy, jax; print('numba', numba.__version__, 'numpy', numpy.__version__, 'jax', jax.__version__)" > $OUT/versions.txt 2>&1
git_rev=$(cat .snap_rev 2>/dev/null || git rev-parse HEAD 2>/dev/null); echo "code $git_rev" >> $OUT/versions.txt
B=${BUDGET_S:-480}
# KERNELS_ARGS: extra kernels.py arguments (kernels, check), e.g. "--masks sta_cubes --check-timed-only".
gpu1=$([ "$NGPU" -ge 2 ] && echo 1 || echo 0)

case "${1:-}" in
kernels)
  # GPU0: kernels.py (correctness of every template, then timings with cuDNN, attention_mgpu,
  # FlexAttention and the Triton lowering). GPU1: the profiler on the candidates C, resuming
  # from the committed raw timings (so only new candidates are timed), the refit, then the
  # selection benchmark, which reuses the committed selection run's times of the old
  # candidates (same test masks) and times only the new ones.
  T=${TEMPLATES:-mgpu_q128_kv128_s2_hm,mgpu_q64x2_kv64_s2_hm,mgpu_q64x2pp_kv64_s2_hm,mgpu_q128_kv64_s2_hm}
  C=${CANDIDATES:-mgpu_q128_kv128_s2_hm/merge mgpu_q128_kv128_s2_hm/split mgpu_q128_kv64_s2_hm/merge mgpu_q64x2_kv64_s2_hm/pack mgpu_q64x2_kv64_s2_hm/merge mgpu_q128_kv64_s2_skip/pack mgpu_q64x2pp_kv64_s2_hm/pack}
  first() { CUDA_VISIBLE_DEVICES=0 timeout $((B + 60)) python3 benchmarks/kernels.py --out $OUT/h200-kernels.json \
      --budget-s $((B - 30)) --wan720-heads 4 --templates $T --triton ${TRITON_N:-2} ${KERNELS_ARGS:-} > $OUT/kernels.log 2>&1; }
  second() {
    export CUDA_VISIBLE_DEVICES=$gpu1
    chmod u+w plan_tables/raw/h200.jsonl plan_tables/h200.json
    timeout $((B * 45 / 100 + 60)) python3 -m tessera_jax.tools.profiler --heads 2 --time-budget $((B * 45 / 100)) \
      --candidates $C > $OUT/profile.log 2>&1
    cp plan_tables/h200.json $OUT/h200-table.json; cp plan_tables/raw/h200.jsonl $OUT/h200-raw.jsonl
    timeout $((B * 45 / 100 + 40)) python3 benchmarks/selection.py --table plan_tables/h200.json --heads 2 \
      --no-resume --reuse-times benchmarks/results/h200-selection.json --time-budget $((B * 45 / 100)) \
      --out $OUT/h200-selection.json > $OUT/selection.log 2>&1
  } ;;
check)
  # GPU0: kernels.py (every template's correctness, then the timings); GPU1: where a request's
  # time goes on this host (request_breakdown.py: parts, gc, cProfile, THP / first-touch cost).
  T=${TEMPLATES:-mgpu_q128_kv128_s2_hm,mgpu_q64x2_kv64_s2_hm,mgpu_q64x2pp_kv64_s2_hm,mgpu_q128_kv64_s2_hm}
  first() { CUDA_VISIBLE_DEVICES=0 timeout $((B + 60)) python3 benchmarks/kernels.py --out $OUT/h200-kernels.json \
      --budget-s $((B - 30)) --wan720-heads 4 --templates $T --triton ${TRITON_N:-2} ${KERNELS_ARGS:-} > $OUT/kernels.log 2>&1; }
  second() { CUDA_VISIBLE_DEVICES=$gpu1 timeout $((B + 30)) python3 benchmarks/request_breakdown.py \
      --out $OUT/h200-request-breakdown.json > $OUT/breakdown.log 2>&1; } ;;
peers)
  # Each GPU: peers.py on its half of the families, then the loop cases of LOOPS0 / LOOPS1, one
  # process per case (a case cut by its time limit does not take the others with it); one result
  # file per GPU, merged at the end into h200-peers.json and h200-loop.json.
  export FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
  loops() {  # loops GPU FILE CASE...
    local g=$1 f=$2; shift 2
    for m in "$@"; do
      # 25 of 50 steps; Wan's 12/50 dense warm-up steps scaled to 6/25, Hunyuan has none.
      case $m in hunyuan*) dense="" ;; *) dense="--dense-steps 6" ;; esac
      eval "t=\${LOOP_S_$m:-${LOOP_CASE_S:-250}}"  # per-case limit, e.g. LOOP_S_wan13b_480p=280
      CUDA_VISIBLE_DEVICES=$g timeout $t python3 benchmarks/bench_loop.py --models $m $dense \
        ${LOOP_ARGS:---steps 25 --loop-repeats 1 --step-repeats 3 --attn-repeats 10} \
        --out $f >> $OUT/loop-gpu$g.log 2>&1
    done; }
  # peers.py over two halves of the families, one per GPU (own FlashInfer JIT workspace each).
  FIPATH=${FIPATH:-$PWD/.carry/flashinfer_site}
  peers_half() {  # peers_half GPU FAMILIES
    CUDA_VISIBLE_DEVICES=$1 FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws$1 PYTHONPATH=$FIPATH:$PYTHONPATH \
      timeout $((B + 60)) python3 benchmarks/peers.py --out $OUT/peers-gpu$1.json --time-budget $B \
      --per-family ${PER_FAMILY:-2} --heads 8 --families $2 ${PEERS_ARGS:-} > $OUT/peers-gpu$1.log 2>&1; }
  # GPU0's half also measures issue 33's first plan of a fresh install (peers.py --first-plan).
  first() { PEERS_ARGS="${PEERS_ARGS:-} --first-plan ${FIRST_PLAN_S:-150}" \
      peers_half 0 ${FAMILIES_A:-dense,jenga,natten,sparge,sta,svg2,xattn}
    [ -n "${LOOPS0:-}" ] && loops 0 $OUT/loop-gpu0.json $LOOPS0; }
  second() { peers_half $gpu1 ${FAMILIES_B:-ditfastattn,moba,radial,ssta,svg,vsa}
    [ -n "${LOOPS1:-}" ] && loops $gpu1 $OUT/loop-gpu1.json $LOOPS1
    # Optional: request_breakdown.py on the masks named in BREAKDOWN_MASKS after this half.
    [ -n "${BREAKDOWN_MASKS:-}" ] && CUDA_VISIBLE_DEVICES=$gpu1 timeout ${BREAKDOWN_S:-100} \
      python3 benchmarks/request_breakdown.py --masks $BREAKDOWN_MASKS --iters 3 \
      --out $OUT/h200-request-breakdown.json > $OUT/breakdown.log 2>&1; }
  merge() {
    python3 benchmarks/peers.py --merge $OUT/peers-gpu*.json --out $OUT/h200-peers.json > $OUT/peers-merge.log 2>&1
    ls $OUT/loop-gpu*.json > /dev/null 2>&1 && python3 benchmarks/bench_loop.py --merge $OUT/loop-gpu*.json \
      --out $OUT/h200-loop.json > $OUT/loop-merge.log 2>&1; } ;;
final)
  # GPU0 + GPU1: profile the candidates on two halves of the families (own raw files), merge, refit
  # plan_tables/h200.json; then GPU0: peers (new table); GPU1: selection benchmark, then the loops.
  # FlashInfer's JIT build runs in the background (CPU-bound) during the profiling.
  export FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
  FIPATH=${FIPATH:-$PWD/.carry/flashinfer_site}
  PB=${PROFILE_S:-170}; PEERS_B=${PEERS_S:-350}; SEL_B=${SELECTION_S:-140}; LOOP_T=${LOOP_S:-230}
  C=${CANDIDATES:-mgpu_q128_kv128_s2_hm/merge mgpu_q128_kv128_s2_hm/split mgpu_q128_kv64_s2_hm/merge mgpu_q64x2_kv64_s2_hm/pack mgpu_q64x2_kv64_s2_hm/merge mgpu_q128_kv64_s2_skip/pack}
  FA=${FAMILIES_A:-dense jenga natten sparge sta svg2 xattn}
  FB=${FAMILIES_B:-ditfastattn moba radial ssta svg vsa}
  (CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$FIPATH:$PYTHONPATH timeout 400 python3 benchmarks/peers.py \
      --fi-warmup-only > $OUT/fi_warmup.log 2>&1) &
  N0=$(wc -l < plan_tables/raw/h200.jsonl)
  for h in A B; do mkdir -p /tmp/raw$h; cat plan_tables/raw/h200.jsonl > /tmp/raw$h/h200.jsonl; done; chmod u+w plan_tables/raw/h200.jsonl plan_tables/h200.json
  CUDA_VISIBLE_DEVICES=0 timeout $((PB + 60)) python3 -m tessera_jax.tools.profiler --heads 2 --time-budget $PB \
      --candidates $C --families $FA --raw /tmp/rawA --out /tmp/tableA.json > $OUT/profileA.log 2>&1 & pa=$!
  CUDA_VISIBLE_DEVICES=$gpu1 timeout $((PB + 60)) python3 -m tessera_jax.tools.profiler --heads 2 --time-budget $PB \
      --candidates $C --families $FB --raw /tmp/rawB --out /tmp/tableB.json > $OUT/profileB.log 2>&1 & pb=$!
  wait $pa $pb
  cp /tmp/rawA/h200.jsonl plan_tables/raw/h200.jsonl
  tail -n +$((N0 + 1)) /tmp/rawB/h200.jsonl >> plan_tables/raw/h200.jsonl
  python3 -m tessera_jax.tools.profiler --fit-only --heads 2 --candidates $C > $OUT/fit.log 2>&1
  cp plan_tables/h200.json $OUT/h200-table.json; cp plan_tables/raw/h200.jsonl $OUT/h200-raw.jsonl
  first() { CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$FIPATH:$PYTHONPATH timeout $((PEERS_B + 40)) \
      python3 benchmarks/peers.py --out $OUT/h200-peers.json --time-budget $PEERS_B --per-family 2 \
      --heads 8 --first-plan ${FIRST_PLAN_S:-150} > $OUT/peers.log 2>&1; }
  second() {
    export CUDA_VISIBLE_DEVICES=$gpu1
    timeout $((SEL_B + 30)) python3 benchmarks/selection.py --table plan_tables/h200.json --heads 2 \
      --no-resume --time-budget $SEL_B --out $OUT/h200-selection.json > $OUT/selection.log 2>&1
    timeout $LOOP_T python3 benchmarks/bench_loop.py ${LOOP_ARGS:---models wan13b_480p --steps 25 \
      --dense-steps 6 --loop-repeats 1 --step-repeats 3 --attn-repeats 20} --out $OUT/h200-loop.json \
      > $OUT/loop.log 2>&1
  } ;;
*) echo "usage: $0 kernels|check|peers|final" >&2; exit 2 ;;
esac

if [ "$NGPU" -ge 2 ]; then first & second & wait; else first; second; fi
declare -F merge > /dev/null && merge
nvidia-smi --query-gpu=index,clocks.sm,temperature.gpu --format=csv >> $OUT/smi.txt
for f in $OUT/*.log; do echo "== $f"; tail -8 "$f"; done
# At most 8 files come back from a device call: everything goes into one archive.
tar czf /tmp/results.tgz -C $OUT . && find $OUT -type f -delete && mv /tmp/results.tgz $OUT/
ls -la $OUT
