#!/usr/bin/env bash
# One-H200 calls for the backward, training memory and mask builders (benchmarks/NOTES.md
# #backward, #training-memory, #mask-builders), each under the 10-minute call limit; every
# script saves partial results, so a part cut by its `timeout` keeps what it measured. Raw
# files and logs go to $OUT.
# Session 20 ran gpu-checks (make test-gpu 29/29) and the gathered fwd + bwd
# (results/h200-test-gpu.log, h200-gather-fwd-bwd.json). Session 22 got an H100 (stage-tx
# killed, results/h100-*). Session 23 (an H200): the device-gather cases of make test-gpu
# (passed, h200-test-gpu-gather.log), device-gather-check (dg-blockrank landed; the gathering
# template loses on the device route: Options.device_gather stays "never"), perhead_diag.py,
# the three-stage and copy-run spikes (killed, deleted: h200-gather-stages.json,
# h200-gather-runs-skip.json), accept-480 (h200-gather-wan480.json); accept-720 failed in the
# benchmark's own reference check (a [75,600]^2 float32 score matrix; now sampled query rows).
# Session 24 got only an H100 for three short calls (results/h100-*): the cp.async stages
# spike (killed, deleted) and perhead-diag (e2fc23f's rule confirmed; the words cond kept).
# Session 25 got an H100 for most calls and an H200 twice (results/h100-perhead-diag-s25.json,
# h200-plan-profile-before.json, h100-plan-profile.json, h100-perhead-diag-planner.json): the
# per-head kernels equal the shared ones; the device planner's while loops removed.
# Session 26 (H100, results/h100-route-gap*.json): the device route's padding copies and the
# units' sort gone (device / host 1.035-1.076, clusters 1.144); the conditionals' layout copy
# found and removed (core._cond), not yet compiled on a GPU.
# Session 27 (H100; three of six machine starts failed): direct-check (make test-gpu 37/37 with
# the in-place row stores and session 26's planner code; results/h100-route-gap.json), then
# direct-ab (results/h100-direct-store.json; its make test-gpu cut at 210 s, the q128_kv64 and
# device cases rerun: h100-test-gpu-dq.log).
# Session 28 (H200, then an H100): make test-gpu 37/37 (-n 8, 320 s; at -n 6 it passed 330 s),
# route-gap (results/h200-route-gap.json), accept-720 and accept-480 (results/h200-gather.json;
# Wan 720p clusters' device and per-head calls ran the exact path: fixed, then measured on the
# H100, results/h100-clusters-device.json).
# Session 29 (one H200 call, then an H100 for three): the split-ring spike (killed, reverted:
# results/h200-split-rings.json), profile-gather (on the H100: plan_tables/raw/h100.jsonl, no
# table shipped), gpu-checks (39/39, results/h100-test-gpu.log), perhead-diag (3b18bad kept,
# results/h100-perhead-diag.json).
# Session 30 (an H100 for every call; no H200 came): multicast (killed:
# results/h100-multicast-spike.json), accept (results/h100-gather.json), profile-gather resumed
# with --gpu h100 (plan_tables/h100.json shipped), and the two tables in one call
# (results/h100-table-ab.json).
# Session 31 (an H100; two machine starts failed): peers at Wan 480p before and after tiered
# planning became the default (results/h100-peers-before.json, h100-peers.json; FlashInfer
# from .carry/flashinfer_site), tiered.py's requests and fit (results/h100-tiered-*.json,
# runtime/tier_costs.H100).
# Session 36 (an H200 for five calls): peers at Wan 480p, 13 families x 2 sources
# (results/h200-peers.json), the fresh-install first plan, natten / svg2 device templates, the
# host-row breakdown, the three dynamic loops (results/h200-loop.json). Then no machine.
# Session 37: 16 tries that got no machine (1,141 s of the budget), then an H100 for `svg2-ab`
# (results/h100-device-alt-ab.json) and the device-route cases of make test-gpu (20 passed).
# Session 38 (an H200, then an H100; four machine starts refused): loops-36 (results/
# h200-loop.json: XAttention 1.633x, the layer-scaling check), make test-gpu whole (39/39,
# results/h200-test-gpu.log), then s38-lean on the H100 (the device route's all-selected test:
# results/h100-dense-cond-ab.json, h100-rb-dense.json).
# Session 39 (H100 only, six calls): s39a (the device route's all-selected test: GPU tests,
# A/B within 1%, landed; XAttention's loop with host planning: results/h100-loop-xattn.json),
# make test-gpu (41/41), peers-38 (results/h100-peers-dense-moba-svg2.json), dense_dispatch.py
# twice, and HunyuanVideo 720p peers (sparge only: svg2 ran past the call).
# Session 40 (seven starts refused, then an H100): s40 (make test-gpu cut at 320 s after 42
# passed, none failed; the tiered and all-selected cases then passed: results/h100-test-gpu.log;
# the host rows' A/B before / after the rule's early count and the prepared device-route call:
# results/h100-host-row-ab.json), dense_dispatch --profile (results/h100-dense-dispatch.json).
# Session 41 (eight starts refused, then one H100 call): s41 (make test-gpu's traced, tiered,
# decided cases with the traced tiles that may start inside a block: 8 passed; svg2's traced
# templates: q64x2 x kv64 6.33 ms against gathering's 7.43, results/h100-svg2-traced-alt.json).
# Session 42 (H100 twice; five starts refused): peers-480 0 (cut at 585 s after 5 of 7
# families: results/h100-peers-480-today.json; now three shards a file), then svg2 at Wan 720p with
# the traced templates (results/h100-svg2-720-traced.json: TRACED_SMALL_MEAN, SMALL_TILES_MEDIANS);
# then an H200 for the last 200 s: make test-gpu's traced / decided / tiered cases, 8 passed
# (results/h200-test-gpu-traced.log; set XLA_PYTHON_CLIENT_PREALLOCATE=false when calling make).
# Session 43: no machine: twelve starts failed (90-200 s each) and nine calls were not asked
# (15 s each), 1,800 s down to 404, too little to start one.
# Session 44 (two starts refused, then an H100): make test-gpu with device_overflow "gather"
# (45 of 45 in two calls: results/h100-test-gpu.log; "gather" is the default now),
# dense_dispatch --profile, and the peers' other Wan 480p families
# (results/h100-peers-480-rest.json: svg2's gather_alt took 146 s, so the record parts below
# run --no-gather-alt).
# Session 45 (an H100; the H200 asked for by name did not come): `s44` (12 passed; the Wan 480p
# dense, ditfastattn, jenga rows) and `peers-next wan720 40` twice (results/h100-peers-720.json);
# FlashInfer's module from the first call installed in .carry (flashinfer_aot.py). Check next
# time: `flashinfer_warmup.bsr_first_call_s` < 2 s (the carried module), the Wan 720p sparge
# host row's `plan_ms` ~1.7 s (11.1 s before the gather planner's NumPy pass), ditfastattn's
# Wan 720p host requests on the device route after two timed plans (22.8 -> ~18.3 ms); on an
# H100 `alt-720` (~4 min), then `peers-next wan720 40 benchmarks/results/h100-peers-720.json`.
# Session 46: no machine. The step-pairs kernel (a q128 x kv64 plan two steps a stage) waits
# for `pairs` (~9.5 min, any GPU: its kill criterion compares templates in one call), then
# `pairs-bwd` (forward + backward, dq with step pairs too) and `pairs-kernels` (kernels.py's
# host plans) where time allows; run them before the peers' record parts, whose sparge gpu
# rows they would change.
# First next time, on an H200: `s44` (the overflow default's GPU cases, then the Wan 480p
# peers), then `peers-480-next results/tmp/<earlier files>` until the 13 families x 2 sources
# are timed (h200-peers.json holds ff390cc's rows at the older n=5 request rule, which the
# merge will not mix); `peers-next wan720 40 ...` and `peers-next hy720 16 ...` likewise for
# item 1; `xattn-host` (an H100 only so far), `svg2-loop` (session 42's traced rule). After
# the first peers call, install its `batch_prefill*.so.xz` with benchmarks/flashinfer_aot.py
# (--drop-jit-headers) so later fresh machines skip FlashInfer's ~100 s build.
# Next, in this order (benchmarks/NOTES.md#open), one call each:
#   bash benchmarks/h200_session.sh accept         # issue 31's acceptance file of record on an
#     H200 (~510 s on the H100); copy $OUT/h200-gather.json to benchmarks/results/
#   bash benchmarks/h200_session.sh profile-gather # the H200 table with the gather templates
#     (2 calls; on an H100 the table picked gathering for radial frames at 12 heads, 0.93x:
#     consider --heads 8 so 12-head masks have neighbours)
#   bash benchmarks/h200_session.sh tiered         # issue 33: tiered planning's H200 constants
#     (today the H100's stand in), then peers.py as in results/README.md's h100-peers row
# Also here: first-plan, memory, and the session-14 parts (train, train-ab, checks, vsa, ...).
# (Earlier sessions' parts are in git history.)
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
dense_checks() {   # dense_checks GPU_TEST_CAP: the all-selected test's GPU tests, then its A/B
  run "$1" gpu-dense env JAX_PLATFORMS= python3 -m pytest -q -p no:cacheprovider -m gpu -rA \
      tests/gpu/test_dense_route_gpu.py
  run 150 dense-ab python3 benchmarks/dense_cond_ab.py --rounds 2 --out $OUT/dense-cond-ab.json
}
dense_38() {   # dense_checks and the dense row's request breakdown
  dense_checks 150
  run 60 rb-dense python3 benchmarks/request_breakdown.py --masks dense:wan480 --heads 12 \
      --iters 5 --out $OUT/rb-dense.json
}
xattn_loop() {  # xattn_loop CAP: the XAttention loop, every variant (host planning too)
  run "$1" loop-xattn python3 benchmarks/bench_loop.py --models wan13b_480p_xattn --steps 25 \
      --variants dense,dynamic,null,host --out $OUT/loop-xattn.json
}
fi_env() {     # FlashInfer from the carried, trimmed copy (its fa3 prefill module carried as
  # an AOT artifact where flashinfer_aot.py installed it, else JIT-built for sm_90a on first use)
  export PYTHONPATH=$PWD/.carry/flashinfer_site:$PYTHONPATH MAX_JOBS=16 \
      FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws
}
fi_export() {  # the modules FlashInfer JIT-built on this machine, xz'd under $OUT (<= 16 MiB
  # each comes back): benchmarks/flashinfer_aot.py installs them in the carried site, so a
  # fresh machine loads them instead of building (~80-100 s a session)
  [ -d /tmp/fi_ws ] || return 0
  find /tmp/fi_ws -name '*.so' -newer "$OUT/smi.txt" -o -name '*.so' -path '*batch_prefill*' |
    sort -u | while read -r so; do
      python3 -c "import lzma, sys; open(sys.argv[2], 'wb').write(lzma.compress(
          open(sys.argv[1], 'rb').read(), preset=6))" "$so" "$OUT/$(basename "$so").xz"
      ls -l "$so" "$OUT/$(basename "$so").xz" >> "$OUT/fi-export.txt"
    done
}
peers_next() {  # peers_next LIMIT BUDGET RESERVE GRID HEADS [JSON...]
  # Issue 33 item 1: the 13 families at one grid (wan480 12 heads, wan720 40, hy720 16), both
  # sources, as many masks as fit one call (no shard), after the rows of the files named
  # (earlier calls' outputs copied into the tree, e.g. benchmarks/results/tmp/): a call is
  # never left idle at a shard's end. Then `peers.py --merge` of every call's file into
  # h200-peers.json. Carry `.carry`.
  local limit=$1 budget=$2 reserve=$3 grid=$4 heads=$5; shift 5
  fi_env
  run "$limit" peers-next python3 benchmarks/peers.py --out $OUT/peers-$grid.json \
      --time-budget "$budget" --reserve "$reserve" --per-family 1 --heads "$heads" \
      --grids "$grid" --mask-source both --check-rows 1024 --no-tiered --no-gather-alt \
      ${1:+--skip-from "$@"} \
      --families dense,ditfastattn,jenga,moba,natten,radial,sparge,ssta,sta,svg,svg2,vsa,xattn
  fi_export
}
peers_38() {  # peers_38 LIMIT BUDGET RESERVE: dense, moba, svg2 rows at Wan 480p, both sources
  fi_env
  run "$1" peers python3 benchmarks/peers.py --out $OUT/peers-38.json --time-budget "$2" \
      --reserve "$3" --per-family 1 --heads 12 --grids wan480 --mask-source both \
      --check-rows 1024 --families dense,moba,svg2
}
case "${1:-}" in
direct-check)
  # Session 27: the Mosaic forward storing owned rows in place (abi.PassPlan.rows_owned) and
  # session 26's planner changes compiled: the whole make test-gpu, then route_gap with the
  # A/B of the in-place store against the unit-major store and its gather (predicted: the
  # gather's ~78 us at Wan 480p on the H100, aligned / sliding ~6% of the kernel, gone).
  run 330 test-gpu make test-gpu PYTEST_ARGS="-n 6 -rA --durations=0"
  run 200 route-gap python3 benchmarks/route_gap.py --budget-s 170 --out $OUT/route-gap.json ;;
