"""dualrl's command line: the top of the import graph (nothing in ``core``, ``backends`` or
``benchmarks`` imports this package)."""
