"""The bytes live at each point of a compiled XLA:CPU program, and the arrays live at its peak, from its dump.

Reads the buffer assignment (every value's allocation, offset and size) and the live ranges (each value's
first and last position in the flattened schedule) that `--xla_dump_to` writes, and counts, at each position,
the distinct allocation slices whose values are live. Its maximum matches the compiled step's
argument + output + temp - alias bytes (GPT of benchmarks/memory_model.py, fp32: megatron tp2 x ring sp4
full 12.68 MiB against 12.70 compiled, allgather sp8 46.49 against 46.63, wallfacer sp8 c2 40.66 against
40.68, ring sp8 full 23.87 against 23.88, dp8 zero2 accumulation 28.34 against 28.34), where the dump's own
"Live ranges at N (peak)" total is lower (11.00, 39.79, 35.02, 20.33, 24.52 MiB: benchmarks/memory_model.py's
--live-peak), so that compiled minus that total is not packing: the arrays counted here fill the allocation.
Positions are split into the forward (op names under jvp), the backward (under transpose) and the rest (the
YNNPACK matmul fusions carry no op name); a tuple-shaped value is one element of a loop-carried tuple.

    XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_module_re=jit_step" python benchmarks/memory_model.py --only NAME
    python tools/xla_live_bytes.py DIR [--phase backward] [--top 40]
"""

from __future__ import annotations

import argparse
import glob
import os
import re

MIB = 2**20


def _one(directory: str, suffix: str) -> str:
    files = sorted(glob.glob(os.path.join(directory, f"*jit_step*{suffix}")))
    if not files:
        raise SystemExit(f"no *jit_step*{suffix} in {directory}: dump with --xla_dump_to={directory}")
    with open(files[-1]) as f:  # the train step compiled last
        return f.read()


def read_dump(directory: str) -> tuple[dict, list, dict, dict]:
    """({value: (allocation, offset, size)}, [(value, first, last)], {position: instruction},
    {instruction: (shape, op_name)}) of the train step's dump in `directory`."""
    slices, allocation = {}, None
    for line in _one(directory, "buffer-assignment.txt").splitlines():
        a = re.match(r"allocation (\d+):", line)
        if a:
            allocation = int(a[1])
            continue
        v = re.match(r" value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)", line)
        if v:
            name = v[1] if "{" in v[1] else v[1] + "{}"
            slices[name] = (allocation, int(v[3]), int(v[2]))
    schedule, rest = _one(directory, "live-range.txt").split("BufferLiveRange:")
    order = {int(p): n for p, n in re.findall(r"^    (\d+):(\S+)$", schedule, re.M)}
    ranges = [(m[1], int(m[2]), int(m[3])) for m in re.finditer(r"^    (\S+\{[\d,]*\}):(\d+)-(\d+)$", rest, re.M)]
    hlo = _one(directory, "cpu_after_optimizations.txt")
    ops = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%(\S+) = (\S+) (.*)$", hlo, re.M):
        op_name = re.search(r'op_name="([^"]*)"', m[3])
        ops[m[1]] = (m[2], op_name[1] if op_name else "")
    return slices, ranges, order, ops


def phase(op_name: str) -> str:
    return "backward" if "transpose(" in op_name else "forward" if "jvp(" in op_name else "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dump_dir")
    parser.add_argument("--phase", default=None, help="list the arrays at this phase's peak (default: the peak)")
    parser.add_argument("--top", type=int, default=40, help="arrays to list")
    args = parser.parse_args()
    slices, ranges, order, ops = read_dump(args.dump_dir)
    end = max(last for _, _, last in ranges) + 1
    live: list[set] = [set() for _ in range(end)]
    for name, first, last in ranges:
        if name in slices:
            for t in range(first, last + 1):
                live[t].add(slices[name])
    total = [sum(size for _, _, size in s) for s in live]
    peaks: dict[str, int] = {}
    for t in range(end):
        p = phase(ops.get(order.get(t, ""), ("", ""))[1])
        if total[t] > total[peaks.get(p, t)] or p not in peaks:
            peaks[p] = t
    for p, t in sorted(peaks.items(), key=lambda kv: -total[kv[1]]):
        print(f"{p:8s} peak {total[t] / MIB:9.3f} MiB at {t} ({order.get(t)})")
    t = peaks[args.phase] if args.phase else max(range(end), key=total.__getitem__)
    held = {}
    for name, first, last in ranges:
        if first <= t <= last and name in slices:
            held.setdefault(slices[name], name)  # one name per allocation slice
    print(f"arrays live at {t} ({order.get(t)}), largest first:")
    for (_, _, size), name in sorted(held.items(), key=lambda kv: -kv[0][2])[: args.top]:
        shape, op = ops.get(name.split("{")[0], ("", ""))
        print(f"  {size / MIB:8.3f} MiB  {name:40s} {shape:28s} {op[-90:]}")


if __name__ == "__main__":
    main()
