"""Training data on the host: document stores, packed batches with a checkpointable position, images.

`tokenizer`: bytes or a tokenizer.json; `inputs`: reading text/.jsonl/.parquet documents, checked;
`store`: the memory-mapped store, opened and checked (`checksums`: its files' sha256); `prepare`: tokenize
once (`python -m jaxring.data prepare`) into a store, under a lock, stopping on a signal (`interrupt`);
`cache`: what `--data PATH` names (an input prepared on first use beside it); `packing`: documents
into rows and the batch convention (tokens, targets, segment_ids, positions, loss_mask); `loader`: grain
datasets of packed batches whose iterator state a checkpoint saves; `token_data`: what a run's data
settings name; `sources`: the older token windows (nanoGPT .bin) and images, batches a pure function of
(seed, step); `hosts`: this process's rows of a global batch, as global arrays.
"""
