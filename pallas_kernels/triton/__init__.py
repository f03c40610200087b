"""Pallas Triton-lowering kernel of plans (Ampere/Ada/Hopper)."""
