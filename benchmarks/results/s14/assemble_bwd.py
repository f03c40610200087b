"""Session 14's h200-backward.json: the previous file with this session's training step (the
row-dot kernel; call 3, one machine), its controls, the two deltas' timings, and the gradient
checks call 4 reran (run from the repository root)."""
import json
import sys

sys.path.insert(0, "benchmarks")
import backward  # noqa: E402

R = "benchmarks/results/"
new = json.load(open(R + "h200-backward.json"))
ab = json.load(open(R + "s14/call3-bwd-train-ab.json"))
c = json.load(open(R + "s14/call4-bwd-checks.json"))
t = ab["train_step"]
new["assembled"] = (
    "Session 14 (one H200). train_step from call 3 (commit f70d01a, s14/call3-bwd-train-ab.json, "
    "one machine, 30 layers, 5 steps): 'sparse' is the variant that call ran as "
    "'sparse_fused_gathers', the row-dot kernel without the optimization barrier on the "
    "gradients, which is the code's only path since the barrier was removed; "
    "'sparse_barrier' (the variant then called 'sparse') and 'sparse_jnp_delta' (jnp's delta, "
    "with the barrier) are controls; dense from the same call. row_dots from call 3. "
    "grad_checks: the mosaic_gpu rows of rand3-5 and the transforms grad and checkpoint from "
    "call 4 (s14/call4-bwd-checks.json, commit c4a53cb, `--check-backends mosaic_gpu "
    "--check-from 3`, cut at 170 s); the other rows and transforms are session 13's (jnp's "
    "delta: s13/call3-bwd-checks.json). grad_error session 13's; fwd_bwd and dense_fwd_bwd "
    "session 12's (s12/call3-bwd-kernels.json).")
new["train_step"] = dict(config=t["config"], sparse=t["sparse_fused_gathers"],
                         dense=t["dense"], sparse_barrier=t["sparse"],
                         sparse_jnp_delta=t["sparse_jnp_delta"])
new["row_dots"] = ab["row_dots"]
fresh = {(r["case"], r["backend"]): r for r in c["grad_checks"]}
new["grad_checks"] = [fresh.get((r["case"], r["backend"]), r) for r in new["grad_checks"]]
new["transforms"] = dict(new["transforms"], **c["transforms"])
new["summary"] = backward.summarize(new)
json.dump(new, open(R + "h200-backward.json", "w"), indent=1)
print(json.dumps(new["summary"], indent=1))
