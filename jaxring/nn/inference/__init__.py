"""Inference with a KV cache sharded like the training sequence: prefill through the plan's sequence strategy,
then one query per step against the cache shards, merged once by log-sum-exp (`decode`), and the sampling
rules (`sampling`). The model-specific loops live with the model (`models/generate.py`)."""

from jaxring.nn.inference.decode import (
    attend_cache_shard,
    cache_length,
    cache_spec,
    check_decodable,
    decode_attention,
    decode_embed,
    decode_logits,
    decode_mlp,
    local_kv_heads,
    merge_over,
    own_key,
    prefill_kv,
    write_cache,
)
from jaxring.nn.inference.sampling import check_sampling, sample

__all__ = [
    "attend_cache_shard",
    "cache_length",
    "cache_spec",
    "check_decodable",
    "check_sampling",
    "decode_attention",
    "decode_embed",
    "decode_logits",
    "decode_mlp",
    "local_kv_heads",
    "merge_over",
    "own_key",
    "prefill_kv",
    "sample",
    "write_cache",
]
