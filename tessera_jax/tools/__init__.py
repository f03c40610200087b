"""Command-line tools apart from the library: ``demo``, ``profiler`` (offline ranking tables),
``finetune`` and ``timing`` (the one timing rule). The benchmarks are in ``benchmarks/``."""
