"""Tokens per second of tokenizing (prepare) and of loading packed batches, beside the tiny GPT's training rate.

    python benchmarks/data_throughput.py             # writes benchmarks/results/data_throughput.json

Tokenizing: the bundled corpus (the Python standard library's files, one document each) written out as text
files, prepared into a store with the byte-level vocabulary and with a byte-level BPE tokenizer (vocab 4096)
trained here on that corpus with `tokenizers` (nothing downloaded), in 1 and 2 worker processes (wall time
includes starting the workers). Loading: `PackedBatches` over those stores (split and drop packing), next()
in this thread, and `StepBatches` (a prefetch thread), at the tiny GPT's shape (8 x 256) and a long-context
one (8 x 32768). Training: tokens/s of `train.py`'s default tiny GPT (8 x 256, sp=8 ring) after compilation,
from a short run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

from jaxring.analysis.records import benchmark_record, save_record
from jaxring.core.device_setup import use_cpu_devices_if_no_accelerator
from jaxring.data.loader import PackedBatches, StepBatches, split_documents
from jaxring.data.prepare import prepare
from jaxring.data.store import bundled_store


def train_bpe(texts, path: str, vocab: int = 4096) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(path)
    return path


def load_rate(store, seq_len: int, batch: int, packing: str, prefetch: bool, seconds: float = 3.0) -> dict:
    ds = PackedBatches(
        store, split_documents(store, "train", 0.1), batch_size=batch, seq_len=seq_len, seed=0, packing=packing
    )
    if prefetch:
        source = StepBatches(ds)
        get = source.get
    else:
        it = iter(ds)
        get = lambda step: next(it)
    get(0)
    steps, t0 = 1, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        get(steps)
        steps += 1
    dt = time.perf_counter() - t0
    if prefetch:
        source.close()
    return {"tokens_per_s": (steps - 1) * batch * seq_len / dt, "batches_per_s": (steps - 1) / dt}


def train_rate(steps: int) -> dict:
    from jaxring.run.spec import RunSpec
    from jaxring.train.loop import train

    spec = RunSpec.of(steps=steps, progress=False, sample_tokens=0, eval_at_end=False, log_every=1000)
    with tempfile.TemporaryDirectory() as out:
        history = train(spec.updated(out_dir=out), log=lambda *a: None)
    rates = [r["tokens_per_s"] for r in history[2:]]  # after the compiling steps
    return {"steps": steps, "tokens_per_s_median": float(np.median(rates)), "batch": 8, "seq_len": 256}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "data_throughput.json"))
    parser.add_argument("--train-steps", type=int, default=8)
    args = parser.parse_args()
    devices = use_cpu_devices_if_no_accelerator(8)
    record = benchmark_record(
        "data_throughput", devices, {"corpus": "bundled python-stdlib files", "bpe_vocab": 4096, "workers": [1, 2]}
    )
    import tokenizers

    record["tokenizers"] = tokenizers.__version__
    corpus = bundled_store()
    texts = [corpus.tokenizer.decode(corpus.document(d)) for d in range(corpus.num_docs)]
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "corpus")
        os.makedirs(src)
        for d, text in enumerate(texts):
            with open(os.path.join(src, f"{d:03d}.txt"), "w", encoding="utf-8") as f:
                f.write(text)
        bpe = train_bpe(texts, os.path.join(tmp, "tokenizer.json"))
        stores = {}
        for name, tok in (("bytes", "bytes"), ("bpe-4096", bpe)):
            for workers in (1, 2):
                out = os.path.join(tmp, f"{name}-{workers}")
                t0 = time.perf_counter()
                store = prepare(src, out, tokenizer=tok, workers=workers, progress=False)
                dt = time.perf_counter() - t0
                stores[name] = store
                row = {
                    "kind": "tokenize",
                    "tokenizer": name,
                    "workers": workers,
                    "documents": store.num_docs,
                    "input_bytes": sum(len(t.encode()) for t in texts),
                    "tokens": store.num_tokens,
                    "seconds": dt,
                    "tokens_per_s": store.num_tokens / dt,
                    "bytes_per_s": sum(len(t.encode()) for t in texts) / dt,
                }
                record["results"].append(row)
                print(f"tokenize {name} x{workers}: {row['tokens_per_s']:,.0f} tokens/s ({dt:.2f} s)")
                save_record(record, args.out)
        for name, store in stores.items():
            for seq_len in (256, 32768):
                for packing in ("split", "drop"):
                    for prefetch in (False, True):
                        try:
                            rate = load_rate(store, seq_len, 8, packing, prefetch)
                        except ValueError as e:  # drop: no document of the corpus fits in a short row
                            rate = {"not_applicable": str(e)}
                        row = {
                            "kind": "load",
                            "tokenizer": name,
                            "seq_len": seq_len,
                            "batch": 8,
                            "packing": packing,
                            "prefetch": prefetch,
                            **rate,
                        }
                        record["results"].append(row)
                        print(
                            f"load {name} 8x{seq_len} {packing} prefetch={prefetch}: {rate.get('tokens_per_s', 0):,.0f} tokens/s"
                        )
                        save_record(record, args.out)
    row = {"kind": "train", "model": "gpt tiny", "mesh": "sp=8 ring (train.py default)", **train_rate(args.train_steps)}
    record["results"].append(row)
    print(f"train tiny GPT: {row['tokens_per_s_median']:,.0f} tokens/s")
    save_record(record, args.out)


if __name__ == "__main__":
    main()
