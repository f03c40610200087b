import json, copy
R = "benchmarks/results/s13/"
c2 = json.load(open(R + "call2-loop-vsa.json")); c4 = json.load(open(R + "call4-loop-vsa.json"))
k = "wan13b_480p_vsa"
case = c4["cases"][k]
case["loops"]["host"] = copy.deepcopy(c2["cases"][k]["loops"]["host"])
case["loops"]["host"]["note"] = ("from session 13 call 2 (same session and code path: host planning through a "
    "callback, the fused top-k builder); call 4 reran dense, dynamic and null after the device planner fix")
json.dump(c4, open("/tmp/s13/loop-vsa-combined.json", "w"), indent=1)
b2 = json.load(open(R + "call2-builders.json"))["builder_costs"]; b4 = json.load(open(R + "call4-builders.json"))["builder_costs"]
v = b4["variants"]
slow = ("call 2, before the device planner fix: its attention_s ran the 1.3 ms-slower plan "
        "(fraction understated); build_s is the control's figure")
for src, dst in (("vsa", "vsa_xla"), ("sparge_topk", "sparge_topk_xla")):
    v[dst] = dict(b2["variants"][src], note=slow + " (TOP_K='xla' then the default)")
for name in ("svg2_iters1", "svg2_iters1_xla"):
    v[name] = dict(b2["variants"][name], note="call 2, before the device planner fix (plan of per-head clusters ran the gather rectangles)")
b4["note"] = b4.get("note", "") + "; session 13: vsa, sparge_topk from call 4, the rest from call 2 (see each variant's note)"
json.dump({"builder_costs": b4, "cases": {}, "runs": []}, open("/tmp/s13/builders-combined.json", "w"), indent=1)
L_ = case["loops"]
L_["host"]["speedup_vs_dense"] = L_["dense"]["loop_s"] / L_["host"]["loop_s"]
case["speedup_vs_host_planning"] = L_["host"]["loop_s"] / L_["dynamic"]["loop_s"]
json.dump(c4, open("/tmp/s13/loop-vsa-combined.json", "w"), indent=1)
