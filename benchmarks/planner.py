"""The planner's choices for the WallFacer and METP papers' settings, beside the configurations the papers found
best (predictions of the registry entries' cost models, jaxring/planner/cost_model.py; no GPU runs here). With --compile-check, the top plans' train steps
are compiled for the GPU target without a GPU (the gpu-compile extra, JAX_PLATFORMS=cpu) and their compiled
memory is recorded beside the prediction.

Settings (bf16, batch 1 as in both papers' long-sequence runs):
  WallFacer GPT-7B   H100 80GB, 8 per node, InfiniBand (one 400 Gb/s NIC per GPU: 50 GB/s): 128k on 8-64 GPUs
                     (strong scaling, Fig. 9b) and 64k/8 .. 512k/64 (weak scaling, Fig. 10b). Paper's best:
                     WallFacer, C = 4 on 8-GPU nodes (Sec. 4.1; C = 2 where 16 ∤ P), over ring attention.
  WallFacer DiT-1B   A100 40GB, 100 Gb/s Ethernet per node (assumed one NIC per node: 12.5 GB/s shared by its
                     GPUs), 16×2 and 8×4 GPUs at 128k-512k (Fig. 7), 128k/8 .. 512k/32 (Fig. 10a). Paper's
                     best: C = 2 on 16-GPU nodes, C = 4 on 8-GPU nodes.
  METP LLaMA-7B      8 A100 80GB, NVLink (one node), 32k-256k (Figs. 4b, 5b). Paper's best: METP over tp = 8
                     (MFU above Megatron TP+SP; Ulysses+ZeRO degrades on LLaMA-7B).

For each: the planner's overall choice, its choice within the paper's own search space (WallFacer's Eq. 8:
sp = every GPU, any C and placement; METP: tp = 8), the paper's best configuration and its baseline as the
cost model predicts them, with remat searched (none, selective, full) like every other option. Both papers
checkpoint every layer (WallFacer Sec. 3.2.2, METP's recomputation): their configurations are given --remat full.

    python benchmarks/planner.py                                   # predictions only (a few minutes on CPU)
    JAX_PLATFORMS=cpu .venv-gpu/bin/python benchmarks/planner.py --compile-check   # + compiled GPU memory
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the planner runs nothing; GPU-target compiles need the CPU platform

from jaxring.analysis.records import benchmark_record, save_record
from jaxring.aot.memory_check import GPU_TARGETS, compiled_peak, gpu_target_available
from jaxring.planner import Candidate, Cluster, NoPlanError, Workload, evaluate, search
from jaxring.planner.search import plan_json

K = 1024


def _wallfacer_best(p: int, per_node: int) -> Candidate:
    """The paper's best: C = 4 on 8-GPU nodes (C = 2 where C² = 16 does not divide P, and on 16-GPU nodes);
    ZeRO-2 as in its runs (Sec. 3.2.2); the placement is not reported: jaxring's default (teams in a node)."""
    c = 4 if p % 16 == 0 and per_node == 8 else 2
    return Candidate.of(
        sp=p, attention="wallfacer", team_size=c, placement="team_inner", zero=2, remat="full", micro_batch=1
    )


def _ring(p: int) -> Candidate:
    return Candidate.of(sp=p, attention="ring", zero=2, remat="full", micro_batch=1)


def _wallfacer_space(p: int) -> dict:
    """WallFacer's Eq. 8: argmax over C ∈ [1, √P] (C = 1 is the ring) and the placement, every GPU on the
    sequence, ZeRO-2."""
    return {"sp": p, "attention": ("ring", "wallfacer"), "zero": 2}


# METP's comparison: Megatron TP+SP, DeepSpeed-Ulysses with ZeRO, METP, on one 8-GPU node
METP_SPACE = {"dp": 1, "pp": 1, "attention": ("dense", "ulysses"), "tensor_parallel": ("megatron", "metp", None)}


SETTINGS = []
for p in (8, 16, 32, 64):  # WallFacer GPT-7B strong scaling at 128k
    SETTINGS.append(
        dict(
            paper="WallFacer",
            name=f"GPT-7B 128k on {p} H100",
            model="gpt",
            preset="7b",
            seq=128 * K,
            device="h100",
            devices=p,
            per_node=8,
            inter_bw=None,
            paper_best=_wallfacer_best(p, 8),
            baseline=_ring(p),
            space=_wallfacer_space(p),
            paper_note="WallFacer C=4 on 8-GPU nodes (C=2 on one node); +60.71% over ring at 64 GPUs (Fig. 9b)",
        )
    )
for seq, p in ((64, 8), (256, 32), (512, 64)):  # weak scaling (128k/16 is in the strong rows)
    SETTINGS.append(
        dict(
            paper="WallFacer",
            name=f"GPT-7B {seq}k on {p} H100",
            model="gpt",
            preset="7b",
            seq=seq * K,
            device="h100",
            devices=p,
            per_node=8,
            inter_bw=None,
            paper_best=_wallfacer_best(p, 8),
            baseline=_ring(p),
            space=_wallfacer_space(p),
            paper_note="WallFacer above ring at every size (Fig. 10b)",
        )
    )
