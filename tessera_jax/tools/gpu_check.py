"""The compiled kernels against the float32 reference on fresh random masks, on this GPU.

One case (``check_case``) draws a mask (variable bounds, per-head blocks, an empty query
block, GQA; clusters for gathering templates, whose plans must hold gathered steps), runs
``sparse_attention`` forward (out, lse) and backward (dq, dk, dv) inside one jitted
``jax.vjp`` and compares each with ``reference_attention`` in float32. ``cases`` lists
what a GPU should pass: every template of the GPU backends available here (head dims 128 and
64 where the template takes them) through the host route, and the device route with shared
and with per-head bounds per backend, each also on the gathering template
(``Options.device_gather``; small blocks, and ``ok`` only if the route chose it), and with
traced per-head bounds (decided on the device), also forced through the first bitmap room's
fallback (``Options.bitmap_first_bytes``; ``ok`` only if the fallback ran), and with static
bounds under a bitmap budget below their worst case (``ok`` only if the plan decided on the
device and its selection fitted), and with traced bounds whose selection overflows a bitmap
room of one step (``ok`` only if the plain plan overflowed and the backend's gathering plan,
``Options.device_overflow``, fitted: the overflow runs the gathering kernels, not the exact
path; on XLA, which has none, the exact path).
``make test-gpu`` runs them as tests (``tests/gpu/``); ``python -m tessera_jax.tools.gpu_check``
prints them as a table.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

__all__ = ["ROUTES", "cases", "check_case", "cluster_parts", "main"]

#: host: a static mask (host planner); device: static shared bounds, traced blocks; perhead:
#: static per-head bounds; traced: per-head bounds passed into the program (traced); decided:
#: the device route's static bounds with a bitmap budget under their worst case, so the plan
#: decides its fit on the device (``_decided_options``); tiered: eager calls on new host masks
#: sent to the device route with their blocks bit-packed (``Options.host_planning``
#: "device_first"), bounds traced, then static once ``tj.precompile`` ran them (forward only:
#: a traced call plans on the host); overflow: traced per-head bounds whose selection overflows
#: a bitmap room of one step (``_overflow_options``), so the plan after it runs.
ROUTES = ("host", "device", "perhead", "traced", "decided", "tiered", "overflow")
#: Tolerances of bf16 kernels against the float32 reference (relative Frobenius error).
OUT_TOL, LSE_TOL, GRAD_TOL = 1e-2, 1e-2, 2e-2


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _forward_errors(out, lse, rout, rlse) -> dict:
    """rel_out, lse_max_err (over rows the reference selects keys for) and empty_rows_ok (the
    others' LSE -inf, no NaN in the output) of a forward against the reference's."""
    lse, rlse = np.asarray(lse), np.asarray(rlse)
    fin = np.isfinite(rlse)
    return dict(rel_out=_rel(out, rout),
                lse_max_err=float(np.max(np.abs(lse[fin] - rlse[fin]), initial=0.0)),
                empty_rows_ok=bool(np.all(np.isneginf(lse[~fin]))
                                   and not np.isnan(np.asarray(out, np.float32)).any()))


def _mask_parts(rng, L: int, Hq: int, route: str, n: int = 20, own_all: bool | None = None):
    """(q_bounds, blocks): n variable blocks per axis (per head for "perhead", "traced" and
    "overflow"),
    ~40% of the blocks selected per head, query block 3 empty; on the host route half the
    cases select a key block in every query block instead (units owning every row: the
    Mosaic forward stores rows in place, ``abi.PassPlan.rows_owned``); ``own_all`` forces
    one or the other."""
    per_head = route in ("perhead", "traced", "overflow")
    qb = np.stack([np.r_[0, np.sort(rng.choice(np.arange(1, L), n - 1, replace=False)), L]
                   for _ in range(Hq if per_head else 1)])
    blocks = rng.random((Hq, n, n)) < 0.4
    if own_all is None:
        own_all = route == "host" and bool(rng.random() < 0.5)
    if own_all:
        blocks[:, :, int(rng.integers(n))] = True
    else:
        blocks[:, 3] = False
    return (qb if per_head else qb[0]), blocks


def _refine_parts(rng, L: int, Hq: int):
    """(q_bounds [Hq, n + 1], blocks) of a refine case: mean blocks over 64 tokens (128-token
    tiles, and a first room); head 0 starts with six 4-token blocks (rows selected, but 3),
    then blocks of 153-192 tokens (two tiles each: more block-aligned tiles than the traced
    slots, so the fixed grid, whose first tiles meet 7 blocks: more than one bitmap step)."""
    m = -(-(L - 24) // 192)
    n = 6 + m
    qb = np.stack([np.r_[0, np.sort(rng.choice(np.arange(1, L), n - 1, replace=False)), L]
                   for _ in range(Hq)])
    qb[0] = np.r_[np.arange(0, 24, 4), 24 + np.linspace(0, L - 24, m + 1).astype(int)]
    blocks = rng.random((Hq, n, n)) < 0.4
    blocks[0, :6] = True
    blocks[:, 3] = False
    return qb, blocks


def _decided_parts(rng, L: int, Hq: int, n: int = 96):
    """(q_bounds, blocks) of a decided case: n small shared blocks (every tile meets more
    than GRID of them), ~40% selected, none where the second half of the query blocks meets
    the first half of the key blocks (about a quarter of the tile pairs: the selection needs
    fewer bitmap steps than the worst case), query block 3 empty."""
    qb = np.r_[0, np.sort(rng.choice(np.arange(1, L), n - 1, replace=False)), L]
    blocks = rng.random((Hq, n, n)) < 0.4
    blocks[:, n // 2:, : n // 2] = False
    blocks[:, 3] = False
    return qb, blocks


def _decided_options(qb, blocks, q, k, options: dict) -> dict:
    """``options`` with a bitmap budget of 7/8 of the least worst case over the backend's
    device templates (``select.device.bitmap_pairs``): no template fits it when tracing, so
    the route's plan decides on the device, and ``_decided_parts``' selection fits it."""
    import dataclasses

    import jax.numpy as jnp

    import tessera_jax as tj
    from pallas_kernels import templates
    from tessera_jax.select import device as select_device
    from tessera_jax.validation import check_shapes
    shape = check_shapes(q.shape, k.shape, q.dtype)
    consts = select_device.static_parts(tj.BlockMask(qb, qb, jnp.asarray(blocks)))
    worst = min(select_device.bitmap_pairs(consts[0], consts[1], blocks.shape, shape, t)
                * select_device.bitmap_step_bytes(t)
                for t in map(templates.get, select_device.DEVICE_TEMPLATES[options["backend"]])
                if t.supports(shape.head_dim, shape.dtype))
    o = options.get("options") or tj.Options(device_gather="never")    # the device list's
    return {**options, "options": dataclasses.replace(o, bitmap_budget_bytes=worst * 7 // 8)}


def _decided_oks(qb, blocks, q, k, options: dict):
    """(decides, ok, dkv_ok) of a decided case's device plans as the route makes them."""
    import jax
    import jax.numpy as jnp

    import tessera_jax as tj
    from tessera_jax.runtime import device_route
    from tessera_jax.select import device as select_device
    from tessera_jax.validation import check_shapes
    o = options["options"]
    shape = check_shapes(q.shape, k.shape, q.dtype)
    dev = tj.BlockMask(qb, qb, jnp.asarray(blocks))
    consts = select_device.static_parts(dev)
    t, cap = device_route._choose(consts, dev, shape, options["backend"], None, o.device_rule)
    decides = device_route.decides(consts, blocks.shape, shape, t, cap)
    if not decides:
        return False, None, None
    plan = jax.jit(lambda b: device_route.device_plans(
        q, k, qb, qb, b, consts=consts, t=t, capacity=cap, decide=True,
        budget=o.bitmap_budget_bytes))(jnp.asarray(blocks))
    return True, bool(plan.ok), None if plan.dkv_ok is None else bool(plan.dkv_ok)


def _sizes(rng, L: int, mean: float) -> np.ndarray:
    """Lognormal sizes (median ~mean / 2.2, at most 4,096) summing to L."""
    s = []
    while sum(s) < L:
        s.append(int(np.clip(rng.lognormal(np.log(mean) - 0.8, 1.3), 1, 4096)))
    s[-1] -= sum(s) - L
    return np.array([x for x in s if x > 0])


def cluster_parts(rng, L: int, H: int, q_mean: float = 110, kv_mean: float = 40,
                  density: float = 0.2, kv_len: int | None = None):
    """(q_bounds, kv_bounds, blocks) of SVG2-like variable clusters: separate query and key
    clusterings (lognormal sizes) of L queries and ``kv_len`` (default L) keys; per head,
    each query cluster selects the key clusters nearest it, with noise, up to ``density`` of
    the keys. Small sparse classes per 128-row window: gather plans hold gathered steps on
    them (also the H200 benchmark's clusters, benchmarks/gather.py)."""
    Lk = L if kv_len is None else kv_len
    qs, ks = _sizes(rng, L, q_mean), _sizes(rng, Lk, kv_mean)
    qb, kb = np.r_[0, np.cumsum(qs)], np.r_[0, np.cumsum(ks)]
    cq, ck = (qb[:-1] + qb[1:]) / 2 / L, (kb[:-1] + kb[1:]) / 2 / Lk
    blocks = np.zeros((H, len(qs), len(ks)), bool)
    for h in range(H):
        s = -np.abs(cq[:, None] - ck[None, :]) * rng.uniform(5, 40) + rng.gumbel(
            size=(len(qs), len(ks)))
        order = np.argsort(-s, axis=1)
        sel = np.cumsum(ks[order], axis=1) <= density * Lk
        sel[:, 0] = True
        np.put_along_axis(blocks[h], order, sel, axis=1)
    return qb, kb, blocks


def _cluster_case(rng, L: int, Hq: int):
    """A gathering template's case mask: ``cluster_parts``, query cluster 1 empty."""
    qb, kb, blocks = cluster_parts(rng, L, Hq)
    blocks[:, 1] = False
    return qb, kb, blocks


def _gathers(options: dict) -> bool:
    from pallas_kernels import templates
    t = options.get("template")
    return t is not None and bool(getattr(templates.get(t).kernel, "gather", False))


def _device_gathers(options: dict) -> bool:
    """Whether a device-route case's options send it to the gathering template (the cases'
    masks are grids of equal blocks, which "auto" and "never" keep on the device list)."""
    o = options.get("options")
    return o is not None and o.device_gather in ("traced", "irregular")


def _overflow_options(qb, blocks, q, k, options: dict) -> dict:
    """``options`` with a bitmap budget of one step of the template the route chooses for
    these traced bounds, so a selection of small blocks overflows it on the device."""
    import jax.numpy as jnp

    import tessera_jax as tj
    from tessera_jax.runtime import device_route
    from tessera_jax.select import device as select_device
    from tessera_jax.validation import check_shapes
    o = options.get("options") or tj.Options()
    dev = tj.BlockMask(jnp.asarray(qb), jnp.asarray(qb), jnp.asarray(blocks))
    t = device_route.choose(dev, check_shapes(q.shape, k.shape, q.dtype), options["backend"],
                            None, o)
    return {**options, "options": dataclasses.replace(
        o, bitmap_budget_bytes=select_device.bitmap_step_bytes(t))}


def _overflow_oks(qb, blocks, q, k, options: dict):
    """(plain plan's ok, the next plan's template or None, its ok or None) of an overflow
    case's traced call, as ``device_route._run`` makes them."""
    import jax
    arrays, full, _ = _traced_plans(qb, qb, blocks, q, k, options)
    nxt = full.then
    oks = jax.jit(lambda *a: (full(*a).ok, None if nxt is None else nxt(*a).ok))(*arrays)
    return bool(oks[0]), (None if nxt is None else nxt.template), \
        (None if oks[1] is None else bool(oks[1]))


def _traced_plans(qb, kb, blocks, q, k, options: dict):
    """(the mask's arrays, whole room's plans, first room's plans or None) of a call with
    these bounds traced, as ``device_route._run`` makes them (``device_route._refines``), or
    None where the route runs no template."""
    import jax.numpy as jnp

    import tessera_jax as tj
    from tessera_jax.runtime import device_route
    from tessera_jax.select import device as select_device
    from tessera_jax.validation import check_shapes
    o = options["options"]
    arrays = (jnp.asarray(qb, jnp.int32), jnp.asarray(kb, jnp.int32), jnp.asarray(blocks))
    dev = tj.BlockMask(*arrays)
    consts = select_device.static_parts(dev)
    t, cap = device_route._choose(consts, dev, check_shapes(q.shape, k.shape, q.dtype),
                                  options["backend"], None, o.device_rule)
    if t is None:
        return None
    return (arrays, *device_route._refines(consts, t.name, cap, True, q, k, blocks.shape, o))


def _refines(route: str, options: dict) -> bool:
    """Whether a case is a refine case: traced bounds and an ``Options`` with a first bitmap
    room (0 < ``bitmap_first_bytes`` < ``bitmap_budget_bytes``; 0: one plan, no check)."""
    o = options.get("options")
    return route == "traced" and o is not None \
        and 0 < o.bitmap_first_bytes < o.bitmap_budget_bytes


def _refine_oks(qb, kb, blocks, q, k, options: dict):
    """(first_ok, full_ok) of a traced call's plans as ``device_route._run`` makes them (the
    first room's plan, then the whole room's), or None where it makes one plan only."""
    import jax
    plans = _traced_plans(qb, kb, blocks, q, k, options)
    if plans is None or plans[2] is None:
        return None
    arrays, full, first = plans
    oks = jax.jit(lambda *a: (first(*a).ok, full(*a).ok))(*arrays)
    return tuple(bool(x) for x in oks)


def check_case(rng, *, D: int, Hq: int, Hkv: int, route: str, options: dict) -> dict:
    """Errors of one fresh case against the reference and ``ok``; ``options``:
    ``sparse_attention`` keywords (a template or a backend). A gathering template's case
    draws clusters (``_cluster_case``), so that its plans hold gathered steps, and
    fails if the forward plan, or a dk/dv plan forced to gather (``Options.dkv_policies``),
    holds none: a check that never runs a gathered step could not fail on one. Likewise a
    refine case (``_refines``) draws ``_refine_parts`` and fails unless its first plan
    overflows and the whole room's fits (``first_ok`` False, ``full_ok`` True)."""
    import jax
    import jax.numpy as jnp

    import tessera_jax as tj
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    L = int(rng.integers(700, 1500))
    if route == "tiered":
        return _tiered_case(rng, L, D, Hq, Hkv, options)
    gathers = route == "host" and _gathers(options)
    dev_gathers = route != "host" and _device_gathers(options)
    refines = _refines(route, options)
    if gathers:
        qb, kb, blocks = _cluster_case(rng, L, Hq)
    elif refines:
        qb, blocks = _refine_parts(rng, L, Hq)
        kb = qb
    elif route == "decided":
        qb, blocks = _decided_parts(rng, L, Hq)
        kb = qb
    else:
        # A device route sent to the gathering template, or past its bitmap room: small
        # blocks (tiles meeting more than 4 query blocks, chunks several key blocks), per
        # head for "perhead" and "overflow".
        qb, blocks = _mask_parts(rng, L, Hq, route,
                                 n=64 if dev_gathers or route == "overflow" else 20)
        kb = qb
    ks = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 4)
    q = jax.random.normal(ks[0], (1, L, Hq, D), jnp.bfloat16)
    k, v = (jax.random.normal(x, (1, L, Hkv, D), jnp.bfloat16) for x in ks[1:3])
    do = jax.random.normal(ks[3], (1, L, Hq, D), jnp.bfloat16)
    host = tj.BlockMask(qb, kb, blocks)
    if route == "decided":
        options = _decided_options(qb, blocks, q, k, options)
    if route == "overflow":
        options = _overflow_options(qb, blocks, q, k, options)

    # "traced", "overflow": the bounds are arguments of the program; the other device routes
    # close over them.
    bounds = tuple(jnp.asarray(x, jnp.int32) for x in (qb, kb)) \
        if route in ("traced", "overflow") else ()

    def fwd_bwd(q, k, v, b, *bounds):
        m = host if route == "host" else tj.BlockMask(*(bounds or (qb, kb)), b)
        (out, lse), vjp = jax.vjp(
            lambda q, k, v: tj.sparse_attention(q, k, v, m, return_lse=True, **options), q, k, v)
        return out, lse, vjp((do, jnp.zeros_like(lse)))

    out, lse, grads = jax.jit(fwd_bwd)(q, k, v, jnp.asarray(blocks), *bounds)
    (rout, rlse), rvjp = jax.vjp(
        lambda q, k, v: tj.reference_attention(q, k, v, host, return_lse=True),
        *(x.astype(jnp.float32) for x in (q, k, v)))
    rgrads = rvjp((do.astype(jnp.float32), jnp.zeros_like(rlse)))
    rec = dict(L=L, **_forward_errors(out, lse, rout, rlse),
               rel_grads=[_rel(g, r) for g, r in zip(grads, rgrads)])
    if route == "host":
        rec["rows_owned"] = bool(np.all(blocks.any(axis=-1)))
    rec["ok"] = (rec["rel_out"] < OUT_TOL and rec["lse_max_err"] < LSE_TOL
                 and rec["empty_rows_ok"] and max(rec["rel_grads"]) < GRAD_TOL)
    if dev_gathers:
        from tessera_jax.runtime import device_route
        from tessera_jax.select import device as select_device
        from tessera_jax.validation import check_shapes
        dev = tj.BlockMask(qb, kb, jnp.asarray(blocks))
        t = device_route.choose(dev, check_shapes(q.shape, k.shape, q.dtype),
                                options["backend"], None, options["options"])
        rec["template"] = t.name if t is not None else None
        rec["ok"] &= t is not None and select_device.gathers_on_device(t)
    if route == "decided":
        rec["decides"], rec["plan_ok"], rec["dkv_ok"] = _decided_oks(qb, blocks, q, k, options)
        rec["ok"] &= rec["decides"] and rec["plan_ok"] and rec["dkv_ok"] is not False
    if route == "overflow":
        from tessera_jax.select import device as select_device
        rec["plain_ok"], rec["next_template"], rec["next_ok"] = _overflow_oks(
            qb, blocks, q, k, options)
        gathers_here = options["backend"] in select_device.GATHER_TEMPLATES
        rec["ok"] &= not rec["plain_ok"] and (
            rec["next_ok"] is True if gathers_here else rec["next_template"] is None)
    if refines:
        oks = _refine_oks(qb, kb, blocks, q, k, options)
        rec["first_ok"], rec["full_ok"] = oks or (None, None)
        rec["ok"] &= oks is not None and not oks[0] and oks[1]
    if gathers:
        from tessera_jax.runtime import host_plans
        opts = options.get("options") or tj.Options()
        fwd = tj.plan(host, q.shape, k.shape, q.dtype, template=options["template"],
                      options=opts)
        rec["gather_steps"] = int(fwd.stats()["gather_steps"])
        rec["ok"] &= rec["gather_steps"] > 0
        if any(p.startswith("gather") for p in opts.dkv_policies):
            dkv = host_plans.dkv_plan(fwd, options=opts)
            rec["dkv_gather_steps"] = int(dkv.stats()["gather_steps"])
            rec["ok"] &= rec["dkv_gather_steps"] > 0
    return rec


