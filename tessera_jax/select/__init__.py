"""Plan selection: mask features and the offline-profiled ranking tables (a table look-up per
request, no search and no timing on the critical path)."""
