"""Pallas Triton-lowering kernel of plans (Ampere/Ada/Hopper).

``ops``: the backend contract (``forward``, ``dq``, ``dkv``; ``pallas_kernels.contract``);
``kernel``: the forward kernel body (``KernelConfig``, ``forward``); ``backward``: the dq and
dk/dv kernels; ``delta``: the row dots; ``pool``, ``topk``, ``kmeans``: the mask builders'
kernels on Ampere/Ada (Hopper runs ``pallas_kernels.mosaic``'s). jax 0.11 deprecates this
lowering (benchmarks/NOTES.md, "Off the Triton lowering").
"""
