"""Dispatch and combine: tokens to their experts' rows and back, dropless or with a capacity, local or over ep.

Every path starts from one stable sort of this device's T*k assignments by expert. Assignment i = j*T + t is
token t's j-th choice, so within an expert the sorted rows are in (choice rank j, token t) order: all first
choices, then all second choices, each in token order. That order is the capacity path's priority rule (the
first C rows of an expert are kept, as in GShard).

Dropless, ep = 1: rows x[token] sorted by expert -> grouped matmul (experts.grouped_ffn) -> unsort.

Dropless over ep (no ragged all-to-all on XLA:CPU, so a padded one): the rows for ep rank d (experts
[d*E_l, (d+1)*E_l), E_l = E/ep) are contiguous in the sorted order; they go into a per-destination buffer of
B = T*min(k, E_l) rows, the most one device can ever send to one rank (a token's k choices are distinct
experts, at most min(k, E_l) of them on one rank), so nothing is ever dropped.

  send [ep, B, h] --all_to_all--> recv [ep(source), B, h]      + the counts [ep, E_l] (int32, once)
  recv rows regrouped by local expert (an index computed from the counts, no sort) -> grouped matmul -> back
  out  [ep, B, h] --all_to_all--> [ep(dest), B, h] -> each sorted row reads its slot

  Bytes received per device per all_to_all: (ep-1)/ep * ep*B*h = (ep-1)*T*min(k, E_l)*h elements, against
  (ep-1)/ep*T*k*h for a perfectly balanced ragged exchange: the padding costs a factor ep*min(k, E_l)/k.

Capacity (either ep): slots [E, C, h], slot (e, c) = the c-th row of expert e if c < load_e, else zeros;
over ep the slots of rank d's experts go to rank d ([ep, E_l, C, h] all_to_all), are computed there as
[E_l, ep*C, h] and come back by a second all_to_all. Per all_to_all (ep-1)/ep*E*C*h elements.

The backward of each all_to_all is an all_to_all (autodiff's transpose): four token exchanges per layer.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxring.core.vma import vary
from jaxring.nn.moe.config import MoEConfig
from jaxring.nn.moe.experts import batched_ffn, grouped_ffn


class Assignments(NamedTuple):
    """This device's T*k (token, choice) assignments sorted by expert (row r = r-th in that order)."""

    order: jax.Array  # int32 [T*k]: assignment index j*T + t of sorted row r
    token: jax.Array  # int32 [T*k]: its token t
    expert: jax.Array  # int32 [T*k]: its expert (non-decreasing in r)
    counts: jax.Array  # int32 [E]: assignments per expert (the load, before any drop)
    starts: jax.Array  # int32 [E]: first sorted row of each expert


def _exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def _inverse_permutation(perm: jax.Array) -> jax.Array:
    return jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))


def sort_by_expert(experts: jax.Array, num_experts: int) -> Assignments:
    """experts int32 [T, k] -> the assignments sorted by expert, choice-rank-major within an expert."""
    num_tokens = experts.shape[0]
    flat = experts.T.reshape(-1)  # i = j*T + t
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return Assignments(order, order % num_tokens, flat[order], counts, _exclusive_cumsum(counts))


def combine(rows: jax.Array, assignments: Assignments, gates: jax.Array) -> jax.Array:
    """Sorted expert outputs [T*k, h] -> sum_j gates[t, j] * out(t, j): fp32 [T, h]."""
    num_tokens, k = gates.shape
    out = rows[_inverse_permutation(assignments.order)].reshape(k, num_tokens, -1)
    return jnp.einsum("kth,tk->th", out.astype(jnp.float32), gates)


def _slots(x: jax.Array, assignments: Assignments, starts: jax.Array, counts: jax.Array, size: int) -> jax.Array:
    """[len(starts), size, h]: slot (g, c) = x[token of sorted row starts[g] + c] if c < counts[g], else 0."""
    c = jnp.arange(size, dtype=jnp.int32)
    row = jnp.minimum(starts[:, None] + c[None], assignments.token.shape[0] - 1)
    valid = c[None] < counts[:, None]
    return jnp.where(valid[..., None], x[assignments.token[row]], jnp.zeros((), x.dtype))


# -------------------------------------------------------------------------------------------- dropless


def _grouped(rows: jax.Array, experts: dict, group_sizes: jax.Array, config: MoEConfig) -> jax.Array:
    return grouped_ffn(rows, experts, group_sizes, config.activation, config.grouped_matmul, config.block_rows)


def dropless_local(x: jax.Array, assignments: Assignments, experts: dict, config: MoEConfig) -> jax.Array:
    """All experts on this device: x [T, h] -> sorted expert outputs [T*k, h]."""
    return _grouped(x[assignments.token], experts, assignments.counts, config)