def _tiered_case(rng, L: int, D: int, Hq: int, Hkv: int, options: dict) -> dict:
    """``check_case`` of the "tiered" route: three new masks of one set of bounds, eager, the
    first two before ``tj.precompile`` of the bounds (traced bounds, then the executable
    reused), the third after it (static bounds, the bits handed to the jit as NumPy); each
    must take the device route and match the reference (output and LSE)."""
    import jax
    import jax.numpy as jnp

    import tessera_jax as tj
    from tessera_jax.runtime import tiered
    qb, _ = _mask_parts(rng, L, Hq, "device")
    ks = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
    q = jax.random.normal(ks[0], (1, L, Hq, D), jnp.bfloat16)
    k, v = (jax.random.normal(x, (1, L, Hkv, D), jnp.bfloat16) for x in ks[1:3])
    kw = dict(options, options=dataclasses.replace(options.get("options") or tj.Options(),
                                                   host_planning="device_first"))
    rec = dict(L=L, rel_out=0.0, lse_max_err=0.0, empty_rows_ok=True, rel_grads=[0.0],
               device_route_calls=0)
    for i in range(3):
        if i == 2:
            tj.precompile(tj.BlockMask(qb, qb, _mask_parts(rng, L, Hq, "device")[1]),
                          q.shape, k.shape, q.dtype, backend=kw.get("backend"),
                          options=kw["options"])
        m = tj.BlockMask(qb, qb, _mask_parts(rng, L, Hq, "device")[1])
        before = tiered.stats().get("device_route", 0)
        out, lse = tj.sparse_attention(q, k, v, m, return_lse=True, **kw)
        rec["device_route_calls"] += tiered.stats().get("device_route", 0) - before
        rout, rlse = tj.reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)), m,
                                            return_lse=True)
        err = _forward_errors(out, lse, rout, rlse)
        rec["rel_out"] = max(rec["rel_out"], err["rel_out"])
        rec["lse_max_err"] = max(rec["lse_max_err"], err["lse_max_err"])
        rec["empty_rows_ok"] &= err["empty_rows_ok"]
        assert tiered.wait(120)
    rec["ok"] = (rec["rel_out"] < OUT_TOL and rec["lse_max_err"] < LSE_TOL
                 and rec["empty_rows_ok"] and rec["device_route_calls"] == 3)
    return rec


