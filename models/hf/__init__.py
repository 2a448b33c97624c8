"""Hugging Face causal-LM checkpoints in and out of `jaxring.models.gpt` (the Llama family by configuration).

    model, cfg = load_pretrained("path/to/Llama-3.1-8B", plan)   # config.json + safetensors, onto the plan
    out = logits(model, tokens, plan)                               # float32 [batch, seq, vocab], token order
    save_pretrained(model, cfg, "out/")                             # config.json + sharded safetensors + index

    python -m jaxring.models.hf export CHECKPOINT_DIR OUT_DIR [--step N]   # a training checkpoint (cli.py)

One concern per file, re-exported here:
  config.py  config.json <-> GPTConfig, HF tensor names <-> our parameter paths, tokenizer.json check, errors
  load.py    load_pretrained (each device reads only its shards' slices) and logits
  save.py    save_pretrained (one tensor gathered at a time) and the export-directory rule
  cli.py     the export command (imported only by __main__.py: the format code never imports the command)
Every refusal is one `CheckpointError` line naming the file and the tensor or setting.
"""

from jaxring.models.hf.config import (
    ARCHITECTURES,
    CONFIG,
    INDEX,
    SAVE_DTYPES,
    TOKENIZER,
    WEIGHTS,
    CheckpointError,
    DamagedWeights,
    abstract_model,
    architecture_of,
    check_tokenizer,
    config_from_hf,
    config_to_hf,
    hf_name,
    read_config,
)
from jaxring.models.hf.load import CheckpointFiles, load_pretrained, logits
from jaxring.models.hf.save import (
    check_export,
    check_export_dir,
    export_bytes,
    file_order_key,
    is_export_dir,
    is_export_file,
    save_pretrained,
    size_bytes,
    to_hf_tensors,
)

__all__ = [
    "ARCHITECTURES",
    "CONFIG",
    "INDEX",
    "SAVE_DTYPES",
    "TOKENIZER",
    "WEIGHTS",
    "CheckpointError",
    "CheckpointFiles",
    "DamagedWeights",
    "abstract_model",
    "architecture_of",
    "check_export",
    "check_export_dir",
    "check_tokenizer",
    "config_from_hf",
    "config_to_hf",
    "export_bytes",
    "file_order_key",
    "hf_name",
    "is_export_dir",
    "is_export_file",
    "load_pretrained",
    "logits",
    "read_config",
    "save_pretrained",
    "size_bytes",
    "to_hf_tensors",
]
