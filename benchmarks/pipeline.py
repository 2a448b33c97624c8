"""Pipeline schedules on a toy model and on the GPT train step: simulated bubble, compiled memory per device,
bytes between stages and tokens/s against the number of micro-batches m.

    python benchmarks/pipeline.py                     # toy rows   -> benchmarks/results/pipeline.json
    python benchmarks/pipeline.py --model gpt         # GPT rows, added to the rows already in that file

The toy: token embedding -> 8 residual-MLP layers (hidden 128, ffn 512, stacked and scanned) -> head and
cross-entropy; seq 64, fp32; a micro-batch is 8 sequences split over dp. Meshes on 8 simulated CPU devices:
pp=4 x dp=2 and pp=2 x dp=4 for each schedule (interleaved with v=2), and pp=1 x dp=8 (no pipeline, the same
micro-batches accumulated) as the reference. The batch (m micro-batches) is the same on every mesh, so every
row with the same m reports the same loss.

Per row: the simulator's bubble (paper costs T_F = T_B = T_W, each stage on its own clock, as the papers count
it; and the same costs on the lockstep clock one SPMD program runs on), peak in-flight micro-batches, compiled
temp and peak bytes per device, bytes per stage link read from the compiled program (and their total in
micro-batch activations per virtual-stage boundary per direction: m when the schedule sends exactly what it
must), compile time, median step time, tokens/s.
Simulated CPU devices share this host's cores, so idle pipeline stages free CPU for busy ones: tokens/s here
reflects total work and overhead, not the bubble; the bubble is what the simulator and a real multi-device run
show.

--model gpt: the whole GPT train step as `train.py --pp P --dp D --pipeline-schedule S --microbatches m` runs it
(forward, backward, gradient reduction, clipping, AdamW; `jaxring.train.trainer.Trainer`): the tiny preset with 8 layers
(hidden 128, 8 heads, ffn 512, byte vocabulary, RoPE), seq 128, fp32, a micro-batch of --gpt-micro-batch
sequences (split over dp), m micro-batches a step; the reference is dp=8 with the same micro-batches as gradient
accumulation (--grad-accum m). Memory and stage-link bytes are read from the compiled step; tokens/s is the
median of --runs steps after one warm-up step. Rows carry "model": "gpt" (the toy rows have no "model" key);
their summary is "gpt_summary". Rows already in the file are kept: a rerun measures only the missing ones.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxring.analysis.records import benchmark_record, save_record
from jaxring.core.device_setup import use_cpu_devices_if_no_accelerator

MESHES = {"pp4xdp2": dict(pp=4, dp=2), "pp2xdp4": dict(pp=2, dp=4)}
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zero-bubble")


def toy(vocab, hidden, layers, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    stack = {
        "w1": jax.random.normal(k[0], (layers, hidden, 4 * hidden)) * hidden**-0.5,
        "b1": jnp.zeros((layers, 4 * hidden)),
        "w2": jax.random.normal(k[1], (layers, 4 * hidden, hidden)) * (4 * hidden) ** -0.5 / layers,
    }
    shared = {
        "embed": jax.random.normal(k[2], (vocab, hidden)),
        "head": jax.random.normal(k[3], (hidden, vocab)) * hidden**-0.5,
        "norm": jnp.ones((hidden,)),
    }
    return stack, shared


def embed_fn(shared, mb):
    return shared["embed"][mb["tokens"]]


def stage_fn(chunk, x, mb):
    def layer(x, w):
        return x + jax.nn.gelu(x @ w["w1"] + w["b1"]) @ w["w2"], None

    return lax.scan(layer, x, chunk)[0]


def loss_fn(shared, x, mb):
    x = x * lax.rsqrt(jnp.mean(x**2, -1, keepdims=True) + 1e-6) * shared["norm"]
    logits = x @ shared["head"]
    target = jnp.take_along_axis(logits, mb["targets"][..., None], -1)[..., 0]
    return jnp.sum(jax.nn.logsumexp(logits, -1) - target), {}


def step_fn(mesh, schedule):
    from jaxring.parallel.pipeline import pipeline_loss_and_grads

    def body(staged, shared, microbatches):
        loss, _, d_stage, d_shared = pipeline_loss_and_grads(
            schedule,
            embed_fn=embed_fn,
            stage_fn=stage_fn,
            loss_fn=loss_fn,
            stage_params=jax.tree.map(lambda a: a[0], staged),
            shared_params=shared,
            microbatches=microbatches,
        )
        return loss, jax.tree.map(lambda a: a[None], d_stage), d_shared

    batch_spec = {"tokens": P(None, "dp"), "targets": P(None, "dp")}
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("pp"), P(), batch_spec), out_specs=(P(), P("pp"), P())))


def run_row(devices, name, degrees, m, v, args):
    from jaxring.analysis.compiled import collective_traffic
    from jaxring.core.mesh import make_mesh
    from jaxring.core.timing import median_seconds
    from jaxring.parallel.pipeline import make_schedule, simulate
    from jaxring.parallel.pipeline.traffic import stage_link_bytes

    pp, dp = degrees["pp"], degrees["dp"]
    schedule = make_schedule(name, pp, m, v)
    row = {
        "schedule": name,
        "mesh": f"pp{pp}xdp{dp}",
        "pp": pp,
        "dp": dp,
        "m": m,
        "v": v,
        "bubble_sim": simulate(schedule).bubble,
        "bubble_sim_lockstep": simulate(schedule, lockstep=True).bubble,
        "peak_in_flight": max(simulate(schedule).peak_in_flight),
        "ticks": schedule.num_ticks,
    }
    mesh = make_mesh(devices=devices[: pp * dp], **degrees)
    stack, shared = toy(args.vocab, args.hidden, args.layers)
    staged = jax.tree.map(lambda a: jnp.swapaxes(a.reshape(v, pp, -1, *a.shape[1:]), 0, 1), stack)
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    shape = (m, args.micro_batch, args.seq)
    batch = {
        "tokens": jax.random.randint(k1, shape, 0, args.vocab),
        "targets": jax.random.randint(k2, shape, 0, args.vocab),
    }
    step = step_fn(mesh, schedule)
    start = time.perf_counter()
    compiled = step.lower(staged, shared, batch).compile()
    row["compile_s"] = time.perf_counter() - start
    mem = compiled.memory_analysis()
    moved, _ = collective_traffic(compiled.as_text(), pp * dp)
    links = stage_link_bytes(compiled.as_text(), mesh)
    activation = 4 * args.micro_batch // dp * args.seq * args.hidden
    row.update(
        temp_bytes=mem.temp_size_in_bytes,
        peak_bytes=mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        + mem.temp_size_in_bytes
        - mem.alias_size_in_bytes,
        link_bytes={f"{a}->{b}": n for (a, b), n in links.items()},
        link_bytes_in_activations=sum(links.values()) / activation / max(v * pp - 1, 1) / 2,
        all_reduce_bytes=moved["all-reduce"],
    )
    seconds = median_seconds(compiled, staged, shared, batch, runs=args.runs)
    tokens = m * args.micro_batch * args.seq
    row.update(step_s=seconds, tokens_per_s=tokens / seconds, loss=float(compiled(staged, shared, batch)[0]) / tokens)
    return row


GPT_OVERRIDES = dict(num_layers=8, hidden=128, num_heads=8, ffn=512)


def run_gpt_row(devices, name, degrees, m, v, args):
    """One GPT train-step row (see the module docstring); pp = 1 is the no-pipeline reference."""

    from jaxring.parallel.pipeline import make_schedule, simulate
    from jaxring.parallel.pipeline.traffic import stage_link_bytes
    from jaxring.run.spec import RunSpec
    from jaxring.train.loop import Trainer

    pp, dp = degrees["pp"], degrees["dp"]
    mesh_name = f"pp{pp}xdp{dp}"
    row = {
        "model": "gpt",
        "schedule": name if pp > 1 else "none (pp=1)",
        "mesh": mesh_name,
        "pp": pp,
        "dp": dp,
        "m": m,
        "v": v,
        "seq": args.gpt_seq,
        "micro_batch": args.gpt_micro_batch,
    }
    pipeline = dict(pp=pp, pipeline_schedule=name, microbatches=m) if pp > 1 else dict(grad_accum=m)
    if pp > 1 and v > 1:
        pipeline["virtual_stages"] = v
    cfg = RunSpec.of(
        model="gpt",
        preset="tiny",
        overrides=GPT_OVERRIDES,
        seq_len=args.gpt_seq,
        batch_size=m * args.gpt_micro_batch,
        steps=10**6,
        sample_tokens=0,
        eval_at_end=False,
        progress=False,
        dp=dp,
        **pipeline,
    )
    trainer = Trainer(cfg, devices[: pp * dp])
    row["params"] = sum(x.size for x in jax.tree.leaves(trainer.params))
    if pp > 1:
        schedule = make_schedule(name, pp, m, v)
        row.update(
            bubble_sim=simulate(schedule).bubble,
            bubble_sim_lockstep=simulate(schedule, lockstep=True).bubble,
            peak_in_flight=max(simulate(schedule).peak_in_flight),
            ticks=schedule.num_ticks,
        )
    else:
        row.update(bubble_sim=0.0, bubble_sim_lockstep=0.0, peak_in_flight=1, ticks=2 * m)
    start = time.perf_counter()
    # the trainer's own jitted step (its compiled executable is cached: the steps below reuse it)
    compiled = trainer.lower_step().compile()
    row["compile_s"] = time.perf_counter() - start
    mem = compiled.memory_analysis()
    text = compiled.as_text()
    links = stage_link_bytes(text, trainer.plan.run_mesh) if pp > 1 else {}
    # what crosses a stage boundary: one micro-batch's activations [micro_batch / dp, seq, hidden] in fp32
    activation = 4 * args.gpt_micro_batch // dp * args.gpt_seq * GPT_OVERRIDES["hidden"]
    from jaxring.analysis.compiled import collective_traffic

    moved, _ = collective_traffic(text, pp * dp)
    row.update(
        temp_bytes=mem.temp_size_in_bytes,
        argument_bytes=mem.argument_size_in_bytes,
        peak_bytes=mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        + mem.temp_size_in_bytes
        - mem.alias_size_in_bytes,
        link_bytes={f"{a}->{b}": n for (a, b), n in links.items()},
        link_bytes_in_activations=sum(links.values()) / activation / max(v * pp - 1, 1) / 2,
        all_reduce_bytes=moved["all-reduce"],
    )
    losses, times = [], []
    for i in range(1 + args.runs):
        t0 = time.perf_counter()
        losses.append(float(trainer.step()["loss"]))  # waits for the step
        if i:
            times.append(time.perf_counter() - t0)
    seconds = sorted(times)[len(times) // 2]
    row.update(step_s=seconds, tokens_per_s=trainer.task.tokens_per_step / seconds, loss=losses[0], losses=losses)
    return row


def main_gpt(args, devices):
    """GPT rows appended to the existing record (the toy rows and their summary stay as they are)."""
    import json

    record = benchmark_record("pipeline", devices, {})
    if os.path.exists(args.out):
        with open(args.out) as f:
            record = json.load(f)
    run = benchmark_record("pipeline", devices, {k: x for k, x in vars(args).items() if k != "out"})
    del run["results"]
    run["host_load_average_start"] = os.getloadavg()
    record.setdefault("gpt_runs", []).append(run)
    rows = record["results"]
    # GPT rows already measured (without an error) stay; a rerun measures only the missing ones
    done = {(r["schedule"], r["mesh"], r["m"]) for r in rows if r.get("model") == "gpt" and "error" not in r}
    meshes = [m for m in args.meshes if m in MESHES]
    for m in args.microbatches:
        configs = [("1f1b", dict(pp=1, dp=8), 1)]
        configs += [
            (name, MESHES[mesh], 2 if name == "interleaved" else 1) for mesh in meshes for name in args.schedules
        ]
        for name, degrees, v in configs:
            key = (name if degrees["pp"] > 1 else "none (pp=1)", f"pp{degrees['pp']}xdp{degrees['dp']}", m)
            if key in done:
                continue
            try:
                row = run_gpt_row(devices, name, degrees, m, v, args)
            except Exception as e:
                row = {"model": "gpt", "schedule": name, "m": m, **degrees, "error": f"{type(e).__name__}: {e}"[:500]}
            rows.append(row)
            print(
                {k: (round(x, 4) if isinstance(x, float) else x) for k, x in row.items() if k != "losses"}, flush=True
            )
            run["host_load_average_end"] = os.getloadavg()
            record["gpt_summary"] = summarize(rows, model="gpt")
            save_record(record, args.out)
    print(record["gpt_summary"])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--microbatches", type=int, nargs="*", default=[4, 8, 16])
    p.add_argument("--schedules", nargs="*", default=list(SCHEDULE_NAMES))
    p.add_argument("--meshes", nargs="*", default=list(MESHES))
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch (split over dp)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument(
        "--model",
        choices=("toy", "gpt"),
        default="toy",
        help="toy: the residual-MLP toy (replaces the record); gpt: the GPT train step (adds rows)",
    )
    p.add_argument("--gpt-seq", type=int, default=128)
    p.add_argument("--gpt-micro-batch", type=int, default=8, help="GPT sequences per micro-batch (split over dp)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "pipeline.json"))
    args = p.parse_args()
    devices = use_cpu_devices_if_no_accelerator(8)
    if args.model == "gpt":
        return main_gpt(args, devices)
    record = benchmark_record("pipeline", devices, vars(args))
    record["host_load_average"] = os.getloadavg()
    rows = record["results"]
    for m in args.microbatches:  # reference: no pipeline, dp=8, the same micro-batches accumulated
        configs = [("1f1b", dict(pp=1, dp=8), 1)]
        configs += [
            (name, MESHES[mesh], 2 if name == "interleaved" else 1) for mesh in args.meshes for name in args.schedules
        ]
        for name, degrees, v in configs:
            try:
                row = run_row(devices, name, degrees, m, v, args)
            except Exception as e:
                row = {"schedule": name, "m": m, **degrees, "error": f"{type(e).__name__}: {e}"[:500]}
            if degrees["pp"] == 1:
                row["schedule"] = "none (pp=1)"
            rows.append(row)
            print({k: (round(x, 4) if isinstance(x, float) else x) for k, x in row.items()}, flush=True)
            record["summary"] = summarize(rows)
            save_record(record, args.out)
    print(record["summary"])


def summarize(rows, model=None):
    """Per mesh and schedule, against m: bubble (paper clock / lockstep), temp MB, tokens/s; and whether every
    virtual-stage boundary carried exactly m activations each way. The toy's rows (model None) or the GPT's."""
    out = {}
    for r in rows:
        if "error" in r or r.get("model") != model:
            continue
        entry = out.setdefault(r["mesh"], {}).setdefault(r["schedule"], {"by_m": {}, "sends_exactly_m": True})
        entry["by_m"][r["m"]] = {
            "bubble": round(r["bubble_sim"], 4),
            "bubble_lockstep": round(r["bubble_sim_lockstep"], 4),
            "temp_MB": round(r["temp_bytes"] / 1e6, 2),
            "peak_MB": round(r["peak_bytes"] / 1e6, 2),
            "tokens_per_s": round(r["tokens_per_s"]),
            "loss": round(r["loss"], 5),
        }
        if r["pp"] > 1:
            entry["sends_exactly_m"] &= r["link_bytes_in_activations"] == r["m"]
    return out


if __name__ == "__main__":
    main()
