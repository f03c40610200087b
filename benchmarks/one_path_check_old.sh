#!/usr/bin/env bash
# The tree before the one-path refactor (4ae09b7) under other package names, for
# one_path_check.py: .carry/old/{old_tessera_jax, old_pallas_kernels, old_kernels.py}
# (.carry/ is git-ignored; carry it to the GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .carry/old && mkdir -p .carry/old
git archive 4ae09b7 tessera_jax pallas_kernels benchmarks/kernels.py | tar -x -C .carry/old
cd .carry/old
mv tessera_jax old_tessera_jax && mv pallas_kernels old_pallas_kernels
mv benchmarks/kernels.py old_kernels.py && rmdir benchmarks
grep -rl "tessera_jax\|pallas_kernels" --include=*.py . | xargs sed -i -E 's/\b(tessera_jax|pallas_kernels)\b/old_\1/g'
# The table format is a string the renaming must not touch (else the old tree's tables are
# refused and its host route falls back to the heuristic).
sed -i 's/"old_tessera_jax.plan_table"/"tessera_jax.plan_table"/' old_tessera_jax/select/ranking.py
