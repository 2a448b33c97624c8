"""`sharded_attention`: every sequence-parallel strategy on global arrays (validation, layout, dispatch).

A thin wrapper over the strategies' local functions (`jaxring/parallel/sequence/`), looked up by name in the
registry: it checks the inputs, lays the sequence out, and runs the strategy's `attend` in a shard_map over its
view of the mesh.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxring.core.mesh import DATA_AXES, mesh_axis_size, spec_entry
from jaxring.core.sharded import run_local
from jaxring.kernels.block_compute import get_block_ops
from jaxring.kernels.blockwise import BlockOps
from jaxring.kernels.layout import check_seq_len, from_layout, to_layout
from jaxring.kernels.masking import check_qkv, check_window
from jaxring.kernels.reference import attention_reference
from jaxring.parallel.catalog import sequence_strategy

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_attention_inputs(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> None:
    """Shapes (check_qkv), one floating dtype for q, k and v, and a real bool for causal."""
    check_qkv(q, k, v)
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1:
        raise ValueError(f"q, k, v dtypes {q.dtype}, {k.dtype}, {v.dtype} must be the same")
    (dtype,) = dtypes
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"q, k, v dtype {dtype} is not supported; expected one of float32, bfloat16, float16")
    if not isinstance(causal, bool):
        raise ValueError(f"causal {causal!r} must be True or False")


def sharded_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: Mesh,
    strategy: str = "ring",
    causal: bool = True,
    layout: str | None = None,
    segment_ids: jax.Array | None = None,
    sm_scale: float | None = None,
    block_ops: str | BlockOps = "auto",
    seq_axis: str = "sp",
    batch_axes: tuple[str, ...] | None = None,
    head_axis: str = "tp",
    laid_out: bool = False,
    window: int | None = None,
    **options,
) -> jax.Array:
    """Attention over global arrays, computed with a sequence-parallel strategy on `mesh`.

    Args:
      q: [batch, seq, q_heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim], in natural token order.
      mesh: a mesh from `jaxring.make_mesh`, or any mesh: the sequence is split over `seq_axis`, the batch over
        `batch_axes` (default: those of dp, fsdp, ep it has), heads over `head_axis`; a mesh axis of size > 1
        that is none of these is refused (it would silently replicate the work).
      strategy: a name from `jaxring.parallel.registry.sequence_strategies()`: "dense" (the unsharded reference), "ring",
        "rsa" (Ring Self-Attention), "ulysses", "allgather", "usp" (needs `ulysses_size=U`, U dividing sp)
        or "wallfacer" (needs `team_size=C`, C² dividing sp; `placement="team_inner"` or "ring_inner").
      layout: "contiguous", "zigzag" (causal balance) or "striped"; applied and undone here. Default: the
        strategy's (zigzag for the rings; contiguous for ulysses, whose devices attend the whole sequence,
        and rsa, which computes every block).
      segment_ids: int [batch, seq] or None; tokens attend within their segment, 0 = padding.
      laid_out: the sequence axis is already in `layout` order (applied once on the data side, as a model
        does: `layout_permutation`); no re-layout here, and the output stays in that order.
      window: sliding window W (needs causal): the query at position i sees keys i - W < j <= i (Mistral);
        None: unlimited. Every strategy masks by true positions and skips blocks outside every window.
    Returns: out [batch, seq, q_heads, head_dim] in natural order (layout order if laid_out), differentiable
      in q, k, v.
    """
    check_attention_inputs(q, k, v, causal)
    window = check_window(window, causal)
    entry = sequence_strategy(strategy)
    if layout is None:
        layout = entry.default_layout
    layout = entry.layout_for(layout, causal=True)
    sm_scale = None if sm_scale is None else float(sm_scale)  # a cache key: no traced or array scales
    if sm_scale is not None and not (math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale {sm_scale!r} must be a finite number > 0 (the scores' scale)")
    if not entry.uses_block_ops and block_ops != "auto":
        raise ValueError(f"block_ops {block_ops!r}: {strategy} materialises its score rows and has no block compute")
    batch, seq = q.shape[:2]
    if k.shape[1] != seq:
        raise ValueError(f"k/v seq {k.shape[1]} must equal q seq {seq} for self-attention")
    if segment_ids is not None and segment_ids.shape != (batch, seq):
        raise ValueError(f"segment_ids shape {segment_ids.shape} must be [batch, seq] = {(batch, seq)}")
    if segment_ids is not None and not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise TypeError(f"segment_ids have dtype {jnp.dtype(segment_ids.dtype).name}; segment ids must be integers")
    if strategy == "dense":
        if options:
            raise ValueError(f"strategy 'dense' takes no option {', '.join(sorted(options))}")
        if laid_out and layout != "contiguous":
            raise ValueError(f"strategy 'dense' with laid_out=True needs layout 'contiguous', got {layout!r}")
        return attention_reference(q, k, v, causal=causal, segment_ids=segment_ids, sm_scale=sm_scale, window=window)[0]

    if seq_axis not in mesh.axis_names:
        raise ValueError(
            f"mesh axes {mesh.axis_names} have no {seq_axis!r} axis; strategy {strategy!r} splits the sequence over it"
        )
    sp = mesh.shape[seq_axis]
    options = entry.resolve_options(options, sp)
    check_seq_len(seq, sp, layout, relayout=not laid_out)
    data_axes = tuple(a for a in DATA_AXES if a in mesh.axis_names) if batch_axes is None else tuple(batch_axes)
    for a in data_axes:
        if a not in mesh.axis_names:
            raise ValueError(f"batch axis {a!r} is not an axis of the mesh {mesh.axis_names}")
    unused = [a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in (*data_axes, seq_axis, head_axis)]
    if unused:
        raise ValueError(
            f"mesh axis {unused[0]!r} (size {mesh.shape[unused[0]]}) is none of the sequence axis {seq_axis!r}, the "
            f"batch axes {data_axes} or the head axis {head_axis!r}; name it with seq_axis=, batch_axes= or head_axis="
        )
    data = math.prod(mesh_axis_size(mesh, a) for a in data_axes)
    if batch % data:
        raise ValueError(f"batch {batch} is not divisible by the data-parallel degree {'*'.join(data_axes)} = {data}")
    tp = mesh_axis_size(mesh, head_axis)
    if tp > 1 and (q.shape[2] % tp or k.shape[2] % tp):
        raise ValueError(f"q heads {q.shape[2]} and kv heads {k.shape[2]} must be divisible by {head_axis} = {tp}")
    if entry.check_heads is not None:
        entry.check_heads(q.shape[2] // tp, k.shape[2] // tp, sp, options)
    run_mesh, seq_axes = entry.seq_view(mesh, options, seq_axis)
    x_spec = P(spec_entry(data_axes), spec_entry(seq_axes), head_axis if tp > 1 else None, None)
    seg_spec = P(spec_entry(data_axes), spec_entry(seq_axes))
    specs = (x_spec,) * 3 + ((seg_spec,) if segment_ids is not None else ())
    args = (q, k, v) + ((segment_ids,) if segment_ids is not None else ())
    # The Pallas interpreter (jax 0.11.2, 0.12.1) cannot type-check varying mesh axes (see flash.py).
    check_vma = get_block_ops(block_ops).name != "pallas_interpret"
    return run_local(
        _local,
        run_mesh,
        specs,
        x_spec,
        *args,
        check_vma=check_vma,
        strategy=strategy,
        axis_name=seq_axes,
        layout=layout,
        causal=causal,
        sm_scale=sm_scale,
        block_ops=block_ops,
        laid_out=laid_out,
        options=tuple(sorted(options.items())) + ((("window", window),) if window is not None else ()),
    )


def _local(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *segment_ids,
    strategy: str,
    axis_name: tuple[str, ...],
    layout: str,
    causal: bool,
    sm_scale: float,
    block_ops: str | BlockOps,
    laid_out: bool,
    options: tuple[tuple[str, object], ...],
):
    """The per-device body: re-layout (unless laid out), the strategy's local attention, back to natural.
    `options` carries the window only when one is set (a strategy registered without it still runs)."""
    attend = sequence_strategy(strategy).attend
    kw = dict(
        axis_name=axis_name, layout=layout, causal=causal, sm_scale=sm_scale, block_ops=block_ops, **dict(options)
    )
    seg = segment_ids[0] if segment_ids else None
    if laid_out:
        return attend(q, k, v, seg, **kw)
    q, k, v = (to_layout(x, layout, axis_name) for x in (q, k, v))
    seg = None if seg is None else to_layout(seg, layout, axis_name)
    return from_layout(attend(q, k, v, seg, **kw), layout, axis_name)
