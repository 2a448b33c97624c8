"""`--vocab-split ring`: the embedding and LM head split by vocab rows over the axes that split the sequence,
their blocks on a ring (`vocab_ring.py`), for a tensor method that takes it (`VocabSplit`):

  METP                     over tp (its sequence axis)
  no tensor parallelism    over the sequence strategy's axes (sp: ring, Ulysses, USP, ...)

Rank r of the ring keeps vocab rows [r·V/p, (r+1)·V/p) of the table [V, h] (the same columns of the head
[h, V]), as stored and as the step reads them: no device holds a whole table, its gradient or a row of
logits. With "none" (the default) both stay replicated over those axes (ZeRO may shard their state).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxring.core.mesh import spec_entry
from jaxring.parallel.cost_terms import F32, ModelShape, Transfer
from jaxring.parallel.registry import Option
from jaxring.parallel.tensor.splits import check_divisible
from jaxring.parallel.tensor.vocab_ring import ring_cross_entropy, ring_embed, ring_loss_tiles

if TYPE_CHECKING:
    from jaxring.parallel.plan import ParallelPlan

VOCAB_SPLITS = ("none", "ring")


def check_vocab_split(value: str, degree: int) -> None:
    """Raises (one line) unless `value` is one of VOCAB_SPLITS (degree: the registry's, unused)."""
    del degree
    if value not in VOCAB_SPLITS:
        raise ValueError(f"--vocab-split {value!r} must be one of {', '.join(VOCAB_SPLITS)}")


VOCAB_SPLIT = Option(
    "vocab_split",
    "ring: the embedding and LM head split by vocab rows over the axes that split the sequence (tp under METP, "
    "sp under a sequence strategy), their blocks on a ring; none: replicated",
    check_vocab_split,
    default="none",
    type=str,
    choices=VOCAB_SPLITS,
    search=lambda degree: VOCAB_SPLITS,
)


def vocab_ring_transfers(m: ModelShape, p: int, axes: tuple[str, ...]) -> list[Transfer]:
    """`vocab_ring.py`'s bytes over a ring of p on `axes` (its module docstring): v = V·h/p a block; the
    embedding (p-1)·v forward and (p-1)·v fp32 backward, the head (p-1)·v forward, (p-1)·v and p·v fp32
    backward (a tied table: both)."""
    v = m.vocab * m.hidden // p
    return [
        Transfer(
            "vocab ring: embedding blocks forward, fp32 gradients backward",
            axes,
            (p - 1) * v * (m.e + F32),
            2 * (p - 1),
        ),
        Transfer(
            "vocab ring: head blocks forward and backward, fp32 gradients backward",
            axes,
            2 * (p - 1) * v * m.e + p * v * F32,
            3 * p - 2,
        ),
    ]


class VocabSplit:
    """The vocabulary split of a `TensorMethod` (a mixin before it in the bases): with the plan's option
    vocab_split "ring", `embed` and `cross_entropy` run the vocab ring over `vocab_axes(plan)`, whose mesh
    entry `vocab_axis` splits the tables' vocab dim; otherwise the method's own layers run."""

    options = (VOCAB_SPLIT,)

    def vocab_axes(self, plan: ParallelPlan) -> tuple[str, ...]:
        """The run-mesh axes the ring runs over (those that split the sequence)."""
        raise NotImplementedError

    @staticmethod
    def vocab_ring(plan: ParallelPlan) -> bool:
        return plan.tensor_options.get("vocab_split") == "ring"

    def splits_vocab(self, plan: ParallelPlan) -> bool:
        return self.vocab_ring(plan)

    def check_whole_tables(self, plan: ParallelPlan, user: str) -> None:
        if self.vocab_ring(plan):
            raise ValueError(
                f"{user} reads the embedding and LM head whole: decode with a plan of --vocab-split none (the "
                "weights load into any plan)"
            )

    def vocab_axis(self, plan: ParallelPlan) -> str | tuple[str, ...] | None:
        """The PartitionSpec entry of a table's vocab dim (None: replicated)."""
        return spec_entry(self.vocab_axes(plan)) if self.vocab_ring(plan) else None

    def check_vocab(self, plan: ParallelPlan, vocab: int | None, degree: int, name: str) -> None:
        """The ring's rules: more than one rank (`degree`, named `name`), and it divides the vocabulary."""
        if vocab is None or not self.vocab_ring(plan):
            return
        if degree == 1:
            raise ValueError(f"--vocab-split ring splits the tables over {name}: it needs {name} > 1 (got 1)")
        why = f" (--vocab-split ring splits the table by vocab rows over {name})"
        check_divisible("vocab", vocab, degree, name, why)

    def embed(
        self,
        plan: ParallelPlan,
        tokens: jax.Array,
        table: jax.Array,
        positions: jax.Array | None = None,
        pos_table: jax.Array | None = None,
    ) -> jax.Array:
        if not self.vocab_ring(plan):
            return super().embed(plan, tokens, table, positions, pos_table)
        x = ring_embed(tokens, table, self.vocab_axes(plan))  # table: this rank's vocab rows [V/p, h]
        return x if pos_table is None else x + jnp.take(pos_table, positions, axis=0)

    def cross_entropy(
        self, plan: ParallelPlan, x: jax.Array, w: jax.Array, targets: jax.Array, *, tied: bool
    ) -> jax.Array:
        if not self.vocab_ring(plan):
            return super().cross_entropy(plan, x, w, targets, tied=tied)
        head = w.T if tied else w  # this rank's vocab columns [h, V/p]
        tiles = ring_loss_tiles(x.shape[1], plan.loss_tile, plan.loss_tiles(x))
        return ring_cross_entropy(x, head.astype(x.dtype), targets, self.vocab_axes(plan), tiles)

    def tiles_loss_itself(self, plan: ParallelPlan) -> bool:
        return self.vocab_ring(plan)  # the row tiles inside the ring (a block goes round once, not per tile)
