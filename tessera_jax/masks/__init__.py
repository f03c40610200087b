"""Deterministic generators of video sparse-attention masks and the mask corpus (issue 5).

``families``: one generator per family (``FAMILIES[name](grid, heads=, seed=, step=, text=,
**params) -> BlockMask``); ``grids``: token grids and block layouts; ``scores``: the synthetic
scores of dynamic families; ``corpus``: the 2,345 specs, their split, and ``build(spec)``.
See docs/masks.md.
"""

from tessera_jax.masks.corpus import (CORPUS_SIZE, DENSITY_RANGES, DYNAMIC_FAMILIES, TOKEN_GRIDS,
                                     build, corpus, corpus_digest, group_key, spec_key, test_specs,
                                     train_specs)
from tessera_jax.masks.families import (FAMILIES, dense, ditfastattn, jenga, moba, natten, radial, sparge, ssta,
                       sta, svg, svg2, tokens, vsa, xattn)
from tessera_jax.masks.grids import CORPUS_GRIDS, GRIDS, Grid, Layout, get_grid

__all__ = [
    "CORPUS_SIZE", "DENSITY_RANGES", "DYNAMIC_FAMILIES", "TOKEN_GRIDS", "build", "corpus",
    "corpus_digest", "group_key", "spec_key", "test_specs", "train_specs", "FAMILIES", "dense",
    "ditfastattn", "jenga", "moba", "natten", "radial", "sparge", "ssta", "sta", "svg", "svg2",
    "tokens", "vsa", "xattn", "CORPUS_GRIDS", "GRIDS", "Grid", "Layout", "get_grid",
]
