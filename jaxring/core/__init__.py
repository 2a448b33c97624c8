"""The bottom layer: meshes and devices, the private JAX APIs (`compat`), collectives, precision, tiling.
It imports nothing else of jaxring."""
