"""What a train step optimizes: a model's objective in three local parts, so a pipeline can cut it.

An objective (e.g. `models.gpt.NextTokenObjective`, `models.dit.FlowMatchingObjective`) gives, on this
device's shards inside the step's shard_map:

  embed(model, mb, plan, dtype) -> carry          the first stage: tokens/patches to the residual stream
  layer(block, carry, mb, plan) -> carry          one block of the stack (the carry keeps its shapes)
  head(model, carry, mb, plan, dtype) -> (loss_sum, aux)
                                                  the last stage: this device's sum of per-element losses;
                                                  aux: fp32 scalars already over the whole micro-batch (the
                                                  same on every device), "extra_loss" (e.g. MoE balance) a
                                                  term of the objective, the others metrics
  prepare(batch, key) -> inputs, input_specs(plan), loss_count

The train step composes them over a whole `Layers` stack; the pipeline (`jaxring.pipeline`) runs embed on its
first virtual stage, chunks of the stack on every stage and head on the last.
"""

from __future__ import annotations


class Objective:
    def prepare(self, batch, key):
        """The step's inputs from a batch (global arrays, outside the shard_map); default: the batch itself."""
        del key
        return batch

    def input_specs(self, plan) -> dict:
        raise NotImplementedError

    @property
    def loss_count(self) -> int:
        raise NotImplementedError

    def embed(self, model, mb, plan, dtype):
        raise NotImplementedError

    def layer(self, block, carry, mb, plan):
        raise NotImplementedError

    def head(self, model, carry, mb, plan, dtype):
        raise NotImplementedError