direct-ab)
  # Session 27: Options.store_in_place on / off in alternating rounds (host and device
  # forward, host forward + backward on the irregular families), after make test-gpu's
  # Mosaic cases with dq's in-place store (q128 x kv64 templates) and the device planner's
  # unzeroed step buffer (lax.empty) and the gathering producers' clamped word index.
  run 210 test-gpu make test-gpu PYTEST_ARGS="-n 6 -rA --durations=0 -k 'mgpu or mosaic_gpu'"
  run 140 direct-store python3 benchmarks/direct_store.py --families sliding,aligned,clusters \
      --backward sliding --budget-s 90 --out $OUT/direct-store.json ;;
route-check)
  # Session 26's device-route changes on the GPU: the compiled device / per-head / traced cases
  # (core._cond), then where the device route still loses against the host (route_gap.py) and
  # per-head bounds against shared ones (perhead_diag.py).
  run 330 test-gpu make test-gpu PYTEST_ARGS="-n 6 -rA --durations=0"
  run 180 route-gap python3 benchmarks/route_gap.py --budget-s 150 --out $OUT/h200-route-gap.json
  run 180 perhead-diag python3 benchmarks/perhead_diag.py --budget-s 150 --nocond \
      --perhead-templates "" --out $OUT/h200-perhead-diag.json ;;
