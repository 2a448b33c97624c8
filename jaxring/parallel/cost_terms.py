"""The cost vocabulary: what a registry entry's cost model receives and what it returns.

Each sequence strategy prices itself next to its forward and backward (`cost=` in its `SequenceStrategy`
entry), each tensor method on its `TensorMethod` class, and pipeline schedules through their tables. The
planner (`jaxring.planner.cost_model`) builds the shapes below from a workload and a plan, asks the entries, and adds
what no entry owns (ZeRO, the pipeline's sends, experts, the step time). This module imports no strategy.

    def my_cost(shape: AttentionShape, options: dict) -> AttentionCost:
        kv = shape.b * shape.n * shape.kv_heads * shape.d
        return AttentionCost(
            transfers=(Transfer("K/V all-gather forward", tuple(shape.axes), (shape.sp - 1) * kv * shape.e, 1),),
            saved=shape.q_bytes(F32) + shape.rows_bytes(),      # out and lse, fp32
            working=2 * kv * F32 + shape.q_bytes(F32),          # dK, dV accumulators and dQ
        )

Units: bytes per device (what one device receives, as `jaxring.analysis.compiled` counts them), for one layer
and one micro-step (forward and backward) unless a docstring says otherwise. Activations travel with `e`
bytes per element (XLA:CPU widens bf16 collectives to 4) and are stored with `em`; gradients and the
accumulators the kernels keep are fp32 (F32 = 4).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

F32 = 4


@dataclasses.dataclass(frozen=True)
class FittedTerms:
    """A registry entry's fitted cost terms for the target priced, from the planner's calibration file (its
    entries named "<entry>.<term>", `jaxring.planner.calibration`): `shape.fitted["backward_extra_q_arrays"]`.
    The entry's cost model keeps the structure; the numbers fitted on recorded compiles live in the file."""

    entry: str = ""
    source: str = "no calibration"
    values: tuple = ()  # (term, value) pairs

    def __getitem__(self, term: str) -> float:
        for name, value in self.values:
            if name == term:
                return value
        raise ValueError(
            f"calibration {self.source} has no term '{self.entry}.{term}' (the {self.entry or 'entry'}'s cost model "
            f"reads it): add it to the file, or price the shape with the planner's calibration"
        )


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Bytes one device receives over the run-mesh axes `axes`, in `messages` sequential messages; `overlap`
    names the compute it hides behind ("attention": a ring loop's per-step transfer; "ffn": METP's weight
    ring), or None. An entry states it for one layer and one micro-step (phase "micro-step": once per
    micro-step, a layer-invariant move); the planner scales it. Axes of size 1 are dropped by the planner, so
    an entry may name every axis of its view."""

    what: str
    axes: tuple[str, ...]
    bytes: float
    messages: int = 1
    overlap: str | None = None
    # "layer": each layer and micro-step; "micro-step": once per micro-step (layer-invariant); "step": per update
    phase: str = "layer"


def segment_once(what: str, axes: tuple[str, ...], nbytes: float) -> tuple[Transfer, ...]:
    """Segment ids moved by a collective outside the ring loops (an all-gather, a permutation): every layer
    reads the same ids, so the move is layer-invariant, once per micro-step (XLA hoists it out of the layer
    scan; measured on the compiled CPU step)."""
    return (Transfer(what, axes, nbytes, 1, None, "micro-step"),) if nbytes else ()


def segment_ring(
    what: str, axes: tuple[str, ...], hops: int, per_hop: float, cpu: bool, kv_side_backward: bool = True
) -> tuple[Transfer, ...]:
    """Segment ids riding a ring of `hops` hops each way with K/V (forward) and with K/V (kv_side_backward) or
    the Q side (backward), `per_hop` bytes a hop. Every layer reads the same ids: on XLA:CPU the ring's sends
    are layer-invariant and hoisted out of the layer scan, all of the forward's and the backward's first hop
    (once per micro-step; on a ring of 2 the backward's first hop of the K/V ids is the forward's hop, sent
    once), while the backward's other hops stay in each layer (measured on the compiled CPU step); the GPU
    ring sends each hop's arrays as one buffer (`fuse_sends`): the ids in every hop of every layer."""
    if hops < 1 or not per_hop:
        return ()
    if not cpu:
        return (Transfer(f"{what} (in each hop's buffer)", axes, 2 * hops * per_hop, 2 * hops, "attention"),)
    once = hops + (0 if hops == 1 and kv_side_backward else 1)
    out = [
        Transfer(
            f"{what}: the forward's, the backward's first hop", axes, once * per_hop, once, "attention", "micro-step"
        )
    ]
    if hops > 1:
        out.append(Transfer(f"{what}: the backward's other hops", axes, (hops - 1) * per_hop, hops - 1, "attention"))
    return tuple(out)


