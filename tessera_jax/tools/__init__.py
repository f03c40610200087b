"""Command-line tools apart from the library: ``demo``, ``profiler`` (offline ranking tables),
``bench_loop`` (denoising-loop benchmark) and ``timing`` (the one timing rule)."""
