#!/usr/bin/env bash
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
bash benchmarks/h200_session.sh direct-ab
grep -E "passed|failed|FAILED|Error" $OUT/test-gpu.log | tail -15
grep -v Warn $OUT/direct-store.log | tail -6