gpu-checks)
  # make test-gpu with eight pytest-xdist workers sharing the GPU (compiling is what takes the
  # time; 37 cases in 320 s in session 28).
  run 440 test-gpu make test-gpu PYTEST_ARGS="-n 8 -rA --durations=0" ;;
svg2-order)
  # Session 36's unchecked device plans: the gathering plan in the host's step order (300758e)
  # and static bounds' fitted tiles (40e9800). Every compiled template and device route against
  # the reference, then the device templates timed on the masks they change (predictions in
  # NOTES: svg2 gathering 6.98 -> ~6.63 ms, kill > 6.9; moba kv128 4.30 -> ~3.5-3.6, kill > 4.0;
  # ssta 7.96 -> ~7.2-7.4, kill > 7.9). svg2's q64x2 device plan (fitted tiles, no bitmap
  # steps) predicted ~5.6-5.8 ms: if it beats the gathering template, device_gather "auto"
  # should leave static bounds to the price rule.
  run 330 test-gpu make test-gpu PYTEST_ARGS="-n 8 -rA"
  run 250 device-alt python3 benchmarks/peers.py --per-family 1 --heads 12 --grids wan480 \
      --mask-source gpu --check-rows 1024 --peers tessera,dense --device-alt \
      --families svg2,moba,ssta,sta --out $OUT/h200-device-alt.json ;;
