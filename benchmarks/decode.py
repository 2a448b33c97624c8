"""Decoding one token from a long KV cache: the cache split over sp = 8 devices against one device.

cpu   One decoding step of GPT `tiny` (4 layers, hidden 128, 8 heads × 16; fp32, batch 1) against a
      32768-token cache (random K/V; the step writes the new token's K/V and attends every slot), on one
      device and on 8 simulated CPU devices (ring zigzag sp = 8: each device holds 4096 slots and attends
      them, the partial outputs merged once by log-sum-exp), and Megatron tp2 × sp4. Records the time per
      token (min and median over the timed steps, after one compile), the cache bytes per device and the
      compiled program's memory analysis. The simulated devices share the host's cores: the time shows the
      per-device work and the merge's cost, not a speed-up.
h200  The same decoding step of `llama3.1-8b` (fp32 weights and cache, as `generate` runs it) compiled for
      8 x H200 with no GPU (deviceless AOT, `jaxring.analysis.gpu`; needs the compile-only CUDA plugin venv and
      JAX_PLATFORMS=cpu) at 32K and 1M cached tokens, and for one H200 at 32K: XLA's memory analysis per device.

    JAX_PLATFORMS=cpu /path/to/gpu-venv/bin/python benchmarks/decode.py     # both -> benchmarks/results/decode.json
    python benchmarks/decode.py --only cpu --steps 5 --out /tmp/decode.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the simulated devices, and deviceless GPU compiles

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxring.analysis.records import benchmark_record, save_record
from jaxring.core.device_setup import use_cpu_devices_if_no_accelerator

GIB = 2**30


def cpu_plan(name: str, devices):
    import jaxring

    if name == "1 device":
        return jaxring.make_plan(devices[:1])
    if name == "ring zigzag sp8":
        return jaxring.make_plan(devices[:8], sp=8, attention="ring", layout="zigzag")
    return jaxring.make_plan(devices[:8], sp=4, tp=2, attention="ring", layout="zigzag", tensor_parallel="megatron")


def time_decoding(model, plan, length: int, steps: int) -> dict:
    """Per-token time of `Decoder.step` at position length - 1 of a random cache of `length` slots."""
    from jax.sharding import PartitionSpec as P

    from jaxring.core.mesh import spec_entry
    from jaxring.models.generate import Decoder, sampling_rule

    decoder = Decoder(model, plan)
    abstract = decoder.abstract_cache(1, length)
    fill = jax.jit(lambda key: jax.random.normal(key, abstract.shape, jnp.float32), out_shardings=abstract.sharding)
    k, v = fill(jax.random.PRNGKey(1)), fill(jax.random.PRNGKey(2))
    rows = NamedSharding(plan.run_mesh, P(spec_entry(plan.batch_axes)))
    token, position = jax.device_put((np.array([7], np.int32), np.array([length - 1], np.int32)), rows)
    slots, rule, key = decoder.cache_positions(length), sampling_rule(0.0), jax.random.PRNGKey(0)
    start = time.perf_counter()
    compiled = decoder.step.lower(decoder.params, k, v, slots, token, position, key, rule).compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    times = []
    for _ in range(steps + 1):  # the first one warms up
        start = time.perf_counter()
        _, logits, k, v = decoder.step(decoder.params, k, v, slots, token, position, key, rule)
        logits.block_until_ready()
        times.append(time.perf_counter() - start)
    times = times[1:]
    return {
        "plan": plan.describe(),
        "cache_tokens": length,
        "cache_bytes_total": 2 * abstract.size * 4,
        "cache_bytes_per_device": 2 * k.addressable_shards[0].data.nbytes,
        "argument_bytes_per_device": memory.argument_size_in_bytes,
        "temp_bytes_per_device": memory.temp_size_in_bytes,
        "ms_per_token_min": 1e3 * min(times),
        "ms_per_token_median": 1e3 * statistics.median(times),
        "steps": steps,
        "compile_s": round(compile_s, 2),
    }


def compile_for_h200(cfg, length: int, sp: int) -> dict:
    """Deviceless compile of the decode step of `cfg` at `length` cached tokens on `sp` abstract H200s."""
    from flax import nnx

    import jaxring
    from jaxring.analysis import gpu
    from jaxring.models import gpt
    from jaxring.models.generate import Decoder

    devices = gpu.gpu_devices("h200", sp)
    settings = dict(sp=sp, attention="ring", layout="zigzag") if sp > 1 else {}
    plan = jaxring.make_plan(devices, **settings)
    model = nnx.eval_shape(lambda: gpt.GPT(cfg, rngs=nnx.Rngs(0)))
    decoder = Decoder(model, plan)
    report = gpu.compile_for_gpu(decoder.step.lower(*decoder.abstract_step_inputs(1, length)), ptxas=False)
    m = report.memory
    cache = 2 * int(np.prod(decoder.cache_shape(1, length))) * 4
    return {
        "target": f"h200 x {sp} (deviceless compile)",
        "plan": plan.describe(),
        "cache_tokens": length,
        "cache_gib_total": cache / GIB,
        "cache_gib_per_device": cache / sp / GIB,
        "weights_gib_per_device": cfg.num_params() * 4 / GIB,
        "argument_gib": m["argument"] / GIB,
        "output_gib": m["output"] / GIB,
        "alias_gib": m["alias"] / GIB,
        "temp_gib": m["temp"] / GIB,
        "peak_gib": report.peak_bytes / GIB,
        "compile_s": round(report.compile_seconds, 1),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("cpu", "h200"), default=None)
    parser.add_argument("--length", type=int, default=32768, help="cached tokens of the CPU timing")
    parser.add_argument("--steps", type=int, default=20, help="timed decoding steps per plan")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "decode.json"))
    args = parser.parse_args()
    devices = use_cpu_devices_if_no_accelerator(8)
    from flax import nnx

    from jaxring.models import gpt

    record = benchmark_record(
        "decode",
        devices,
        {
            "cpu": "gpt tiny (4 layers, hidden 128, 8 heads x 16, vocab 256), fp32, batch 1, greedy, "
            f"{args.length}-token cache of random K/V, the new token at the last slot",
            "h200": "gpt llama3.1-8b, fp32 weights and cache, batch 1, ring zigzag layout, deviceless compile",
            "environment": "JAX_PLATFORMS=cpu, in a venv with the gpu-compile extra (compile-only CUDA plugin)",
        },
    )
    if args.only in (None, "cpu"):
        model = gpt.GPT(gpt.get_config("tiny"), rngs=nnx.Rngs(0))
        for name in ("1 device", "ring zigzag sp8", "megatron tp2 x sp4"):
            row = {"kind": "cpu", **time_decoding(model, cpu_plan(name, devices), args.length, args.steps)}
            record["results"].append(row)
            save_record(record, args.out)
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    if args.only in (None, "h200"):
        from jaxring.analysis import gpu

        ok, why = gpu.available()
        if not ok:
            record["results"].append({"kind": "h200", "skipped": why})
            save_record(record, args.out)
            print("h200 skipped:", why)
            return
        cfg = gpt.get_config("llama3.1-8b")
        for length, sp in ((32768, 1), (32768, 8), (1 << 20, 8)):
            row = {"kind": "h200", **compile_for_h200(cfg, length, sp)}
            record["results"].append(row)
            save_record(record, args.out)
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)


if __name__ == "__main__":
    main()
