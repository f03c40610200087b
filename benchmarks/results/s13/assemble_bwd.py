"""Session 13's h200-backward.json: the previous file with this session's training step, grad
checks and transforms (run from the repository root)."""
import json
import sys

sys.path.insert(0, "benchmarks")
import backward  # noqa: E402

R = "benchmarks/results/"
new = json.load(open(R + "h200-backward.json"))
sp = json.load(open(R + "s13/call1-bwd-train-sparse.json"))
dn = json.load(open(R + "s13/call1-bwd-train-dense.json"))
c = json.load(open(R + "s13/call3-bwd-checks.json"))
new["assembled"] = (
    "Session 13 (one H200, calls 1 and 3 from commit e96d254): train_step from call 1 (sparse "
    "then dense in one call, s13/call1-bwd-train-{sparse,dense}.json: the host plans' gathers "
    "through constants); grad_checks, grad_error and transforms from call 3 "
    "(s13/call3-bwd-checks.json, `--sections checks,grad`, complete). fwd_bwd and dense_fwd_bwd "
    "are session 12's (s12/call3-bwd-kernels.json, `--sections kernels --no-dkv-controls`).")
new["train_step"] = dict(sp["train_step"], dense=dn["train_step"]["dense"])
new["grad_checks"] = c["grad_checks"]
new["grad_error"] = c["grad_error"]
new["transforms"] = c["transforms"]
new["summary"] = backward.summarize(new)
json.dump(new, open(R + "h200-backward.json", "w"), indent=1)
print(json.dumps(new["summary"], indent=1))
