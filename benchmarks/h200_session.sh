#!/usr/bin/env bash
# The one-H200 calls of benchmarks/NOTES.md section 20 (issues 17, 18, 16, 19), each
# under the 10-minute call limit; every script saves partial results, so a part cut by its
# `timeout` keeps what it measured. Raw files and logs go to $OUT.
# Session 12 ran builders-vsa, backward, svg2 (then without the unpadded parts) and diagnose:
#   bash benchmarks/h200_session.sh builders-vsa  # builder costs at 720p; Wan 1.3B 480p VSA loop (3 runs, host once)
#   bash benchmarks/h200_session.sh backward      # grad checks (paired dk/dv), the training step's time and memory
#   bash benchmarks/h200_session.sh svg2          # Wan 14B 720p SVG2 loop (host, null); fwd+bwd with the new dk/dv score
#   bash benchmarks/h200_session.sh device-planning  # Wan 480p VSA and Wan 720p device planning + route
#   bash benchmarks/h200_session.sh diagnose      # training memory's buffer assignment, the 480p VSA route, fused k-means
# (Session 11's parts, builders / train-sparge / loops / train-svg2, are in git history.)
set -u
OUT=${OUT:?set OUT}
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/smi.txt
run() {   # run SECONDS NAME CMD...: one part, its log in $OUT/NAME.log
  local s=$1 name=$2; shift 2
  echo "[$(date +%T)] $name ($s s)"
  timeout "$s" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "[$(date +%T)] $name rc $rc"
}
# The faster of a builder and its control in $OUT/builders.json, as bench_loop's switch:
#   pick BASE CONTROL KEY BASE_VALUE CONTROL_VALUE (nothing when either was not measured).
pick() {
  python3 - "$OUT/builders.json" "$@" <<'PY' 2>/dev/null
import json, sys
path, base, ctl, key, vb, vc = sys.argv[1:]
v = json.load(open(path))["builder_costs"]["variants"]
tb, tc = v[base].get("build_s"), v[ctl].get("build_s")
if tb and tc:
    print(f"--builder-switch {key}={vb if tb <= tc else vc}")
PY
}
# Loops take SWITCHES when given, else the picks of the `builders` part of the same call.
SW=${SWITCHES:-}
case "${1:-}" in
builders-vsa)
  run 150 builders python3 -m tessera_jax.tools.bench_loop --out $OUT/builders.json \
      --builder-costs vsa,vsa_sort,sparge_topk,sparge_topk_sort,svg2_iters1,svg2_iters1_matmul,svg2_iters1_label,svg2_iters1_fused
  SW=${SWITCHES:-$(pick vsa vsa_sort TOP_K radix sort)}
  echo "loop-vsa switches: $SW"
  run 330 loop-vsa python3 -m tessera_jax.tools.bench_loop --models wan13b_480p_vsa --steps 25 \
      --loop-repeats 3 $SW --out $OUT/loop-vsa.json ;;
backward)
  run 230 bwd-checks python3 benchmarks/backward.py --sections checks,grad --budget-s 215 \
      --out $OUT/bwd-checks.json
  run 190 bwd-train python3 benchmarks/backward.py --sections train --train-variants sparse \
      --layers 30 --steps 5 --budget-s 180 --out $OUT/bwd-train.json ;;
svg2)
  SW=${SWITCHES:-$(pick svg2_iters1 svg2_iters1_matmul KMEANS_SUMS scatter matmul)}
  echo "loop-svg2 switches: $SW"
  run 400 loop-svg2 python3 -m tessera_jax.tools.bench_loop --models wan14b_720p_svg2 \
      $SW --out $OUT/loop-svg2.json
  run 150 bwd-kernels python3 benchmarks/backward.py --sections kernels --no-dkv-controls \
      --budget-s 140 --out $OUT/bwd-kernels.json ;;
device-planning)
  run 90 device-planning-vsa480 python3 benchmarks/device_planning.py --grids wan480 \
      --route-grids wan480 --heads 12 --families vsa --no-checks --budget-s 80 \
      --out $OUT/device-planning-vsa480.json
  run 150 device-planning python3 benchmarks/device_planning.py --grids wan720 --route-grids wan720 \
      --families svg2,sparge,natten,ditfastattn --no-checks --budget-s 130 --out $OUT/device-planning.json ;;
diagnose)
  # Where the sparse training step's extra 196 MB sit (4 layers, compile only, XLA's buffer
  # assignment of each variant), the device route's split at Wan 480p VSA, the fused k-means.
  for v in sparse dense; do
    mkdir -p $OUT/xla-$v
    run 80 mem-$v env XLA_FLAGS="--xla_dump_to=$OUT/xla-$v --xla_dump_hlo_module_re=jit_step" \
        python3 benchmarks/backward.py --sections train --train-variants $v --layers 4 --steps 0 \
        --budget-s 75 --out $OUT/mem-$v.json
    find $OUT/xla-$v -type f ! -name '*buffer-assignment*' ! -name '*memory-usage-report*' \
        ! -name '*after_optimizations.txt' -delete
  done
  tar -czf $OUT/xla-dumps.tar.gz -C $OUT xla-sparse xla-dense && rm -rf $OUT/xla-sparse $OUT/xla-dense
  run 90 device-planning-vsa480 python3 benchmarks/device_planning.py --grids wan480 \
      --route-grids wan480 --heads 12 --families vsa --no-checks --budget-s 80 \
      --out $OUT/device-planning-vsa480.json
  run 80 builders-fused python3 -m tessera_jax.tools.bench_loop --out $OUT/builders-fused.json \
      --builder-costs svg2_iters1,svg2_iters1_fused
  tar -czf $OUT/logs.tar.gz -C $OUT $(cd $OUT && ls *.log) && rm -f $OUT/*.log ;;
*) echo "usage: OUT=dir [SWITCHES=...] bash benchmarks/h200_session.sh builders-vsa|backward|svg2|device-planning|diagnose" >&2; exit 2 ;;
esac