svg2-ab)
  # The same device templates before and after session 36's plan changes, in one call (no
  # ratio across runs): first `git archive ff390cc | tar -x -C ab_old` here (untracked, so it
  # travels). svg2 (the gathering plan's order; q64x2's fitted tiles against gathering) and
  # moba (fitted tiles); ~400 s with a start.
  run 260 device-alt python3 benchmarks/peers.py --per-family 1 --heads 12 --grids wan480 \
      --mask-source gpu --check-rows 1024 --peers tessera,dense --device-alt --time-budget 230 \
      --families svg2,moba --out $OUT/h200-device-alt.json
  (cd ab_old && PYTHONPATH=$PWD run 200 device-alt-old python3 benchmarks/peers.py \
      --per-family 1 --heads 12 --grids wan480 --mask-source gpu --check-rows 1024 \
      --peers tessera,dense --device-alt --time-budget 170 --families svg2,moba \
      --out $OUT/h200-device-alt-old.json) ;;
dense-38|s38-lean)
  # Session 38: the device route's all-selected test (a lax.cond on the traced blocks, cuDNN
  # when every block is selected; branch device-dense-test): its GPU tests, its A/B on the
  # peers' dense, moba and svg2 masks (predicted <= 10 us on the sparse ones; the dense text
  # mask 0.27 -> ~0.19 ms), and where the host dense row's request goes.
  dense_38 ;;
peers-38)
  # Session 38: the peers' rows of the families changed since ff390cc's h200-peers.json
  # (dense: the device route's all-selected test; moba, svg2: fitted tiles and the device
  # rule), merged into the file of record (peers.py --merge, later rows win).
  peers_38 580 500 30 ;;
s38)
  # dense-38, then peers-38 with a shorter budget, in one call.
  dense_38
  peers_38 330 300 20 ;;
s39a)
  # Session 39 (the device route's all-selected test rebuilt on main, uncommitted branch lost):
  # its GPU tests and A/B (kill: > 1% on moba / svg2), then XAttention's loop with the
  # host-planning variant, in one call.
  dense_checks 120
  xattn_loop 310 ;;
s40)
  # Session 40: make test-gpu (gpu_check's "tiered" route checks the prepared device-route
  # calls), then one round of s40-ab's host rows (new, old), in one call.
  run 320 test-gpu make test-gpu PYTEST_ARGS="-n 8 -rA --durations=0"
  run 100 host-rows-new-1 python3 benchmarks/host_row_breakdown.py --families vsa,sparge \
      --repeats 9 --out $OUT/host-rows-new-1.json
  (cd ab_old && PYTHONPATH=$PWD run 100 host-rows-old-1 python3 \
      benchmarks/host_row_breakdown.py --families vsa,sparge --repeats 9 \
      --out $OUT/host-rows-old-1.json) ;;
s40-ab)
  # Session 40: the host rows' breakdown before (ab_old: `git archive e6dc06a`, untracked, so
  # it travels) and after the tiered rule's early count and the prepared device-route call,
  # alternating, one call; then HunyuanVideo 720p's sparge host row after.
  for r in 1 2; do
    run 120 host-rows-new-$r python3 benchmarks/host_row_breakdown.py --families vsa,sparge \
        --repeats 9 --out $OUT/host-rows-new-$r.json
    (cd ab_old && PYTHONPATH=$PWD run 120 host-rows-old-$r python3 \
        benchmarks/host_row_breakdown.py --families vsa,sparge --repeats 9 \
        --out $OUT/host-rows-old-$r.json)
  done
  run 120 host-rows-hy720 python3 benchmarks/host_row_breakdown.py --families sparge \
      --grid hy720 --heads 16 --repeats 7 --out $OUT/host-row-breakdown-hy720.json ;;
s41)
  # Session 41: the traced tiles that may start inside a block (_segments_carry) compiled:
  # make test-gpu's traced, tiered and decided cases, then s41-spike's svg2 row.
  run 240 test-gpu make test-gpu PYTEST_ARGS="-n 8 -rA -k 'traced or tiered or decided'"
  run 300 svg2-alt python3 benchmarks/peers.py --out $OUT/svg2-traced-alt.json \
      --time-budget 270 --reserve 20 --per-family 1 --heads 12 --grids wan480 \
      --mask-source gpu --check-rows 1024 --peers tessera,dense --families svg2 ;;
