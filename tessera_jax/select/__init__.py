"""Plan selection: one selector, two feature sets (``choose``).

* route "host" (a static mask, planned on the host per request): the mask's features
  (``select.features``) read by the offline-profiled ranking table of the GPU
  (``select.ranking``): a table look-up per request, no search and no timing on the critical
  path.
* route "device" (a device mask or per-head bounds, planned inside the compiled program): the
  static features a call site has when tracing (``select.device.DeviceFeatures``: shapes, block
  counts, static block bounds) read by a static rule (``select.device``).
"""

from __future__ import annotations

from tessera_jax.select import device, ranking

ROUTES = ("host", "device")


def choose(route: str, mask, shape, backend: str, *, template=None, table=None,
           rule: device.DeviceRule = device.DEFAULT_RULE):
    """The template choice of a call of ``shape`` (an ``AttnShape``) on ``backend``.

    route "host": (template name, policy), or None: no opinion (no table on the XLA backend;
    the caller uses its default); ``table``: a ``ranking.Table`` instead of the GPU's.
    route "device": (Template, bitmap capacity), or (None, 0): the exact path runs;
    ``template``: the caller's (must be device-capable), ``rule``: the options the choice
    reads (``Options.device_rule``: the bitmap budget, ``device_gather``, the traced order).
    """
    if route == "host":
        return ranking.select(mask, shape, backend, table=table)
    if route == "device":
        return device.choose(mask, shape, backend, template, rule=rule)
    raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