def tree_rounds(q: int) -> int:
    """Rounds of a binomial-tree broadcast or reduce over q ranks (⌈log2 q⌉)."""
    return max(q - 1, 0).bit_length()


# ---------------------------------------------------------------------------------------- model families


@dataclasses.dataclass(frozen=True)
class WorkloadTerms:
    """What a model family adds to the planner's prices beyond its stack of Transformer blocks
    (`ModelFamily.planner_terms`; the defaults are a token model's: a GPT's).

    modulation, final_modulation  per-sequence [b, hidden] vectors per block, and of the final layer, that meet
                                  split tokens (a DiT's adaLN: 6 and 2)
    conditioning                  parameter path parts whose gradients come out whole over the tensor axes (a
                                  conditioning path on per-sequence vectors: "adaLN", "t_embed", "y_embed")
    boundary_rows                 per-sequence [hidden] rows that cross a pipeline stage with the residual stream
    rotary_fp32                   a layer keeps fp32 rotary halves of q and k (else in the activation dtype)
    tiled_block                   with --mlp-tile the whole block but attention's core runs in tiles where the
                                  tensor method allows (`jaxring.nn.tiled_block`: a GPT's blocks)
    batch_bytes                   (config, rows, tokens per device) -> bytes of one device's stored batch
                                  (default: tokens, targets and positions, int32; packed documents add their
                                  segment ids and loss mask)
    """

    modulation: int = 0
    final_modulation: int = 0
    conditioning: tuple[str, ...] = ()
    boundary_rows: int = 0
    rotary_fp32: bool = True
    tiled_block: bool = True
    batch_bytes: Callable | None = None

    def stored_batch(self, config: object, rows: int, tokens: int, documents: bool = False) -> float:
        """Bytes of one device's stored batch: `rows` sequences of `tokens` tokens on this device (`documents`:
        packed documents, with their segment ids and loss mask)."""
        if self.batch_bytes is not None:
            return self.batch_bytes(config, rows, tokens)
        return (5 if documents else 3) * rows * tokens * 4


# ---------------------------------------------------------------------------------------- tensor methods


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The model's sizes, one micro-step's rows and the degrees that will split them (nothing split yet): what
    a tensor method's cost methods receive."""

    b: int  # sequences per data replica in one micro-step (the micro-batch)
    seq_len: int
    sp: int  # the sequence-parallel degree (the strategy's axes together)
    tp: int  # the tensor-parallel degree
    hidden: int
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    ffn: int  # FFN width of a dense block
    ffn_matrices: int  # weight matrices of the FFN: 3 with a gate (SwiGLU), else 2
    vocab: int | None  # rows of the token embedding and LM head; None without them (DiT)
    tied: bool  # the LM head is the embedding table
    moe: bool  # the blocks' FFNs are mixtures of experts
    causal: bool
    modulation: int  # per-sequence [b, hidden] vectors per block that meet split tokens (DiT's adaLN: 6)
    final_modulation: int  # the same, of the final layer (DiT: 2)
    e: int  # bytes per activation element as collectives move it
    em: int  # bytes per activation element in memory
    cpu: bool  # priced for XLA:CPU (the tests' simulated devices): jnp block ops, fp32 collectives
    segments: bool = False  # packed documents: int32 segment ids [b, n] travel where a method moves K/V
    vocab_ring: bool = False  # the embedding and head split by vocab rows, their blocks on a ring (`splits_vocab`)
    seq_axes: tuple[str, ...] = ("sp",)  # the run-mesh axes that split the sequence (a strategy's view of sp)

    @property
    def n(self) -> int:
        """Tokens of a sequence shard (seq_len / sp)."""
        return self.seq_len // self.sp


