"""Builds the Hugging Face oracle fixtures of tests/unit/models/test_hf.py: one tiny random model per family, saved with
transformers (config.json + model.safetensors), and its float32 logits and the gradients of the mean loss
for one fixed batch (oracle.npz: tokens, targets, logits, and "grad/<HF tensor name>").

Needs torch and transformers (the `hf-oracle` extra); the tests never import them. Run:

    /path/to/venv-with-transformers/bin/python tools/make_hf_fixtures.py [--out tests/fixtures/hf]
        [--jax-python .venv/bin/python]

With --jax-python (a Python with jaxring), it also checks the way back: jaxring loads each fixture, writes it
with `models.hf.save_pretrained` (sharded), and transformers loads that with the same logits.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
import transformers

BATCH, SEQ = 2, 32
COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
FAMILIES = {  # name -> (config class, settings)
    "llama": ("LlamaConfig", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "llama3": (
        "LlamaConfig",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        ),
    ),
    "mistral": ("MistralConfig", dict(sliding_window=8, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rms_norm_eps=1e-6)),
    "qwen3": (
        "Qwen3Config",
        dict(
            head_dim=16,
            rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
}
# the older config.json form (top-level rope_theta, rope_scaling with "type"), as released checkpoints have it
LEGACY_CONFIG = {"llama3"}


def build(name: str, seed: int):
    config_class, settings = FAMILIES[name]
    config = getattr(transformers, config_class)(**{**COMMON, **settings})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():  # every parameter random (biases and norm scales too), scaled to keep logits O(1)
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            elif "embed_tokens" in pname:  # tied: also the head, so scaled like one
                p.copy_(torch.randn_like(p) * (p.shape[-1] ** -0.5 if config.tie_word_embeddings else 1.0))
            else:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    return model.eval()


def batch(seed: int):
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, COMMON["vocab_size"], (BATCH, SEQ + 1)).astype(np.int64)
    return rows[:, :-1], rows[:, 1:]


def oracle(model, tokens, targets) -> dict:
    model.zero_grad()
    logits = model(torch.from_numpy(tokens)).logits
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.from_numpy(targets).reshape(-1)
    )
    loss.backward()
    out = {"tokens": tokens.astype(np.int32), "targets": targets.astype(np.int32)}
    out["logits"] = logits.detach().numpy().astype(np.float32)
    out["loss"] = np.float32(loss.item())
    for pname, p in model.named_parameters():
        out[f"grad/{pname}"] = p.grad.numpy().astype(np.float32)
    return out


def to_legacy_config(path: str):
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    cfg["rope_scaling"] = rope
    with open(file, "w") as f:
        json.dump(cfg, f, indent=2)


def check_way_back(out: str, jax_python: str):
    """jaxring loads each fixture and writes it again; transformers reads that with the same logits."""
    code = (
        "import sys; from models import hf\n"
        "model, cfg = hf.load_pretrained(sys.argv[1])\n"
        "hf.save_pretrained(model, cfg, sys.argv[2], max_shard_size='60KB')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in FAMILIES:
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"}
            subprocess.run([jax_python, "-c", code, os.path.join(out, name), tmp], check=True, env=env)
            shards = [f for f in os.listdir(tmp) if f.endswith(".safetensors")]
            model = transformers.AutoModelForCausalLM.from_pretrained(
                tmp, dtype=torch.float32, attn_implementation="eager"
            )
            data = np.load(os.path.join(out, name, "oracle.npz"))
            with torch.no_grad():
                got = model(torch.from_numpy(data["tokens"].astype(np.int64))).logits.numpy()
            err = float(np.abs(got - data["logits"]).max())
            print(f"{name}: save_pretrained -> transformers ({len(shards)} shards): max |logits diff| {err:.2e}")
            assert err < 1e-5, (name, err)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "hf"))
    parser.add_argument("--jax-python", default=None, help="a Python with jaxring: also check the way back")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    for seed, name in enumerate(FAMILIES):
        path = os.path.join(args.out, name)
        model = build(name, seed)
        model.save_pretrained(path)
        for extra in ("generation_config.json",):
            if os.path.exists(os.path.join(path, extra)):
                os.remove(os.path.join(path, extra))
        if name in LEGACY_CONFIG:
            to_legacy_config(path)
            reloaded = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager"
            )
            assert reloaded.config.rope_parameters["rope_type"] == FAMILIES[name][1]["rope_parameters"]["rope_type"]
        tokens, targets = batch(100 + seed)
        data = oracle(model, tokens, targets)
        np.savez_compressed(os.path.join(path, "oracle.npz"), **data)
        print(f"{name}: loss {float(data['loss']):.4f}, logits std {data['logits'].std():.3f}")
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    if args.jax_python:
        check_way_back(args.out, args.jax_python)


if __name__ == "__main__":
    sys.exit(main())