def _regroup_received(recv_counts: jax.Array, buffer_rows: int) -> tuple[jax.Array, jax.Array]:
    """Where each received row goes in the expert-grouped order, and the group sizes.

    recv_counts int32 [ep(source), E_l]: rows from source s are its experts' rows in expert order, then
    padding. Returns position int32 [ep*B] (padding rows after all real ones) and group_sizes int32 [E_l].
    """
    _ep, experts_local = recv_counts.shape
    chunk_start = _exclusive_cumsum(recv_counts, axis=1)  # within a source's buffer
    chunk_end = chunk_start + recv_counts
    p = jnp.arange(buffer_rows, dtype=jnp.int32)
    expert = jnp.sum(p[None, :, None] >= chunk_end[:, None, :], axis=-1)  # [ep, B]; E_l = padding
    valid = (expert < experts_local).reshape(-1)
    e = jnp.minimum(expert, experts_local - 1)
    group_sizes = jnp.sum(recv_counts, axis=0)
    group_start = _exclusive_cumsum(group_sizes)
    earlier_sources = _exclusive_cumsum(recv_counts, axis=0)  # rows of e from sources < s
    position = (
        group_start[e]
        + jnp.take_along_axis(earlier_sources, e, axis=1)
        + p[None]
        - jnp.take_along_axis(chunk_start, e, axis=1)
    ).reshape(-1)
    padding_rank = jnp.cumsum(~valid) - 1
    position = jnp.where(valid, position, jnp.sum(group_sizes) + padding_rank).astype(jnp.int32)
    return position, group_sizes


def dropless_exchange(
    x: jax.Array, assignments: Assignments, experts: dict, config: MoEConfig, ep_axis: str, ep: int
) -> jax.Array:
    """Experts split over `ep_axis` (E_l = experts["w_in"].shape[0] here): x [T, h] -> sorted outputs
    [T*k, h], through two padded all_to_alls of [ep, B, h], B = T*min(k, E_l) (see the module docstring)."""
    num_tokens, hidden = x.shape
    num_experts = assignments.counts.shape[0]
    k = assignments.order.shape[0] // num_tokens
    experts_local = num_experts // ep
    buffer_rows = num_tokens * min(k, experts_local)
    rank_counts = assignments.counts.reshape(ep, experts_local)
    rank_starts = _exclusive_cumsum(jnp.sum(rank_counts, axis=1))
    send = _slots(x, assignments, rank_starts, jnp.sum(rank_counts, axis=1), buffer_rows)  # [ep, B, h]

    recv = lax.all_to_all(vary(send, (ep_axis,)), ep_axis, 0, 0, tiled=True)  # [ep(source), B, h]
    recv_counts = lax.all_to_all(vary(rank_counts, (ep_axis,)), ep_axis, 0, 0, tiled=True)
    position, group_sizes = _regroup_received(recv_counts, buffer_rows)
    rows = recv.reshape(ep * buffer_rows, hidden)
    out = _grouped(rows[_inverse_permutation(position)], experts, group_sizes, config)
    out = out[position].reshape(ep, buffer_rows, hidden)
    back = lax.all_to_all(out, ep_axis, 0, 0, tiled=True)  # [ep(dest), B, h]

    rank = assignments.expert // experts_local
    slot = jnp.arange(assignments.order.shape[0], dtype=jnp.int32) - rank_starts[rank]
    return back[rank, slot]


# -------------------------------------------------------------------------------------------- capacity


def capacity_dispatch(
    x: jax.Array,
    assignments: Assignments,
    capacity: int,
    experts: dict,
    config: MoEConfig,
    ep_axis: str | None,
    ep: int,
) -> tuple[jax.Array, jax.Array]:
    """x [T, h] -> (sorted expert outputs [T*k, h] with dropped rows 0, dropped count int32 scalar)."""
    num_experts = assignments.counts.shape[0]
    hidden = x.shape[-1]
    slots = _slots(x, assignments, assignments.starts, assignments.counts, capacity)  # [E, C, h]
    if ep > 1:
        experts_local = num_experts // ep
        send = slots.reshape(ep, experts_local, capacity, hidden)
        recv = lax.all_to_all(vary(send, (ep_axis,)), ep_axis, 0, 0, tiled=True)  # [ep(source), E_l, C, h]
        local = recv.transpose(1, 0, 2, 3).reshape(experts_local, ep * capacity, hidden)
        out = batched_ffn(local, experts, config.activation)
        out = out.reshape(experts_local, ep, capacity, hidden).transpose(1, 0, 2, 3)
        out = lax.all_to_all(out, ep_axis, 0, 0, tiled=True).reshape(num_experts, capacity, hidden)
    else:
        out = batched_ffn(slots, experts, config.activation)
    position = jnp.arange(assignments.order.shape[0], dtype=jnp.int32) - assignments.starts[assignments.expert]
    kept = position < capacity
    rows = jnp.where(
        kept[:, None], out[assignments.expert, jnp.minimum(position, capacity - 1)], jnp.zeros((), out.dtype)
    )
    dropped = jnp.sum(jnp.maximum(assignments.counts - capacity, 0))
    return rows, dropped