@dataclasses.dataclass(frozen=True)
class LocalDims:
    """A tensor method's split of one micro-step on one device (`TensorMethod.local_dims`)."""

    b: int  # rows (sequences) on this device
    n: int  # tokens the attention core sees per row
    n_act: int  # tokens of the residual stream per row
    h_act: int  # hidden columns of the residual stream
    heads: int  # query heads on this device
    kv_heads: int
    ffn: int  # FFN columns on this device
    vocab: int | None  # logits' columns on this device
    batch_split: int = 1  # ways the method splits the batch beyond the data axes
    token_split: int = 1  # ways it splits the tokens, targets and positions beyond the sequence axes


# ---------------------------------------------------------------------------------------- attention cores


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """What one device's attention core sees in one micro-step: q [b, n, heads, d], k/v [b, n, kv_heads, d]
    (after the tensor method's split), and the run-mesh axes of the strategy's view with their sizes (in
    run-mesh order, every axis of the view, sizes 1 included). segments: the tokens are packed documents, and
    their int32 segment ids [b, n] travel wherever the strategy moves K/V (or, backward, the Q side)."""

    b: int
    n: int
    heads: int
    kv_heads: int
    d: int
    e: int  # bytes per activation element as collectives move it
    em: int  # bytes per activation element in memory
    seq_len: int
    causal: bool
    cpu: bool  # XLA:CPU: the jnp block ops (their per-tile residuals and score tiles)
    axes: dict  # {axis: size} of the strategy's view of sp
    segments: bool = False
    window: int | None = None  # a sliding window W (causal): query i sees keys i - W < j <= i
    layout: str = "contiguous"  # the data-side token layout over the strategy's view
    # the tiled block (`jaxring.nn.tiled_block`) runs the layer: a strategy that `projects` gets the q/k/v
    # projections inside its head chunks
    tiled_block: bool = False
    fitted: FittedTerms = FittedTerms()  # the strategy's fitted terms for the target (the planner's calibration)

    @property
    def sp(self) -> int:
        out = 1
        for size in self.axes.values():
            out *= size
        return out

    def q_bytes(self, per_element: int) -> int:
        """[b, n, heads, d] at `per_element` bytes."""
        return self.b * self.n * self.heads * self.d * per_element

    def kv_bytes(self, per_element: int) -> int:
        """One of K, V: [b, n, kv_heads, d] at `per_element` bytes."""
        return self.b * self.n * self.kv_heads * self.d * per_element

    def rows_bytes(self) -> int:
        """One fp32 per row and head (an lse or Δ): [b, n, heads]."""
        return self.b * self.n * self.heads * F32

    def segment_bytes(self) -> int:
        """The int32 segment ids of the local tokens, [b, n] (0 without packed documents)."""
        return self.b * self.n * 4 if self.segments else 0


@dataclasses.dataclass(frozen=True)
class AttentionCost:
    """A strategy's price for one layer and one micro-step on one device.

    transfers       every collective of the core, forward and backward, with its run-mesh axes
    saved           bytes the core keeps for the backward without remat (its residuals: out, lse, ...)
    saved_by_remat  {remat mode: bytes} where a remat mode keeps something (default: nothing, as the layer's
                    checkpoint runs the core's forward again)
    working         the transient buffers of one layer's backward (received blocks, fp32 accumulators)
    forward         the transient buffers of one layer's forward, beside every layer's residuals as the last
                    layer's forward stores its own (default 0: less than the backward's)
    block_q/block_k rows and columns of one per-block compute (default n); with `cpu`, the planner adds the
                    jnp block ops' score tiles of that size for `tile_heads` heads (default all)
    extra_attention attention FLOPs it spends beyond the model's, as a multiple of them (RSA's causal half)
    window_share    the share of its attention FLOPs it still computes under the shape's sliding window (the
                    rings skip steps wholly outside it, the local kernels tiles; default 1: no credit claimed)
    peak_in_core    a layer's backward peaks inside the core (head-sharded copies of the whole sequence: Ulysses,
                    USP), where fewer of the per-token arrays a tiled block removes would have been live
    """

    transfers: tuple[Transfer, ...] = ()
    saved: float = 0.0
    saved_by_remat: dict = dataclasses.field(default_factory=dict)
    working: float = 0.0
    forward: float = 0.0
    block_q: int | None = None
    block_k: int | None = None
    tile_heads: int | None = None
    extra_attention: float = 0.0
    window_share: float = 1.0
    peak_in_core: bool = False

    def kept(self, remat: str) -> float:
        """Bytes kept per layer for the backward under `remat` ("none", "selective", "full")."""
        return self.saved if remat == "none" else self.saved_by_remat.get(remat, 0.0)
