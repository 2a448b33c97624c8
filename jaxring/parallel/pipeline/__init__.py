"""Pipeline parallelism inside one shard_map: schedules as tables (gpipe, 1f1b, interleaved, zero-bubble), a
simulator driven by the same tables, and the interpreter that runs them over the `pp` mesh axis.

    schedule = make_schedule("1f1b", num_stages=4, num_microbatches=8)
    print(schedule.chart()); simulate(schedule).bubble           # 3/8
    # inside the caller's shard_map:
    loss, aux, d_stage, d_shared = pipeline_loss_and_grads(schedule, embed_fn=..., stage_fn=..., loss_fn=...,
                                                           stage_params=..., shared_params=..., microbatches=...)
"""

from jaxring.parallel.pipeline.interpreter import pipeline_loss_and_grads
from jaxring.parallel.pipeline.lowering import lower
from jaxring.parallel.pipeline.schedules import Schedule, make_schedule
from jaxring.parallel.pipeline.simulate import bubble_fraction, peak_in_flight, plot_schedule, simulate

__all__ = [
    "Schedule",
    "bubble_fraction",
    "lower",
    "make_schedule",
    "peak_in_flight",
    "pipeline_loss_and_grads",
    "plot_schedule",
    "simulate",
]
