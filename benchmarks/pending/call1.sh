#!/usr/bin/env bash
# Session 27 call 1: route-check (session 26's planner changes compiled and timed).
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
bash benchmarks/h200_session.sh route-check
tail -5 $OUT/test-gpu-route.log
