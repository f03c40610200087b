"""Plans are byte-identical to the recorded golden digests (tests/golden_plans.py)."""

import json

import golden_plans


def test_plans_match_golden_digests():
    want = json.loads(golden_plans.PATH.read_text())
    got = golden_plans.all_digests()
    assert got.keys() == want.keys()
    changed = sorted(k for k in want if got[k] != want[k])
    assert not changed, f"{len(changed)} of {len(want)} plans changed, e.g. {changed[:5]}"
