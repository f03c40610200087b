"""Helpers of ``benchmarks/peers.py``: exact conversions of a ``BlockMask`` to the peers' inputs
(``convert``, NumPy only) and GPU timing/checking utilities (``gpu``, torch/JAX, imported lazily).
"""
