"""Mosaic GPU (Hopper) kernel of plans: TMA, wgmma, warp specialisation.

``ops``: the backend contract (``forward``, ``dq``, ``dkv``; ``pallas_kernels.contract``);
``kernel``: the forward kernel body (``KernelConfig``, ``forward``); ``backward``: the dq and
dk/dv kernels; ``common``: what they share. Beside them, the auxiliary kernels of Hopper's
default path (no Pallas Triton kernel there): ``delta`` (the backward's row dots), ``pool``
(block sums), ``topk`` (each row's top k), ``kmeans`` (the k-means assignment).
"""
