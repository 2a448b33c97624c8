"""Peak host memory of `jaxring.models.hf.load_pretrained` on a sharded Hugging Face checkpoint of the 1B Llama shape
under fsdp8, against issue 22's bound: the largest tensor plus one device's share of the model.

    python benchmarks/hf_loading.py [--processes 8] [--dtype bfloat16] [--dir DIR] [--out FILE]

1. Writes a sharded safetensors checkpoint (config.json, model-0000k-of-0000n.safetensors, the index) of the
   Llama 3.2 1B shape (16 layers, hidden 2048, 32 heads, 8 K/V heads, FFN 8192, vocabulary 128256, tied
   embeddings; 1.24B parameters) with random weights, shard by shard (one shard's tensors in memory at a time).
2. Starts `--processes` CPU processes joined by `jax.distributed` (one device each, as an 8-host job), each
   loading the checkpoint with `load_pretrained(dir, make_plan(fsdp=8))`. Each measures its resident set's
   high-water mark over the load (VmHWM after resetting it through /proc/self/clear_refs, minus VmRSS before the
   load: file pages mapped by the reader count, as they do for the kernel) and checks its shards' values
   against the file.
3. Writes the figures and the bound to benchmarks/results/hf_loading.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "hf_loading.json")
# Llama 3.2 1B's shape (tied embeddings, head_dim 64) on llama3-8b's other settings
SHAPE = dict(num_layers=16, hidden=2048, num_heads=32, num_kv_heads=8, ffn=8192, tie_embeddings=True)
SHARD_SIZE = "500MB"
MiB = 2**20


def config():
    from jaxring.models import gpt

    return gpt.get_config("llama3-8b", **SHAPE)


def hf_tensor_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: its shape in the file} of a GPT of `cfg`, in jaxring.models.hf's file order."""
    from flax import nnx
    from flax.traverse_util import flatten_dict

    from jaxring.models import hf

    _, state = hf.abstract_model(cfg)
    shapes = {}
    for path, var in flatten_dict(nnx.to_pure_dict(state)).items():
        pattern, transposed, stacked = hf.hf_name(path)
        shape = tuple(var.shape[1:] if stacked else var.shape)
        for i in range(cfg.num_layers if stacked else 1):
            shapes[pattern.format(i=i)] = tuple(reversed(shape)) if transposed else shape
    return dict(sorted(shapes.items(), key=lambda kv: hf.file_order_key(kv[0])))


