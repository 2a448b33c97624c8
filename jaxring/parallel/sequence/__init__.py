"""Sequence parallelism over `sp`: one file per strategy (ring, RSA, WallFacer, Ulysses, all-gather, USP),
each reading like its paper's algorithm box, and `sharded_attention`, the entry point on global arrays."""
