"""benchmarks/longest_sequence.py without a GPU: the estimate bisection, the at-most-three-compiles
confirmation, and the row / JSON / resume plumbing on the tiny preset with the compile stubbed."""

import importlib.util
import json
import sys

import pytest
from helpers import ROOT

PATH = ROOT / "benchmarks" / "longest_sequence.py"
spec = importlib.util.spec_from_file_location("longest_sequence", PATH)
ls = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = ls  # dataclasses look their module up
spec.loader.exec_module(ls)


@pytest.mark.parametrize("limit", [0, 5, 1024, 1025, 4096, 70000, 2**20 - 1])
def test_longest_fitting_is_the_longest_multiple_of_the_unit_that_fits(limit):
    asked = []

    def fits(seq):
        asked.append(seq)
        return seq <= limit

    unit = 1024
    assert ls.longest_fitting(fits, unit) == limit // unit * unit
    assert len(asked) <= 2 * 12  # doubling then bisection: logarithmic


def test_longest_fitting_stops_at_the_ceiling():
    assert ls.longest_fitting(lambda s: True, 1024, ceiling=8192) == 8192


# the estimate's length, in units; the longest found; whether the next unit up was compiled
@pytest.mark.parametrize(
    "start, longest, bracketed",
    [(40, 45, False), (48, 50, False), (50, 50, True), (52, 50, True), (60, 50, False), (99, 50, False)],
)
def test_confirm_finds_the_compiled_boundary_in_at_most_three_compiles(start, longest, bracketed):
    unit, budget = 1000, 50_500.0  # compiled bytes = seq (affine): the boundary is 50,000 tokens
    compiles = []

    def fits(seq):
        compiles.append(seq)
        return seq <= budget

    assert ls.confirm(start * unit, unit, fits, lambda s: float(s), budget) == (longest * unit, bracketed)
    assert len(compiles) <= 3 and len(compiles) == len(set(compiles))
    assert bracketed == (51_000 in compiles)  # the next unit up compiled and did not fit


def test_confirm_when_nothing_fits():
    compiles = []
    never = lambda s: compiles.append(s) or False
    assert ls.confirm(2000, 1000, never, lambda s: 1e12 + s, 10.0) == (0, True)
    compiles.clear()
    assert ls.confirm(9000, 1000, never, lambda s: 1e12 + s, 10.0) == (0, False)
    assert compiles == [9000, 8000, 6000, 4000]  # then 2 and 4 units below the lowest (8 below is < 1 unit)


