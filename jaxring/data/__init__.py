"""Training data on the host: document stores, packed batches with a checkpointable position, images.

`tokenizer`: bytes or a tokenizer.json; `inputs`: reading text/.jsonl/.parquet documents, checked;
`store`: tokenize once (`python -m jaxring.data prepare`) into a memory-mapped store; `packing`: documents
into rows and the batch convention (tokens, targets, segment_ids, positions, loss_mask); `loader`: grain
datasets of packed batches whose iterator state a checkpoint saves; `token_data`: what a run's data
settings name; `sources`: the older token windows (nanoGPT .bin) and images, batches a pure function of
(seed, step); `hosts`: this process's rows of a global batch, as global arrays.
"""

from jaxring.data.hosts import global_array, host_rows, to_one_device
from jaxring.data.loader import PackedBatches, StepBatches, WindowBatches, split_documents
from jaxring.data.packing import BATCH_KEYS, PACKINGS, check_batch
from jaxring.data.sources import ImageBatches, TokenBatches, load_images, load_tokens
from jaxring.data.store import DocumentStore, open_store, prepare
from jaxring.data.token_data import TokenData, open_token_data
from jaxring.data.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "BATCH_KEYS",
    "PACKINGS",
    "DocumentStore",
    "ImageBatches",
    "PackedBatches",
    "StepBatches",
    "TokenBatches",
    "TokenData",
    "Tokenizer",
    "WindowBatches",
    "check_batch",
    "global_array",
    "host_rows",
    "load_images",
    "load_tokenizer",
    "load_tokens",
    "open_store",
    "open_token_data",
    "prepare",
    "split_documents",
    "to_one_device",
]
