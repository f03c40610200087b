"""The runtime: public entry points (``api``), the options (``options``), the choosers of each
route (``host_plans``; ``device_route``), the one core under a custom_vjp (``core``) with the
exact path of device masks (``exact``), the static table of backends (``dispatch``), the
kernel-call helper (``kernel_runner``), vmap folding (``batching``), the dense route
(``dense_route``) and tiered planning of new host masks (``tiered``, its rule ``tier_costs``)."""
