"""Sequence parallelism over `sp`: one file per strategy (ring, RSA, WallFacer, Ulysses, all-gather, USP), each
reading like its paper's algorithm box. `jaxring.parallel.api.sharded_attention` runs them on global arrays."""
