"""Mosaic GPU (Hopper) kernel of plans: TMA, wgmma, warp specialisation.

``wrapper``: plan and input checks, padding, the mask mode, ``attention`` (the entry point);
``kernel``: the kernel body (``KernelConfig``, ``forward``).
"""
