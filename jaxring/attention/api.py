"""`sharded_attention`: one entry point for every sequence-parallel strategy (validation, layout, dispatch)."""
from __future__ import annotations

import functools
import math

import jax
from jax.sharding import PartitionSpec as P

from jaxring.attention.allgather import allgather_attention
from jaxring.attention.blockwise import get_block_ops
from jaxring.attention.layout import check_layout, check_seq_len, from_layout, to_layout
from jaxring.attention.masking import check_qkv
from jaxring.attention.reference import attention_reference
from jaxring.attention.ring import ring_attention
from jaxring.attention.rsa import rsa_attention
from jaxring.attention.ulysses import check_heads_split, ulysses_attention, usp_attention
from jaxring.attention.wallfacer import WF_AXES, check_wf_layout, wallfacer_attention, wallfacer_mesh
from jaxring.mesh import DATA_AXES, factored_mesh, place

STRATEGIES = ("dense", "ring", "rsa", "ulysses", "wallfacer", "allgather", "usp")
USP_AXES = ("usp_ring", "usp_ulysses")
# strategy -> the options it takes (beyond layout, causal, segment_ids, sm_scale, block_ops)
_OPTIONS = {"usp": {"ulysses_size"}, "wallfacer": {"team_size", "placement"}}


def _axis_size(mesh, name):
    return mesh.shape[name] if name in mesh.axis_names else 1