s41-spike)
  # Session 41: svg2's gpu row with every device-list template named on the traced bounds
  # (gather_alt: what a tiered request with new bounds could run instead of the gathering
  # template; kill: q64x2 x kv64 not below 0.95x it), then the host rows' breakdown of vsa
  # (route against route_unpacked: the in-program unpack) and svg2 (traced bounds).
  run 330 svg2-alt python3 benchmarks/peers.py --out $OUT/svg2-traced-alt.json \
      --time-budget 300 --reserve 20 --per-family 1 --heads 12 --grids wan480 \
      --mask-source gpu --check-rows 1024 --peers tessera,dense --families svg2
  run 200 host-rows python3 benchmarks/host_row_breakdown.py --families vsa,svg2 --repeats 9 \
      --out $OUT/host-rows.json ;;
peers-480)
  # Issue 33: the 13 families at Wan 480p, both sources, one shard of three per call (K = 0,
  # 1 or 2), then `peers.py --merge` of the shards (and the file of record's other rows) into
  # h200-peers.json. Carry `.carry`. Two shards did not fit a call (H100, session 42: the
  # FlashInfer JIT build ~100 s, then ~85 s a mask with both sources, 5 of 7 masks in 585 s),
  # so three, each ~4-5 masks; the host rows' sync / tiered mode requests are left out
  # (--no-tiered: diagnostics, ~10-20 s a row); the first plan of a fresh install is met on
  # the record (0.76 s) and not re-timed.
  fi_env
  run 585 peers-480-$2 python3 benchmarks/peers.py --out $OUT/peers-s$2.json \
      --time-budget 570 --reserve 90 --per-family 1 --heads 12 --grids wan480 \
      --mask-source both --check-rows 1024 --shard ${2:?shard 0, 1 or 2}/3 --no-tiered \
      --families dense,ditfastattn,jenga,moba,natten,radial,sparge,ssta,sta,svg,svg2,vsa,xattn
  fi_export ;;
s44)
  # The overflow default on the H200 (make test-gpu's overflow, traced, decided, tiered cases;
  # 20 passed on the H100 in session 44), then the Wan 480p peers as far as the call goes.
  # (`tiered` takes tests/gpu/test_precompile_gpu.py too: committed inputs after precompile.)
  run 300 test-gpu make test-gpu PYTEST_ARGS="-n 8 -rA -k 'overflow or traced or decided or tiered'"
  peers_next 280 270 80 wan480 12 ;;
pairs)
  # Session 46's step-pairs kernel (NOTES#kernel-steps, kill: not <= 0.97x q128 x kv64): its
  # compiled checks (make test-gpu's host cases of mgpu_q128_kv64x2_s2_hm), then the device
  # templates, the candidate named, on SpargeAttn's masks at Wan 480p (12 heads, and NATTEN's,
  # whose kv64 device plan computes 1.36x the selection against kv128's 1.63x) and HunyuanVideo 720p
  # (16 heads); ~9.5 min on a warm machine.
  run 140 test-gpu-pairs make test-gpu PYTEST_ARGS="-n 3 -rA -k 'kv64x2'"
  for g in "wan480 12 230 sparge,natten" "hy720 16 200 sparge"; do
    set -- $g
    run $3 device-alt-pairs-$1 python3 benchmarks/peers.py --per-family 1 --heads $2 \
        --grids $1 --mask-source gpu --check-rows 1024 --peers tessera,dense --device-alt \
        --time-budget $(($3 - 20)) --reserve 15 --families $4 \
        --out $OUT/device-alt-pairs-$1.json
  done ;;
pairs-bwd)
  # The step-pairs kernel's forward and forward + backward (dq two steps a stage too) on the
  # device route against q128 x kv64 and q128 x kv128, outputs and gradients compared with
  # kv64's: SpargeAttn and NATTEN at Wan 480p, SpargeAttn at HunyuanVideo 720p; ~5 min.
  run 540 step-pairs python3 benchmarks/spikes/step_pairs.py --budget-s 480 \
      --out $OUT/step-pairs.json ;;
pairs-kernels)
  # The step-pairs kernel against q128 x kv64 (same host plans) and q128 x kv128 on
  # kernels.py's Wan 480p masks (random 128-blocks at 0.05-0.5, cubes, sliding tiles, radial
  # frames, clusters), each checked first: where else it would replace kv64 (the host table).
  run 560 kernels-pairs python3 benchmarks/kernels.py --templates \
      mgpu_q128_kv64_s2_hm,mgpu_q128_kv64x2_s2_hm,mgpu_q128_kv128_s2_hm --triton 0 \
      --check-timed-only --budget-s 520 --out $OUT/kernels-pairs.json ;;
