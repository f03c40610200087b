"""The runtime: public entry points (``api``), the static table of backends (``dispatch``), the
kernel-call helper (``kernel_runner``) and the dense route (``dense_route``)."""
