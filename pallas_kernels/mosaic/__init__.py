"""Mosaic GPU (Hopper) kernel of plans: TMA, wgmma, warp specialisation."""
