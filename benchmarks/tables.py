"""The tables of recorded figures in docs/*.md, rendered from the benchmark results (benchmarks/results/*.json).

    python benchmarks/tables.py            # rewrite every generated region of docs/*.md from the results
    python benchmarks/tables.py --check    # exit 1, naming each region that differs from what the results render

A generated region is the text between `<!-- generated: NAME -->` and `<!-- end generated -->`; NAME is one of
TABLES. Everything outside the regions is left as it is. tests/unit/analysis/test_tables.py checks that the committed pages
equal what this renders, so a figure in the docs cannot drift from its record.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import re
import sys
from collections.abc import Callable

from jaxring.planner import cost_model
from jaxring.planner.params import param_leaves

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
DOCS = HERE.parent / "docs"
REGION = re.compile(r"(<!-- generated: ([\w.-]+) -->\n)(.*?)(<!-- end generated -->)", flags=re.S)


def _longest_sequence():
    """benchmarks/longest_sequence.py (its table is the record's own report)."""
    spec = importlib.util.spec_from_file_location("longest_sequence", HERE / "longest_sequence.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("longest_sequence", module)  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _record(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def longest_sequence_table(result_file: str) -> Callable[[], str]:
    """The longest-sequence table (`longest_sequence.py --report`'s) of one result file."""
    return lambda: _longest_sequence().table(_record(result_file))


def llama3_8b_8m_table() -> str:
    """Llama-3-8B at 8,388,608 tokens on 8 x H100: each plan's compiled device GiB (estimate) and host GiB."""
    record = _record("llama3_8b_8m.json")
    lines = [
        "| plan at 8,388,608 tokens (Llama-3-8B, 8 × H100) | device GiB (estimate) | host GiB |",
        "|---|---:|---:|",
    ]
    for r in record["results"]:
        lines.append(f"| {r['plan']} | {r['compiled_gib']:.1f} ({r['estimate_gib']:.1f}) | {r['host_gib']:.1f} |")
    return "\n".join(lines)


def memory_techniques_tpu_table() -> str:
    """GPT-7B on a deviceless v5p-16 (memory_techniques_tpu.json): compiled and XLA:TPU's peak GiB per device, and
    the estimate priced with today's calibration (benchmarks/memory_model.py's `technique_rows`)."""
    spec = importlib.util.spec_from_file_location("memory_model", HERE / "memory_model.py")
    memory_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory_model)
    lines = [
        "| tokens | technique | compiled (arg + out + temp - alias) | XLA:TPU's peak | estimate | estimate / compiled "
        "| estimate / XLA's peak |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    gib = 2**30
    for r, w, c, compiled in memory_model.technique_rows(str(RESULTS / "memory_techniques_tpu.json")):
        estimate = cost_model.memory(w, c, param_leaves(w.model, w.config, c.check(w))).total / gib
        xla = r["xla_peak_gib"]
        lines.append(
            f"| {r['seq']:,} | {r['technique']} | {compiled / gib:.2f} | {xla:.2f} | {estimate:.2f} | "
            f"{estimate / (compiled / gib):.2f} | {estimate / xla:.2f} |"
        )
    return "\n".join(lines)


# region name -> its renderer (each reads one result file)
TABLES: dict[str, Callable[[], str]] = {
    "longest-sequence-gpu": longest_sequence_table("longest_sequence.json"),
    "longest-sequence-jax0.12": longest_sequence_table("longest_sequence_jax0.12.json"),
    "longest-sequence-tpu": longest_sequence_table("longest_sequence_tpu.json"),
    "llama3-8b-8m": llama3_8b_8m_table,
    "memory-techniques-tpu": memory_techniques_tpu_table,
}


def rendered(text: str, where: str = "text") -> str:
    """`text` with every generated region's body replaced by its table (blank line, table, blank line)."""

    def body(match: re.Match) -> str:
        name = match.group(2)
        if name not in TABLES:
            raise ValueError(f"{where}: generated region {name!r} is not one of {sorted(TABLES)}")
        return f"{match.group(1)}\n{TABLES[name]().strip()}\n\n{match.group(4)}"

    return REGION.sub(body, text)


def stale_regions(text: str, where: str = "text") -> list[str]:
    """The names of the regions of `text` whose body differs from what the results render."""
    fresh = {m.group(2): m.group(3) for m in REGION.finditer(rendered(text, where))}
    return [m.group(2) for m in REGION.finditer(text) if m.group(3) != fresh[m.group(2)]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 if a region is out of date")
    args = parser.parse_args(argv)
    stale = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        where = str(page.relative_to(HERE.parent))
        names = stale_regions(text, where)
        stale += [f"{where}: {name}" for name in names]
        if names and not args.check:
            page.write_text(rendered(text, where))
    if args.check and stale:
        print(f"out of date (python benchmarks/tables.py rewrites them): {', '.join(stale)}", file=sys.stderr)
        return 1
    print("up to date" if args.check else f"rewrote: {', '.join(stale) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