def test_confirm_steps_down_when_compiled_bytes_are_not_monotone():
    """Near the device's limit a shorter length can compile larger (XLA): when none of the three compiles fits,
    confirm steps down 2, 4, 8 ... units below the lowest until one does."""
    compiled = {64: 120.9, 63: 119.6, 61: 127.3, 59: 121.0, 57: 117.0}  # GiB by thousands of tokens
    compiles = []
    gib = lambda s: compiled.get(s // 1000, 200.0)
    fits = lambda s: compiles.append(s // 1000) or gib(s) <= 118.2
    assert ls.confirm(64_000, 1000, fits, gib, 118.2) == (57_000, False)
    assert compiles == [64, 63, 61, 59, 57]  # the three (the affine guess: 61), then 2 and 4 units below


def tiny(row, seq):
    return ls.estimate_bytes(row, seq, preset="tiny")


def stub_compile(row, seq):
    """A compile whose bytes are the estimate's plus 5%."""
    est = tiny(row, seq)[0]
    return {
        "seq": seq,
        "plan": row.plan,
        "estimate_gib": est / ls.GIB,
        "compiled_gib": 1.05 * est / ls.GIB,
        "estimate_over_compiled": 1 / 1.05,
        "compile_s": 0.0,
        "step_s": 1e-3 * seq,
        "tokens_per_s_per_gpu": 1000 / row.devices,
        "roofline": {"time_s": 1e-3 * seq},
    }


def test_rows_are_measured_recorded_and_skipped_on_a_rerun(tmp_path):
    rows = ls.selected(ls.all_rows(("h100x8",)), ["ring zigzag sp8: none", "megatron tp8: none"])
    assert [r.key for r in rows] == ["h100x8 | ring zigzag sp8 | none", "h100x8 | megatron tp8 | none"]
    unit = 1024
    budget = 1.05 * tiny(rows[0], 6 * unit)[0]  # ring's compiled bytes at 6 units: its longest is 6 units
    compiled = []

    def counting(row, seq):
        compiled.append((row.key, seq))
        return stub_compile(row, seq)

    out = tmp_path / "r.json"
    record = {"benchmark": "longest_sequence", "results": []}
    ls.run(rows, record, str(out), estimate=tiny, compile_one=counting, budget=budget, unit=unit, log=lambda s: None)
    saved = json.loads(out.read_text())
    ring = {r["key"]: r for r in saved["results"]}["h100x8 | ring zigzag sp8 | none"]
    assert ring["estimate_longest"] >= 6 * unit  # the estimate (5% under the compile) is optimistic
    assert ring["longest"] == 6 * unit and ring["bracketed"]
    assert len(ring["probes"]) <= 3 and all(p["compiled_gib"] > p["estimate_gib"] for p in ring["probes"])
    assert ring["tokens_per_s_per_gpu"] == 125 and ring["settings"]["sp"] == 8
    first = len(compiled)
    assert 2 <= first <= 6
    ls.run(rows, saved, str(out), estimate=tiny, compile_one=counting, budget=budget, unit=unit, log=lambda s: None)
    assert len(compiled) == first  # a rerun skips the recorded rows
    text = ls.table(saved)
    assert "| ring zigzag sp8 | none | 6,144 |" in text
    ls.plot(saved, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0


def test_a_tpu_row_has_no_roofline_and_keeps_the_longest_by_xlas_peak(tmp_path):
    """A TPU slice's probes carry no roofline and XLA:TPU's own peak beside the allocated bytes: the row is
    recorded, with the longest length whose peak fits as well as the longest whose allocated bytes do."""
    row, unit = ls.Row("v6e-8", "auto", "none"), 1024

    def estimate(row, seq):
        return seq / (6 * unit) * ls.GIB, {}, 0.0

    def compile_one(row, seq):
        gib = 1.2 * seq / (6 * unit)  # allocated: 20% over the estimate; XLA's peak: the estimate's
        return {
            "seq": seq,
            "plan": "tp=8, tensor=metp",
            "estimate_gib": gib / 1.2,
            "compiled_gib": gib,
            "estimate_over_compiled": 1 / 1.2,
            "xla_peak_gib": gib / 1.2,
            "host_gib": 0.0,
            "compile_s": 0.0,
            "step_s": None,
            "tokens_per_s_per_gpu": None,
        }

    r = ls.measure_row(row, estimate=estimate, compile_one=compile_one, budget=ls.GIB, unit=unit, log=lambda s: None)
    assert "error" not in r and r["roofline"] is None and r["plan_at_longest"] == "tp=8, tensor=metp"
    assert r["longest"] == 5 * unit and r["longest_by_xla_peak"] == 6 * unit
    assert "| v6e-8 | none | tp=8, tensor=metp | 5,120 | 6,144 (≥) |" in ls.table({"results": [r]})
    ls.plot({"results": [r]}, str(tmp_path / "p.png"))  # no GPU target: nothing to draw, no error


def test_a_plan_that_cannot_run_is_recorded_as_refused():
    row = ls.Row("h100x8", "ulysses sp8", "none")

    def refuse(row, seq):
        raise ValueError(f"seq {seq} is no good")

    r = ls.measure_row(row, estimate=refuse, compile_one=stub_compile, budget=1e9, unit=1024, log=lambda s: None)
    assert r["error"].startswith("seq 1024 is no good") and "longest" not in r


def test_no_plan_from_the_planner_is_the_bound_of_plan_auto():
    """--plan auto at a length the planner finds no plan for does not fit: the row is bracketed there."""
    row, unit = ls.Row("h100x8", "auto", "none"), 1024

    def estimate(row, seq):
        return (1.0 if seq <= 5 * unit else 1e12), {}

    def compile_one(row, seq):
        if seq > 5 * unit:
            raise ls.NoPlan(f"the planner finds no plan for {seq} tokens")
        return {**stub_compile(ls.Row("h100x8", "ring zigzag sp8", "none"), seq), "compiled_gib": 0.5}

    r = ls.measure_row(row, estimate=estimate, compile_one=compile_one, budget=ls.GIB, unit=unit, log=lambda s: None)
    assert (r["longest"], r["bracketed"]) == (5 * unit, True) and "error" not in r
    assert r["probes"][-1]["refused"].startswith("the planner finds no plan")
    assert "| auto (ring zigzag sp8) | none | 5,120 |" in ls.table({"results": [r]})


def test_the_planners_no_plan_error_becomes_no_plan():
    with pytest.raises(ls.NoPlan, match="no plan fits"):
        ls.compile_probe(ls.Row("h100x8", "auto", "none"), 2**28)
