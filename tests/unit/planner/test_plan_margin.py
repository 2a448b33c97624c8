"""--plan auto at the margin: when no plan fits by the planner's estimate, the plans estimated within 10% above
the budget are compiled, least first, and the first whose compiled bytes fit is taken (`margin_search`,
`jaxring.aot.margin`; `--compile-for`'s side is in test_weight_offload)."""

from __future__ import annotations

import pytest

from jaxring.aot import margin
from jaxring.planner.auto import held_settings
from jaxring.planner.cluster import Cluster
from jaxring.planner.fit import candidate_of, workload_of
from jaxring.planner.search import ESTIMATE_MARGIN, NoPlanError, margin_search, search
from jaxring.run.spec import RunSpec

# UPipe's head chunks held off: at 8,650,752 tokens nothing fits by the estimate (head chunks of 4 do), and three
# plans are estimated within 10% above the budget
SPEC = RunSpec.of(preset="llama3-8b", seq_len=8650752, batch_size=1, plan="auto", head_chunks=1)
HELD = held_settings(SPEC)
H100X8 = Cluster.of("h100", 8, host_memory=256 * 2**30)


def test_margin_search_holds_the_plans_estimated_just_above_the_budget():
    """Llama-3-8B at 8,650,752 tokens on 8 × H100, no head chunks: nothing fits by the estimate; the
    margin's plans are each estimated within 10% above the usable memory and within the host's, least first."""
    w = workload_of(SPEC)
    assert HELD == {"head_chunks": 1}
    with pytest.raises(NoPlanError, match="no plan fits in memory"):
        search(w, H100X8, only=HELD)
    result = margin_search(w, H100X8, only=HELD)
    totals = [ev.memory.total for ev in result.ranked]
    assert totals and totals == sorted(totals)
    usable = H100X8.usable_memory
    assert all(usable < t <= ESTIMATE_MARGIN * usable for t in totals), [t / 2**30 for t in totals]
    assert all(ev.memory.host <= H100X8.host_memory for ev in result.ranked)
    assert result.cluster == H100X8


@pytest.mark.parametrize("fitting", [0, 1, None])
def test_the_first_plan_whose_compiled_bytes_fit_is_run(monkeypatch, fitting):
    """The plans are compiled in the margin's order until one fits the usable memory; when none does, the
    search's own one-line refusal stands."""
    monkeypatch.setattr(margin, "cluster_of", lambda devices: H100X8)
    ranked = margin_search(workload_of(SPEC), H100X8, only=HELD).ranked
    compiled = []

    def peak(w, candidate, devices):
        compiled.append(candidate)
        over = len(compiled) - 1 != fitting
        return H100X8.usable_memory * (1.01 if over else 0.99)

    refused = NoPlanError("no plan fits in memory for ...")
    devices = [object()] * 8
    if fitting is None:
        with pytest.raises(NoPlanError) as caught:
            margin.apply_auto_plan_at_the_margin(SPEC, devices, refused, log=lambda _: None, peak=peak)
        assert caught.value is refused and len(compiled) == min(margin.TRIES, len(ranked))
        return
    spec = margin.apply_auto_plan_at_the_margin(SPEC, devices, refused, log=lambda _: None, peak=peak)
    chosen = ranked[fitting].candidate
    assert compiled == [ev.candidate for ev in ranked[: fitting + 1]]
    assert spec.parallel.plan == "manual"
    assert candidate_of(spec.resolved(8)).describe() == chosen.describe()
