"""The parallel layer: the registry (a leaf of tables and lookups), the sequence strategies over `sp`, the
tensor methods over `tp`, the pipeline over `pp`, ZeRO over the data axes, the `ParallelPlan` that holds one
choice of each, and the catalog that registers the built-in entries."""
