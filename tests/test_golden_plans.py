"""Plans are byte-identical to the recorded golden digests (tests/golden_plans.py)."""

import json

import golden_plans


def test_plans_match_golden_digests():
    """The compiled loops' plans ("auto" may plan large masks by the NumPy tier before they
    are ready: that tier's golden plans are ``tests/test_vectorised.py``'s)."""
    from tessera_jax.planning import PlannerConfig
    want = json.loads(golden_plans.PATH.read_text())
    got = golden_plans.all_digests(config=PlannerConfig(loops="compiled"))
    assert got.keys() == want.keys()
    changed = sorted(k for k in want if got[k] != want[k])
    assert not changed, f"{len(changed)} of {len(want)} plans changed, e.g. {changed[:5]}"