for per_node in (16, 8):  # WallFacer DiT-1B on 32 A100 40GB, Ethernet
    for seq in (128, 256, 512):
        SETTINGS.append(
            dict(
                paper="WallFacer",
                name=f"DiT-1B {seq}k on 32 A100-40GB ({per_node}/node)",
                model="dit",
                preset="dit-1b",
                seq=seq * K,
                device="a100-40gb",
                devices=32,
                per_node=per_node,
                inter_bw=12.5e9 / per_node,
                paper_best=_wallfacer_best(32, per_node),
                baseline=_ring(32),
                space=_wallfacer_space(32),
                paper_note=f"C={4 if per_node == 8 else 2} on {per_node}-GPU nodes (Sec. 4.1); "
                "+114.33% over ring at 128k on 32 A100 (Fig. 9a)",
            )
        )
for seq, p in ((128, 8), (256, 16)):  # DiT weak scaling (512k/32 is above)
    SETTINGS.append(
        dict(
            paper="WallFacer",
            name=f"DiT-1B {seq}k on {p} A100-40GB (8/node)",
            model="dit",
            preset="dit-1b",
            seq=seq * K,
            device="a100-40gb",
            devices=p,
            per_node=8,
            inter_bw=12.5e9 / 8,
            paper_best=_wallfacer_best(p, 8),
            baseline=_ring(p),
            space=_wallfacer_space(p),
            paper_note="WallFacer above ring at every size (Fig. 10a)",
        )
    )
for seq in (32, 64, 128, 256):  # METP LLaMA-7B on 8 A100 80GB
    SETTINGS.append(
        dict(
            paper="METP",
            name=f"LLaMA-7B {seq}k on 8 A100-80GB",
            model="gpt",
            preset="7b",
            seq=seq * K,
            device="a100-80gb",
            devices=8,
            per_node=8,
            inter_bw=None,
            paper_best=Candidate.of(tp=8, tensor_parallel="metp", remat="full", micro_batch=1),
            baseline=Candidate.of(tp=8, tensor_parallel="megatron", remat="full", micro_batch=1),
            space=METP_SPACE,
            paper_note="METP above Megatron TP+SP in MFU; 2.38-2.99x the longest sequence (Sec. 5)",
        )
    )


def _predict(w, c, cluster):
    try:
        ev = evaluate(w, c, cluster)
    except ValueError as e:
        return {"plan": c.describe(), "refused": " ".join(str(e).split())}
    out = plan_json(ev, w, cluster)
    out["fits"] = ev.fits
    return out


def _search(w, cluster, **kw):
    try:
        result = search(w, cluster, **kw)
    except NoPlanError as e:
        return None, {"none": str(e)}
    return result, plan_json(result.best, w, cluster)


def run_setting(s, compile_check: bool):
    w = Workload.of(s["model"], s["preset"], seq_len=s["seq"], global_batch=1, precision="bf16")
    cluster = Cluster.of(s["device"], s["devices"], devices_per_node=s["per_node"], inter_bw=s["inter_bw"])
    t = time.time()
    result, top = _search(w, cluster)
    _, in_space = _search(w, cluster, only=s["space"])
    row = {
        "paper": s["paper"],
        "setting": s["name"],
        "workload": w.describe(),
        "cluster": cluster.describe(),
        "planner": top,
        "planner_in_paper_space": in_space,
        "paper_best": _predict(w, s["paper_best"], cluster),
        "paper_baseline": _predict(w, s["baseline"], cluster),
        "paper_says": s["paper_note"],
        "search_s": round(time.time() - t, 1),
    }
    if compile_check and result is not None:
        target = GPU_TARGETS[s["device"]]
        t = time.time()
        try:
            row["planner"]["compiled_memory_bytes"] = compiled_peak(w, result.best.candidate, target=target)
            row["planner"]["compiled_for"] = target
        except Exception as e:
            row["planner"]["compile_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        row["compile_s"] = round(time.time() - t, 1)
    return row


def _line(row):
    def short(p):
        if "none" in p:
            return "nothing fits"
        if "refused" in p:
            return f"{p['plan']}: refused"
        mem = f"{p['memory_bytes']['total'] / 2**30:.0f} GiB" + ("" if p.get("fits", True) else " (does not fit)")
        comp = p.get("compiled_memory_bytes")
        mem += f", compiled {comp / 2**30:.0f}" if comp else ""
        return f"{p['plan']}: {p['step_s']:.3g} s, {mem}"

    return (
        f"{row['setting']}\n  planner       {short(row['planner'])}\n  in paper space {short(row['planner_in_paper_space'])}"
        f"\n  paper best    {short(row['paper_best'])}\n  paper base    {short(row['paper_baseline'])}"
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile-check", action="store_true", help="compile each top plan for its GPU target")
    ap.add_argument("--only", help="settings whose name contains this text")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "planner.json"))
    args = ap.parse_args(argv)
    if args.compile_check:
        ok, why = gpu_target_available()
        if not ok:
            sys.exit(f"--compile-check: {why}")
    import jax

    record = benchmark_record(
        "planner",
        jax.devices(),
        {
            "compile_check": args.compile_check,
            "efficiency": 0.5,
            "memory_fraction": 0.9,
            "precision": "bf16",
            "global_batch": 1,
            "note": "predictions of jaxring/planner/cost_model.py; compiled memory (when present) from the deviceless "
            "GPU compile of the same train step",
        },
    )
    if args.compile_check:
        from importlib.metadata import version

        record["jax_cuda12_plugin"] = version("jax-cuda12-plugin")
    for s in SETTINGS:
        if args.only and args.only not in s["name"]:
            continue
        row = run_setting(s, args.compile_check)
        print(_line(row), flush=True)
        record["results"].append(row)
        save_record(record, args.out)
    print(f"wrote {args.out} ({len(record['results'])} settings)")


if __name__ == "__main__":
    main()
