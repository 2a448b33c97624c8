"""Training data on the host: token and image sources, their batches, and each host's rows of a global batch.

`sources`: the corpora (a bundled default, text, nanoGPT `.bin`, image folders) and batches that are a pure
function of (seed, step); `hosts`: this process's rows of a global batch, as global arrays.
"""

from jaxring.data.hosts import global_array, host_rows, to_one_device
from jaxring.data.sources import ImageBatches, TokenBatches, load_images, load_tokens

__all__ = ["ImageBatches", "TokenBatches", "global_array", "host_rows", "load_images", "load_tokens", "to_one_device"]
