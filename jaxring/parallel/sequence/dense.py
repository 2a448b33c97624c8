""" "dense": no sequence parallelism. Every device attends its own whole sequences (flash attention, sp = 1);
the entry the plan and the planner use when nothing splits the sequence."""

from __future__ import annotations

from jaxring.kernels.window_work import layout_window_share
from jaxring.parallel.cost_terms import F32, AttentionCost, AttentionShape
from jaxring.parallel.registry import SequenceStrategy


def dense_cost(s: AttentionShape, options: dict) -> AttentionCost:
    """Flash attention on the device's whole sequences: nothing moves; kept out and lse (fp32); working the
    fp32 dQ, dK, dV. A sliding window: the kernel visits the band of tiles it reaches."""
    del options
    share = layout_window_share("contiguous", 1, s.n, s.window, s.cpu, s.d) if s.window else 1.0
    return AttentionCost(
        saved=s.q_bytes(F32) + s.rows_bytes(), working=2 * s.kv_bytes(F32) + s.q_bytes(F32), window_share=share
    )


STRATEGY = SequenceStrategy(
    "dense",
    "no sequence parallelism: every device attends its own whole sequences",
    default_layout="contiguous",
    layouts=("contiguous",),
    cost=dense_cost,
)