alt-720)
  # Session 45's open idea (NOTES#peers): the device route's templates at Wan 720p, 40 heads,
  # on the masks whose mean block is ~64 tokens (the traced rule takes q64x2 x kv64 there:
  # ditfastattn 15.40 ms against the host plan's q128 x kv128 12.35, radial 68.6 against 61.5,
  # natten 30.2 against 35.5), every device-list template and candidate named (the step-pairs
  # kernel: predicted radial ~57-60 ms, ditfastattn ~12-12.5, NOTES#kernel-steps); ~5 min.
  run 330 device-alt python3 benchmarks/peers.py --per-family 1 --heads 40 --grids wan720 \
      --mask-source gpu --check-rows 1024 --peers tessera,dense --device-alt --time-budget 300 \
      --reserve 20 --families ditfastattn,radial,natten --out $OUT/device-alt-720.json ;;
peers-480-next)
  peers_next 585 570 90 wan480 12 "${@:2}" ;;
peers-next)
  peers_next 585 570 90 "${2:?grid}" "${3:?heads}" "${@:4}" ;;
hy720)
  # Issue 33 item 1: the peers at HunyuanVideo 720p (all 16 heads), one family per call (svg2
  # ran past a 575 s call with sparge and vsa in session 39); the auxiliary timings off.
  fi_env
  run 580 peers-hy720 python3 benchmarks/peers.py --out $OUT/peers-hy720-${2:?family}.json \
      --time-budget 540 --reserve 30 --per-family 1 --heads 16 --grids hy720 \
      --mask-source both --check-rows 1024 --families "$2" --no-gather-alt --no-tiered ;;
svg2-loop)
  # Issue 33 item 4: the SVG2 loop (Wan 14B 720p, 2 layers scaled) under the per-axis traced
  # rule (session 42: q128 x kv64 where it ran q128 x kv128; predicted 0.92-0.97x a sparse
  # call), every variant in one call; merge into h200-loop.json.
  run 560 loop-svg2 python3 benchmarks/bench_loop.py --models wan14b_720p_svg2 \
      --loop-repeats 1 --variants dense,dynamic,null,host --out $OUT/loop-svg2.json ;;
xattn-host)
  # Issue 33 item 4: the XAttention loop with its host-planning variant (the loops-36 part ran
  # dense, dynamic and null only): every variant in one call, merged into h200-loop.json.
  xattn_loop 560 ;;
loops-36)
  # Issue 33 item 4: the XAttention loop (Wan 1.3B 480p, all 30 layers), then the per-layer
  # scaling of the layer-subset cases checked against full depth at 720p (HunyuanVideo 720p
  # SpargeAttn: 2 steps, 2 layers scaled against all 54).
  run 200 loop-xattn python3 benchmarks/bench_loop.py --models wan13b_480p_xattn --steps 25 \
      --variants dense,dynamic,null --out $OUT/loop-xattn.json
  run 200 scale-2 python3 benchmarks/bench_loop.py --models hunyuan15_720p_sparge --steps 2 \
      --layers 2 --variants dense,dynamic --out $OUT/loop-scale-2.json
  run 200 scale-54 python3 benchmarks/bench_loop.py --models hunyuan15_720p_sparge --steps 2 \
      --layers 54 --variants dense,dynamic --out $OUT/loop-scale-54.json ;;
gather-fwd-bwd)
  # Forward + backward of the default, gather and skipping gather plans on the irregular
  # masks at Wan 480p against cuDNN's (dq, dk, dv checked against the reference on head 0).
  run 560 gather-fwd-bwd python3 benchmarks/gather.py --backward --masks clusters,cubes,sliding \
      --variants default,gather,gather_skip_nopp --budget-s 520 \
      --out $OUT/h200-gather-fwd-bwd.json ;;
device-gather-check)
  # Issue 31: the device route's plain and gather templates on clusters, cubes, sliding,
  # static and per-head bounds, against the host plan and cuDNN, and the gather planning
  # alone (session 23: results/h200-device-gather-check.json).
  run 580 device-gather-check python3 benchmarks/device_gather_check.py --budget-s 560 --plan-720 \
      --templates rule,plain,gather_skip_nopp --out $OUT/h200-device-gather-check.json ;;
perhead-diag)
  # Issue 31 (perhead_bounds_vs_shared): where per-head bounds lose time, route vs planning
  # alone per family (session 23: results/h200-perhead-diag.json). With the planner before the
  # traced bitmap pass's conditional as perhead_prev (made here beforehand, untracked files
  # travel: git show e36d222:tessera_jax/planning/device.py > benchmarks/pending/device_prev.py).
  prev=()
  [ -f benchmarks/pending/device_prev.py ] && prev=(--prev-planner benchmarks/pending/device_prev.py)
  run 330 perhead-diag python3 benchmarks/perhead_diag.py --budget-s 240 --nocond "${prev[@]}" \
      --out $OUT/h200-perhead-diag.json ;;
