"""Mosaic GPU (Hopper) kernel of plans: TMA, wgmma, warp specialisation.

``ops``: the backend contract (``forward``, ``dq``, ``dkv``; ``pallas_kernels.contract``);
``kernel``: the forward kernel body (``KernelConfig``, ``forward``); ``backward``: the dq and
dk/dv kernels; ``common``: what they share.
"""