def sharded_attention(q, k, v, *, mesh, strategy: str = "ring", causal: bool = True, layout: str | None = None,
                      segment_ids=None, sm_scale: float | None = None, block_ops="auto", seq_axis: str = "sp",
                      laid_out: bool = False, **options):
    """Attention over global arrays, computed with a sequence-parallel strategy on `mesh`.

    Args:
      q: [batch, seq, q_heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim], in natural token order.
      mesh: a mesh from `jaxring.make_mesh` (or any mesh with an `sp` axis). Batch is split over dp and fsdp,
        heads over tp (when tp > 1), the sequence over `seq_axis`.
      strategy: "dense" (the unsharded reference), "ring", "rsa" (Ring Self-Attention), "ulysses",
        "allgather", "usp" (needs `ulysses_size=U`, U dividing sp: Ulysses over U devices, ring over sp / U)
        or "wallfacer" (needs `team_size=C`, C² dividing sp; `placement="team_inner"` or "ring_inner").
      layout: "contiguous", "zigzag" (causal balance) or "striped"; applied and undone here. Default: zigzag,
        except contiguous for ulysses (every device attends the whole sequence: balanced anyway) and rsa
        (which computes every block), where a layout would only add the re-layout traffic.
      segment_ids: int [batch, seq] or None; tokens attend within their segment, 0 = padding.
      laid_out: the sequence axis is already in `layout` order (applied once on the data side, as a model
        does: `layout_permutation`); no re-layout here, and the output stays in that order.
    Returns: out [batch, seq, q_heads, head_dim] in natural order (layout order if laid_out), differentiable
      in q, k, v.
    """
    check_qkv(q, k, v)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
    unknown = set(options) - _OPTIONS.get(strategy, set())
    if unknown:
        raise ValueError(f"strategy {strategy!r} takes no option {', '.join(sorted(unknown))}")
    if layout is None:
        layout = "contiguous" if strategy in ("ulysses", "rsa") else "zigzag"
    sm_scale = None if sm_scale is None else float(sm_scale)  # a cache key: no traced or array scales
    check_layout(layout)
    if strategy == "wallfacer":
        check_wf_layout(layout)
    if strategy == "rsa" and block_ops != "auto":
        raise ValueError(f"block_ops {block_ops!r}: rsa materialises its score rows and has no block compute")
    batch, seq = q.shape[:2]
    if k.shape[1] != seq:
        raise ValueError(f"k/v seq {k.shape[1]} must equal q seq {seq} for self-attention")
    if segment_ids is not None and segment_ids.shape != (batch, seq):
        raise ValueError(f"segment_ids shape {segment_ids.shape} must be [batch, seq] = {(batch, seq)}")
    if strategy == "dense":
        if laid_out and layout != "contiguous":
            raise ValueError(f"strategy 'dense' with laid_out=True needs layout 'contiguous', got {layout!r}")
        return attention_reference(q, k, v, causal=causal, segment_ids=segment_ids, sm_scale=sm_scale)[0]

    if seq_axis not in mesh.axis_names:
        raise ValueError(f"mesh axes {mesh.axis_names} have no {seq_axis!r} axis; strategy {strategy!r} "
                         f"splits the sequence over it")
    sp = mesh.shape[seq_axis]
    check_seq_len(seq, sp, layout, relayout=not laid_out)
    data_axes = tuple(a for a in DATA_AXES if a in mesh.axis_names)
    data = math.prod(_axis_size(mesh, a) for a in data_axes)
    if batch % data:
        raise ValueError(f"batch {batch} is not divisible by the data-parallel degree dp*fsdp = {data}")
    tp = _axis_size(mesh, "tp")
    if tp > 1 and (q.shape[2] % tp or k.shape[2] % tp):
        raise ValueError(f"q heads {q.shape[2]} and kv heads {k.shape[2]} must be divisible by tp = {tp}")
    head_axis = "tp" if tp > 1 else None

    seq_spec, run_mesh = seq_axis, mesh
    if strategy == "ulysses":
        check_heads_split(q.shape[2] // tp, sp)
    if strategy == "usp":
        u = options.get("ulysses_size")
        if not isinstance(u, int) or u < 1 or sp % u:
            raise ValueError(f"usp needs ulysses_size dividing sp = {sp}; got {u!r}")
        check_heads_split(q.shape[2] // tp, u, "ulysses_size")
        run_mesh, seq_spec = factored_mesh(mesh, seq_axis, USP_AXES, (sp // u, u)), USP_AXES
    if strategy == "wallfacer":
        run_mesh = wallfacer_mesh(mesh, options.get("team_size"), options.get("placement", "team_inner"), seq_axis)
        seq_spec = WF_AXES
    x_spec = P(data_axes or None, seq_spec, head_axis, None)
    seg_spec = P(data_axes or None, seq_spec)
    args = [place(x, run_mesh, x_spec) for x in (q, k, v)]
    if segment_ids is not None:
        args.append(place(segment_ids, run_mesh, seg_spec))
    run = _sharded(strategy, run_mesh, x_spec, seg_spec, segment_ids is not None, seq_spec, layout, causal,
                   sm_scale, block_ops, options.get("team_size"), laid_out)
    return run(*args)


def _local_attention(strategy, seq_axes, team_size, **kw):
    """The per-device function of a strategy, inside shard_map, on laid-out shards."""
    if strategy == "rsa":
        kw.pop("block_ops")
        return functools.partial(rsa_attention, axis_name=seq_axes, **kw)
    if strategy == "wallfacer":
        return functools.partial(wallfacer_attention, team_size=team_size, **kw)
    if strategy == "ring":
        return functools.partial(ring_attention, axis_name=seq_axes, **kw)
    if strategy == "ulysses":
        return functools.partial(ulysses_attention, axis_name=seq_axes, **kw)
    if strategy == "allgather":
        return functools.partial(allgather_attention, axis_name=seq_axes, **kw)
    if strategy == "usp":
        return functools.partial(usp_attention, ring_axis=seq_axes[0], ulysses_axis=seq_axes[1], **kw)
    raise AssertionError(strategy)


@functools.lru_cache(maxsize=256)
def _sharded(strategy, mesh, x_spec, seg_spec, with_segments, seq_axes, layout, causal, sm_scale, block_ops,
             team_size, laid_out):
    """A jitted shard_map of a strategy, built once per configuration (eager shard_map runs op by op)."""
    attend = _local_attention(strategy, seq_axes, team_size, layout=layout, causal=causal, sm_scale=sm_scale,
                              block_ops=block_ops)

    def local(q, k, v, *seg):
        if laid_out:
            return attend(q, k, v, *seg)
        q, k, v, *seg = (to_layout(x, layout, seq_axes) for x in (q, k, v, *seg))
        return from_layout(attend(q, k, v, *seg), layout, seq_axes)

    specs = (x_spec,) * 3 + ((seg_spec,) if with_segments else ())
    # The Pallas interpreter of JAX 0.10 cannot type-check varying mesh axes (see flash.py).
    check_vma = get_block_ops(block_ops).name != "pallas_interpret"
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=x_spec, check_vma=check_vma))