def write_checkpoint(path: str, cfg, dtype: str, seed: int = 0) -> tuple[dict, int]:
    """A sharded safetensors checkpoint of `cfg` with N(0, 0.02) weights (norm scales 1), written one shard at a
    time. Returns ({tensor name: shape}, the number of files)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from jaxring.models import hf

    np_dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    shapes = hf_tensor_shapes(cfg)
    limit = hf.size_bytes(SHARD_SIZE)
    shards, current, size = [], [], 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * np_dtype.itemsize
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    shards.append(current)
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0
    for k, names in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        data = {}
        for name in names:
            if name.endswith("norm.weight"):
                data[name] = np.ones(shapes[name], np_dtype)
            else:
                data[name] = (rng.standard_normal(shapes[name], dtype=np.float32) * 0.02).astype(np_dtype)
        save_file(data, os.path.join(path, file), metadata={"format": "pt"})
        total += sum(a.nbytes for a in data.values())
        weight_map.update(dict.fromkeys(data, file))
        del data
    with open(os.path.join(path, hf.INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path, hf.CONFIG), "w") as f:
        json.dump(hf.config_to_hf(cfg, dtype), f, indent=2)
    return shapes, len(shards)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def worker(path: str, process_id: int, processes: int, port: int, dtype: str) -> dict:
    """One process of the job: joins it, loads the checkpoint under fsdp, measures, checks its shards."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", 1)
    jax.distributed.initialize(f"127.0.0.1:{port}", processes, process_id, initialization_timeout=120)
    import jax.numpy as jnp
    from flax import nnx
    from flax.traverse_util import flatten_dict
    from safetensors import safe_open

    import jaxring
    from jaxring.models import hf

    plan = jaxring.make_plan(fsdp=processes)
    hf.read_config(path)  # imports and first calls done before the baseline
    rss_before = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    start = time.perf_counter()
    model, cfg = hf.load_pretrained(path, plan, dtype=jnp.dtype(dtype))
    state = nnx.to_pure_dict(nnx.state(model))
    jax.block_until_ready(state)
    seconds = time.perf_counter() - start
    peak = _status_bytes("VmHWM")
    local = sum(s.data.nbytes for a in jax.tree.leaves(state) for s in a.addressable_shards)
    # the shards hold the file's values: the embedding and the last layer's down projection (transposed)
    checked = 0
    flat = flatten_dict(state)
    with open(os.path.join(path, hf.INDEX)) as f:
        index = json.load(f)["weight_map"]
    last = cfg.num_layers - 1
    for key, name, layer in ((("embed", "table"), "model.embed_tokens.weight", None),
                             (("blocks", "mlp", "w_out"), f"model.layers.{last}.mlp.down_proj.weight", last)):  # fmt: skip
        with safe_open(os.path.join(path, index[name]), framework="numpy") as f:
            whole = f.get_tensor(name)
        for shard in flat[key].addressable_shards:
            got = np.asarray(shard.data)
            if layer is None:
                want = whole[shard.index]
            else:
                got = got[layer - (shard.index[0].start or 0)]
                want = whole.T[shard.index[1:]]
            np.testing.assert_array_equal(got, want, err_msg=f"process {process_id}: {name} {shard.index}")
            checked += 1
        del whole
    return {
        "process": process_id,
        "peak_increase_bytes": peak - rss_before,
        "rss_before_bytes": rss_before,
        "local_shard_bytes": local,
        "load_seconds": round(seconds, 2),
        "shards_checked": checked,
        "devices": f"{jax.local_device_count()} local of {jax.device_count()}",
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(processes: int, dtype: str, path: str | None, out: str) -> dict:
    import flax
    import jax
    import safetensors

    from jaxring.analysis.records import save_record

    cfg = config()
    tmp = None
    if path is None:
        tmp = path = tempfile.mkdtemp(prefix="hf_loading_")
    try:
        start = time.perf_counter()
        shapes, files = write_checkpoint(path, cfg, dtype)
        write_s = time.perf_counter() - start
        itemsize = np.dtype(dtype).itemsize if dtype != "bfloat16" else 2
        sizes = {name: math.prod(s) * itemsize for name, s in shapes.items()}
        model_bytes, largest = sum(sizes.values()), max(sizes.values())
        bound = largest + model_bytes / processes
        port = _free_port()
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
        argv = [sys.executable, os.path.abspath(__file__), "--worker", "--dir", path, "--dtype", dtype]
        argv += ["--processes", str(processes), "--port", str(port)]
        procs = [
            subprocess.Popen([*argv, "--process-id", str(i)], env=env, stdout=subprocess.PIPE, text=True)
            for i in range(processes)
        ]
        rows = []
        for i, p in enumerate(procs):
            stdout, _ = p.communicate(timeout=1800)
            if p.returncode:
                raise SystemExit(f"process {i} exited with {p.returncode}")
            rows.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    worst = max(r["peak_increase_bytes"] for r in rows)
    result = {
        "benchmark": "hf_loading",
        "what": "peak host memory (VmHWM over the load minus VmRSS before it) of load_pretrained under fsdp, "
        "per process, each process one CPU device of a jax.distributed job",
        "command": f"python benchmarks/hf_loading.py --processes {processes} --dtype {dtype}",
        "model": {"shape": "Llama 3.2 1B", **SHAPE, "vocab_size": cfg.vocab_size, "params": cfg.num_params()},
        "checkpoint": {
            "dtype": dtype,
            "files": files,
            "max_shard_size": SHARD_SIZE,
            "tensors": len(shapes),
            "bytes": model_bytes,
            "write_seconds": round(write_s, 1),
        },
        "processes": processes,
        "bound_bytes": int(bound),
        "bound": f"largest tensor {largest / MiB:.1f} MiB + one device's share {model_bytes / processes / MiB:.1f} "
        f"MiB = {bound / MiB:.1f} MiB",
        "worst_peak_increase_mib": round(worst / MiB, 1),
        "within_bound": worst <= bound,
        "per_process": rows,
        "device": f"CPU ({platform.machine()}), {os.cpu_count()} cores",
        "versions": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "flax": flax.__version__,
            "safetensors": safetensors.__version__,
            "numpy": np.__version__,
        },
    }
    save_record(result, out)
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, default=8, help="jax.distributed CPU processes = fsdp degree")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="in the file and loaded")
    p.add_argument("--dir", help="where to write the checkpoint (default: a temporary directory, removed)")
    p.add_argument("--out", default=OUT)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.dir, args.process_id, args.processes, args.port, args.dtype)))
        return
    result = run(args.processes, args.dtype, args.dir, args.out)
    print(f"{result['bound']}; worst process's peak increase {result['worst_peak_increase_mib']} MiB "
          f"({'within' if result['within_bound'] else 'OVER'} the bound)")  # fmt: skip
    for r in result["per_process"]:
        print(f"  process {r['process']}: +{r['peak_increase_bytes'] / MiB:.1f} MiB peak, "
              f"{r['local_shard_bytes'] / MiB:.1f} MiB of shards, {r['load_seconds']} s")  # fmt: skip


if __name__ == "__main__":
    main()
