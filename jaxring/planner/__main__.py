"""python -m jaxring.planner: the best mesh and strategies for a model, a sequence length and a cluster.

    python -m jaxring.planner --model gpt --preset 7b --seq-len 131072 --global-batch-tokens 4M \\
        --devices 64 --device h200 [--devices-per-node 8 --intra-bw 450 --inter-bw 50] [--top 10] [--json]
    python -m jaxring.planner --model dit --preset dit-1b --seq-len 131072 --global-batch 1 --devices 32 \\
        --device a100-40gb --inter-bw 1.5625 --only sp=32              # WallFacer's own search (C, placement)
    python -m jaxring.planner ... --only attention=usp --only ulysses-size=4    # settings held, train.py's names
    python -m jaxring.planner ... --compile-check 3     # top 3 compiled for the GPU target: predicted vs compiled

Prints the ranked plans (degrees, ZeRO stage, pipeline schedule and micro-batches, tensor method, sequence
strategy and options, micro-batch), their predicted step time (compute at --efficiency of peak, exposed
communication, pipeline bubble), predicted memory per device, and why the other candidates were rejected.
Bandwidths are GB/s per device and direction. Sizes take K, M, G suffixes (2^10, 2^20, 2^30).
Exit codes: 0 plans printed; 2 bad flags or nothing fits (one line on stderr naming the tightest constraint).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

# the compile check builds the trainer's step (jaxring.aot, a layer above the planner): this command line is an
# application entry point, the one planner module that may import it
from jaxring.aot.memory_check import compile_check
from jaxring.planner.cluster import DEVICES, Cluster
from jaxring.planner.search import search
from jaxring.planner.space import Workload
from jaxring.run.task import model_family

EXIT_USER_ERROR = 2


def _size(text: str) -> int:
    """'4M' -> 4·2^20; plain integers as they are."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    t = text.strip().upper()
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (an integer, optionally with K, M or G)") from None


def _held(text: str):
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--only {text!r}: expected FIELD=VALUE, e.g. sp=64 or attention=ring")
    key, value = text.split("=", 1)
    key = key.strip().replace("-", "_")
    value = value.strip()
    if value.lstrip("-").isdigit():
        return key, int(value)
    return key, None if value.lower() == "none" else value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(EXIT_USER_ERROR, f"error: {message} (see python -m jaxring.planner --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m jaxring.planner", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("workload")
    g.add_argument("--model", default="gpt", help="a model family (gpt, dit, or one an installed package declares)")
    g.add_argument("--preset", default="7b", help="gpt: tiny, 1b, 7b, mixtral, ...; dit: tiny, dit-s, dit-1b")
    g.add_argument(
        "--seq-len",
        type=_size,
        help="tokens per sequence (DiT: the nearest square grid, side a multiple of 8, unless --image-size)",
    )
    g.add_argument("--image-size", type=int, help="DiT: image (latent) side in pixels")
    b = g.add_mutually_exclusive_group()
    b.add_argument("--global-batch-tokens", type=_size, help="tokens per step (whole sequences, at least one)")
    b.add_argument("--global-batch", type=int, help="sequences (images) per step")
    g.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    g.add_argument(
        "--documents",
        action="store_true",
        help="the batches are packed documents, as train.py's GPT from a document store: their segment ids are "
        "priced where the strategy moves them",
    )
    g.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="change a preset field, e.g. --override num_layers=16 (repeatable)",
    )
    g = p.add_argument_group("cluster")
    g.add_argument("--devices", type=int, required=True)
    g.add_argument("--device", choices=tuple(DEVICES), default="h200")
    g.add_argument("--devices-per-node", type=int, help="default: 8 (or --devices if fewer)")
    g.add_argument("--intra-bw", type=float, help="GB/s per device within a node (default: the device's NVLink)")
    g.add_argument(
        "--inter-bw",
        type=float,
        help="GB/s per device across nodes (default: one NIC per GPU, 50 for H100/H200, 25 for A100)",
    )
    g.add_argument("--efficiency", type=float, default=0.5, help="fraction of dense bf16 peak the FLOPs run at")
    g.add_argument("--memory-fraction", type=float, default=0.9, help="fraction of device memory a plan may use")
    g = p.add_argument_group("search and output")
    g.add_argument(
        "--only",
        action="append",
        default=[],
        type=_held,
        metavar="FIELD=VALUE",
        help="hold a setting fixed, by train.py's names, e.g. --only sp=64 --only attention=wallfacer "
        "--only team-size=4 --only tensor-parallel=megatron (repeatable)",
    )
    g.add_argument("--top", type=int, default=10, help="plans to show")
    g.add_argument("--json", action="store_true", help="print the result as JSON")
    g.add_argument(
        "--compile-check",
        type=int,
        default=0,
        metavar="K",
        help="compile the top K plans' train steps for the device (deviceless GPU target, needs the "
        "gpu-compile extra; simulated CPU devices for --device cpu) and show compiled memory",
    )
    g.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # the planner runs nothing on a device; a compile check for a GPU target needs the CPU platform
    if args.device != "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    elif args.compile_check:
        os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
    try:
        return run(args)
    except ValueError as e:
        if args.debug:
            raise
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_USER_ERROR


