#!/usr/bin/env bash
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
bash benchmarks/h200_session.sh direct-check
grep -E "passed|failed|FAILED|Error" $OUT/test-gpu.log | tail -15
tail -3 $OUT/route-gap.log