profile-gather)
  # Issue 31 item 4: the ranking table learns when gathering pays. The table's masks (first 5
  # specs of each corpus family, tokens included; 2 heads) and its 7 candidates plus the gather
  # templates, under the one timing rule (the committed records predate rules:
  # --remeasure-stale re-times them). ~70 masks x 9 candidates x ~1.2 s: two calls; the
  # second resumes from the raw file this one leaves in $OUT/raw (copy it to plan_tables/raw
  # first). Then copy $OUT/h200.json to plan_tables/h200.json and run selection.py.
  mkdir -p $OUT/raw && cp plan_tables/raw/h200.jsonl $OUT/raw/
  run 570 profile python3 -m tessera_jax.tools.profiler --gpu h200 --raw $OUT/raw \
      --out $OUT/h200.json --max-masks 70 --heads 2 --remeasure-stale --time-budget 540 \
      --candidates mgpu_q128_kv128_s2_hm/merge mgpu_q128_kv128_s2_hm/split \
      mgpu_q128_kv64_s2_hm/merge mgpu_q64x2_kv64_s2_hm/pack mgpu_q64x2_kv64_s2_hm/merge \
      mgpu_q128_kv64_s2_skip/pack mgpu_q64x2pp_kv64_s2_hm/pack \
      mgpu_q128_kv128_s2_gather/gather mgpu_q128_kv128_s2_gather_skip_nopp/gather ;;
accept)
  # Issue 31's acceptance (h200-gather.json) in one run: Wan 720p first (its rows the
  # costlier), then Wan 480p; rows are saved as they come, so a cut run keeps its rows.
  run 590 accept python3 benchmarks/gather_acceptance.py --grids wan720,wan480 \
      --budget-s 560 --out $OUT/h200-gather.json ;;
accept-480|accept-720)
  # Issue 31's acceptance (h200-gather.json): the runtime's own choice, host / device /
  # per-head-bounds masks and fwd+bwd, against cuDNN in the same run; one grid a call, then
  # python3 benchmarks/gather_acceptance.py --merge <both> --out benchmarks/results/h200-gather.json
  g=wan${1#accept-}
  run 580 accept-$g python3 benchmarks/gather_acceptance.py --grids $g --budget-s 520 \
      --out $OUT/h200-gather-$g.json ;;
tiered)
  # Issue 33 item 3: the tiered rule's fit on the H200 (copy fit.host_fit, fit.device_fit and
  # kernel_fit into runtime/tier_costs.H200), first and second requests per mode.
  run 560 tiered python3 benchmarks/tiered.py --out $OUT/h200-tiered.json ;;
first-plan)
  # Issue 33: first plan per corpus family at Wan 480p and 8-token blocks, a fresh process
  # with an empty numba cache each, planning alone (summary.first_plan_fresh_install_max_s
  # <= 2.0; 0.53 s on the 2-core CPU box, results/cpu-first-plan.json).
  run 400 first-plan python3 benchmarks/first_plan.py --fresh-install --out $OUT/h200-first-plan.json ;;
memory)
  # Issue 32 item 3: the 4-layer training step's peak memory with the Mosaic row dots
  # (expected to hold session 14's 0.99985x dense; compile only).
  run 200 train-memory python3 benchmarks/backward.py --sections train --steps 0 --layers 4 \
      --train-variants sparse,dense,sparse_jnp_delta --budget-s 190 \
      --out $OUT/h200-train-memory.json ;;
memfix)
  # Issue 18's memory with the row-dot kernel (pallas_kernels.triton.delta): session 14's
  # buffer assignment showed the rematerialised forward's output gathered head-major for
  # the delta reduce and transposed to token-major for the output projection, both live
  # (100.6 MB). Predicted: the 4-layer temp 4.449 -> ~4.349 GB (dense 4.347), then the 30-layer
  # step's ratio 1.0065 -> ~1.0001.
  mkdir -p $OUT/xla-sparse
  run 80 mem-sparse env XLA_FLAGS="--xla_dump_to=$OUT/xla-sparse --xla_dump_hlo_module_re=jit_step" \
      python3 benchmarks/backward.py --sections train --train-variants sparse --layers 4 --steps 0 \
      --budget-s 75 --out $OUT/mem-sparse.json
  find $OUT/xla-sparse -type f ! -name '*buffer-assignment*' ! -name '*memory-usage-report*' \
      ! -name '*after_optimizations.txt' -delete
  tar -czf $OUT/xla-dumps.tar.gz -C $OUT xla-sparse && rm -rf $OUT/xla-sparse
  run 260 bwd-train-sparse python3 benchmarks/backward.py --sections train --train-variants sparse \
      --layers 30 --steps 5 --budget-s 250 --out $OUT/bwd-train-sparse.json
  run 240 bwd-train-dense python3 benchmarks/backward.py --sections train --train-variants dense \
      --layers 30 --steps 5 --budget-s 230 --out $OUT/bwd-train-dense.json ;;
train-ab)
  # The training step with the row-dot kernel and dense on one machine, then the kernel's
  # control (jnp's delta), then the two deltas alone. Session 14 call 3 also ran the gradients
  # behind an optimization barrier (1131 ms against 1062 without; removed).
  run 560 bwd-train-ab python3 benchmarks/backward.py --sections train,rowdots \
      --train-variants sparse,dense,sparse_jnp_delta --layers 30 \
      --steps 5 --budget-s 530 --out $OUT/bwd-train-ab.json ;;
