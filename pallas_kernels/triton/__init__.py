"""Pallas Triton-lowering kernel of plans (Ampere/Ada/Hopper).

``wrapper``: plan and input checks, padding, the mask mode, ``attention`` (the entry point);
``kernel``: the kernel body (``KernelConfig``, ``forward``).
"""
