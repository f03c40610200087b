#!/usr/bin/env python3
"""What the ranking table picks for a token-level mask, timed against the best candidate.

Wan 480p (L = 32,760, 12 heads, D = 128, bf16), shared 8-token blocks at density ~0.23: the
default call (``tj.sparse_attention`` with no template: the H200 table's choice), the best
candidate of ``tiles_once.py`` run 3 (q128_kv128 / split) and cuDNN dense, under KERNEL_RULE.
The table predates bitmap steps and its corpus has no token-level masks (issue 15, item 4).

    python3 benchmarks/selection_token_check.py     # writes $OUT/h200-selection-token8.json
"""
import sys, json, time
sys.path.insert(0, "benchmarks")
import numpy as np, jax, jax.numpy as jnp, tessera_jax as tj
from tessera_jax.tools import timing
from tiles_once import token_blocks
L, H, D = 32760, 12, 128
m = token_blocks(L, H, 8, 0.2, 8)
ks = jax.random.split(jax.random.key(0), 3)
sets = [tuple(jax.random.normal(k, (1, L, H, D), jnp.bfloat16) for k in ks)]
res = {}
dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
res["dense_ms"] = timing.time_kernel(dense, sets).ms
f = jax.jit(lambda q, k, v: tj.sparse_attention(q, k, v, m))
p = tj.plan(m, (1, L, H, D), (1, L, H, D), jnp.bfloat16)
res["default_choice"] = f"{p.template}/{p.policy}"
res["default_ms"] = timing.time_kernel(f, sets).ms
for t, pol in [("mgpu_q128_kv128_s2_hm", "split")]:
    g = jax.jit(lambda q, k, v: tj.sparse_attention(q, k, v, m, template=t, policy=pol))
    res[f"{t}/{pol}_ms"] = timing.time_kernel(g, sets).ms
res["rule"] = timing.KERNEL_RULE.to_json()
print(json.dumps(res))
import os; json.dump(res, open(os.environ["OUT"] + "/h200-selection-token8.json", "w"), indent=1)