checks-mini)
  # What 277 device-seconds allow after train-ab: the gradient checks of the default backend
  # on the bf16 / device-mask / f16 cases (rand3-5) and the transforms, with the row-dot kernel.
  run 170 bwd-checks python3 benchmarks/backward.py --sections checks --check-backends mosaic_gpu \
      --check-from 3 --budget-s 160 --out $OUT/bwd-checks.json ;;
train)
  # Issue 18's memory: the training step with the host plans' gathers through constants
  # (predicted peak <= dense; session 11: 15.77 vs 15.57 GB), sparse then dense.
  run 260 bwd-train-sparse python3 benchmarks/backward.py --sections train --train-variants sparse \
      --layers 30 --steps 5 --budget-s 250 --out $OUT/bwd-train-sparse.json
  run 240 bwd-train-dense python3 benchmarks/backward.py --sections train --train-variants dense \
      --layers 30 --steps 5 --budget-s 230 --out $OUT/bwd-train-dense.json ;;
vsa)
  # Issue 17's Wan 480p VSA loop with the device planner's rectangle steps as fused bit ops
  # (session 13's first run: plan 0.22 -> 1.27 ms from gathers over [.., 4, 4] cells; CPU
  # temp 174 -> 57 MB) and the fused top-k by default: the route on the corpus mask, the
  # 720p builders; the loop (without the host-planning variant, measured in call 2) first.
  run 220 loop-vsa python3 benchmarks/bench_loop.py --models wan13b_480p_vsa --steps 25 \
      --loop-repeats 3 --variants dense,dynamic,null --out $OUT/loop-vsa.json
  run 90 builders python3 benchmarks/bench_loop.py --out $OUT/builders.json \
      --builder-costs vsa,sparge_topk,sparge_topk_pool_xla
  run 60 device-planning-vsa480 python3 benchmarks/device_planning.py --grids wan480 \
      --route-grids wan480 --heads 12 --families vsa --no-checks --budget-s 55 \
      --out $OUT/device-planning-vsa480.json ;;
checks)
  # Gradient checks and transforms, complete (session 13: 281 s; session 14's checks-mini ran
  # rand3-5 and two transforms with the row-dot kernel).
  run 400 bwd-checks python3 benchmarks/backward.py --sections checks,grad --budget-s 390 \
      --out $OUT/bwd-checks.json ;;
device-planning)
  run 90 device-planning-vsa480 python3 benchmarks/device_planning.py --grids wan480 \
      --route-grids wan480 --heads 12 --families vsa --no-checks --budget-s 80 \
      --out $OUT/device-planning-vsa480.json
  run 150 device-planning python3 benchmarks/device_planning.py --grids wan720 --route-grids wan720 \
      --families svg2,sparge,natten,ditfastattn --no-checks --budget-s 130 --out $OUT/device-planning.json ;;
diagnose)
  # Which unit-row array is the sparse training step's extra 101 MB (session 13: 15.673 vs
  # 15.572 GB; 4 layers, compile only, XLA's buffer assignment of each variant), then the
  # pooling kernel (the rules' pool option; predicted q and k at Wan 720p 1.59 -> ~0.4 ms, VSA builder
  # 3.35 -> ~2.2 ms) against XLA's pooling in the same call.
  for v in sparse dense; do
    mkdir -p $OUT/xla-$v
    run 80 mem-$v env XLA_FLAGS="--xla_dump_to=$OUT/xla-$v --xla_dump_hlo_module_re=jit_step" \
        python3 benchmarks/backward.py --sections train --train-variants $v --layers 4 --steps 0 \
        --budget-s 75 --out $OUT/mem-$v.json
    find $OUT/xla-$v -type f ! -name '*buffer-assignment*' ! -name '*memory-usage-report*' \
        ! -name '*after_optimizations.txt' -delete
  done
  tar -czf $OUT/xla-dumps.tar.gz -C $OUT xla-sparse xla-dense && rm -rf $OUT/xla-sparse $OUT/xla-dense
  run 60 stages python3 benchmarks/builder_stages.py --out $OUT/stages.json
  run 170 builders-pool python3 benchmarks/bench_loop.py --out $OUT/builders-pool.json \
      --builder-costs vsa,vsa_pool_xla,vsa_highest,sparge_topk,sparge_topk_pool_xla
  tar -czf $OUT/logs.tar.gz -C $OUT $(cd $OUT && ls *.log) && rm -f $OUT/*.log ;;
*) echo "usage: OUT=dir bash benchmarks/h200_session.sh s44|s39a|hy720 FAMILY|xattn-host|svg2-loop|peers-480 K|peers-480-next [JSON...]|peers-next GRID HEADS [JSON...]|peers-38|dense-38|direct-check|route-check|accept-480|accept-720|device-gather-check|perhead-diag|profile-gather|tiered|gpu-checks|memfix|train-ab|checks-mini|train|vsa|checks|device-planning|diagnose" >&2; exit 2 ;;
esac
