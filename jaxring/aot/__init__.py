"""A run's train step compiled for a target without running it (ahead of time): the trainer's `TrainStep` on
abstract inputs (`train_step`), the planner's memory prediction checked against it (`memory_check`, behind
`python -m jaxring.planner --compile-check`), and `train.py --compile-for TARGET` (`compile_for`: will the run
fit on a GPU machine, compiled here with no GPU)."""

from jaxring.aot.train_step import build_train_step, compile_train_step, lower_train_step

__all__ = ["build_train_step", "compile_train_step", "lower_train_step"]