def cases(backends=None) -> list[tuple[str, dict, str, int, int, int]]:
    """(id, sparse_attention keywords, route, D, Hq, Hkv) of every check for ``backends``
    (None: the GPU backends available here)."""
    from pallas_kernels import templates
    from tessera_jax.runtime import dispatch
    if backends is None:
        backends = [b for b in ("mosaic_gpu", "triton") if dispatch.is_available(b)]
    out = []
    import tessera_jax as tj
    from tessera_jax.runtime import host_plans
    from tessera_jax.select import device as select_device
    for b in backends:
        for t in templates.for_backend(b):
            kw = dict(template=t.name)
            pol = host_plans.dkv_gather_policy(t, b)
            if pol:         # the dk/dv pass gathers too, forced: the chosen plan may not
                kw["options"] = tj.Options(dkv_policies=(pol,), paired_dkv_policy=None)
            for D, Hq, Hkv in ((128, 4, 2), (64, 2, 2)):
                if t.supports(D, np.dtype("bfloat16")):
                    out.append((f"{t.name}-host-D{D}", kw, "host", D, Hq, Hkv))
        for route in ("device", "perhead"):
            # The device list on these irregular blocks ("auto" and "never" alike).
            out.append((f"{b}-{route}-D128",
                        dict(backend=b, options=tj.Options(device_gather="never")),
                        route, 128, 4, 2))
            # The same routes on the gathering template (planning.device_gather).
            out.append((f"{b}-{route}-gather-D128",
                        dict(backend=b, options=tj.Options(device_gather="irregular")),
                        route, 128, 4, 2))
        # The rule's candidates (``select.device.DEVICE_CANDIDATES``) named on the device route.
        for name in select_device.DEVICE_CANDIDATES.get(b, ()):
            out.append((f"{name}-device-D128", dict(template=name), "device", 128, 4, 2))
        out.append((f"{b}-traced-D128", dict(backend=b), "traced", 128, 4, 2))
        out.append((f"{b}-tiered-D128", dict(backend=b), "tiered", 128, 4, 2))
        # Static bounds past the bitmap budget: the plan decides its fit on the device.
        out.append((f"{b}-decided-D128", dict(backend=b), "decided", 128, 4, 2))
        # A selection past a one-step bitmap room: the gathering plan (``device_overflow``).
        out.append((f"{b}-overflow-D128",
                    dict(backend=b, options=tj.Options(device_overflow="gather")), "overflow",
                    128, 4, 2))
        # The first bitmap room's fallback (``Options.bitmap_first_bytes``; ``_refines``).
        out.append((f"{b}-traced-refine-D128",
                    dict(backend=b, options=tj.Options(bitmap_first_bytes=1)), "traced",
                    128, 4, 2))
    return out


def main(argv=None) -> int:
    """Runs every case of this machine, prints a line each; exit status 1 if one fails."""
    from tessera_jax.tools import cli
    p = cli.Parser("tessera_jax.tools.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=cli.nonnegative_int, default=0, help="the masks' seed")
    args = p.parse_args(argv)
    todo = cases()
    if not todo:
        print("no GPU backend available here: nothing to check")
        return 0
    rng, failed = np.random.default_rng(args.seed), 0
    for name, opts, route, D, Hq, Hkv in todo:
        rec = check_case(rng, D=D, Hq=Hq, Hkv=Hkv, route=route, options=opts)
        failed += not rec["ok"]
        print(f"{'ok  ' if rec['ok'] else 'FAIL'} {name:<40} out {rec['rel_out']:.1e} "
              f"lse {rec['lse_max_err']:.1e} grads {max(rec['rel_grads']):.1e}", flush=True)
    print(f"{len(todo) - failed} passed, {failed} failed")
    return int(failed > 0)


if __name__ == "__main__":
    sys.exit(main())