def run(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise ValueError(f"--top {args.top} must be a positive integer")
    family = model_family(args.model)
    overrides = dict(family.parse_override(item) for item in args.override)
    w = Workload.of(
        args.model,
        args.preset,
        seq_len=args.seq_len,
        image_size=args.image_size,
        global_batch_tokens=args.global_batch_tokens,
        global_batch=args.global_batch,
        precision=args.precision,
        documents=args.documents,
        **overrides,
    )
    gb = 1e9
    cluster = Cluster.of(
        args.device,
        args.devices,
        devices_per_node=args.devices_per_node,
        intra_bw=args.intra_bw * gb if args.intra_bw is not None else None,
        inter_bw=args.inter_bw * gb if args.inter_bw is not None else None,
        efficiency=args.efficiency,
        memory_fraction=args.memory_fraction,
    )
    result = search(w, cluster, only=dict(args.only))
    note = compile_check(result, args.device, args.compile_check) if args.compile_check else ""
    if args.json:
        out = result.to_json(top=args.top)
        if note:
            out["note"] = note
        print(json.dumps(out, indent=1))
        return 0
    best = result.best
    print(f"workload: {w.describe()}")
    print(f"cluster:  {cluster.describe()}")
    print(
        f"{result.considered:,} plans considered, {len(result.ranked):,} fit; the best {min(args.top, len(result.ranked))} "
        f"by predicted step time:\n"
    )
    print(result.table(top=args.top))
    print(
        f"\nbest: python train.py --model {w.model} --preset {w.preset} "
        + " ".join(best.candidate.train_flags())
        + (f" --grad-accum {best.candidate.steps(w)}" if best.candidate.pp == 1 and best.candidate.steps(w) > 1 else "")
        + f" --batch-size {w.global_batch}"
        + (f" --image-size {w.image_size}" if w.image_size else f" --seq-len {w.seq_len}")
        + f" --precision {w.precision}"
    )
    bytes_axes = ", ".join(
        f"{'×'.join(k)} {v / 2**30:.2f} GiB" for k, v in sorted(best.bytes_by_axes().items(), key=lambda kv: -kv[1])
    )
    print(f"      moves per device per step: {bytes_axes or 'nothing'}")
    mem = best.memory
    forward = f", forward {mem.forward / 2**30:.1f}" if mem.forward else ""
    print(
        f"      memory per device: weights {mem.params / 2**30:.1f} + Adam {mem.optimizer / 2**30:.1f} + "
        f"max(backward: activations {mem.activations / 2**30:.1f} + max(gradients {mem.gradients / 2**30:.1f} + "
        f"working {mem.working / 2**30:.1f}, head {mem.head / 2**30:.1f}{forward}), update {mem.update / 2**30:.1f}) GiB"
    )
    print()
    print(result.rejections())
    if note:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
