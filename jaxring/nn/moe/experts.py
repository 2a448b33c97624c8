"""The experts' feed-forward networks on rows already grouped by expert.

Weights of the E_local experts on this device: w_in, w_gate [E_local, h, f] and w_out [E_local, f, h], where
f is the FFN width of this tp rank (Megatron-style: w_in/w_gate split by columns, w_out by rows, so the
result is a partial sum over tp that the caller adds up once).

  grouped_ffn  dropless: rows [M, h] sorted by expert with group sizes [E_local]; rows past sum(group_sizes)
               give 0. Two implementations of the grouped matmul:
                 "ragged_dot"  lax.ragged_dot (grouped kernels on GPU/TPU; on CPU jax lowers it to a masked
                               dense matmul: E_local times the FLOPs and an [M, E_local*h] temporary)
                 "blocked"     each group padded to a multiple of `block_rows`, then a scan over row blocks,
                               one expert per block (its weights indexed dynamically), blocks past the data
                               skipped by a cond at run time, forward and (hand-written) backward:
                               (rows + E_local*block_rows) * h * f work. For CPU.
  batched_ffn  capacity: rows [E_local, C, h], one slot array per expert (a batched matmul)
  dense_ffn    the shared expert (and any plain MLP): rows [T, h], weights [h, f] / [f, h]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxring.core.vma import common_vma, vary_like
from jaxring.kernels.layer_math import activate
from jaxring.nn.moe.config import GROUPED_MATMULS


def _ffn(x: jax.Array, w: dict, activation: str) -> jax.Array:
    up = x @ w["w_in"]
    return activate(up, x @ w["w_gate"] if activation == "swiglu" else None, activation) @ w["w_out"]


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    return jnp.cumsum(x) - x


def _group_of(positions: jax.Array, ends: jax.Array) -> jax.Array:
    """The group of each position, for groups ending (exclusive) at `ends`; len(ends) past the last."""
    return jnp.sum(positions[:, None] >= ends[None, :], axis=1)


def _expert(experts: dict, e: jax.Array) -> dict:
    return {name: lax.dynamic_index_in_dim(w, e, keepdims=False) for name, w in experts.items()}


def _blocks_forward(
    activation: str, blocks: jax.Array, block_expert: jax.Array, block_used: jax.Array, experts: dict
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Scan over row blocks [n, bm, h], block b through expert block_expert[b], skipped unless block_used[b]:
    (out [n, bm, h], up [n, bm, f], gate [n, bm, f] or [n, 0])."""
    bm = blocks.shape[1]
    f = experts["w_in"].shape[-1]
    gate_width = f if activation == "swiglu" else 0

    def run(x: jax.Array, e: jax.Array) -> tuple:
        w = _expert(experts, e)
        up = x @ w["w_in"]
        gate = x @ w["w_gate"] if activation == "swiglu" else vary_like(jnp.zeros((bm, 0), x.dtype), x)
        return activate(up, gate, activation) @ w["w_out"], up, gate

    def skip(x: jax.Array, e: jax.Array) -> tuple:
        return (
            jnp.zeros_like(x),
            vary_like(jnp.zeros((bm, f), x.dtype), x),
            vary_like(jnp.zeros((bm, gate_width), x.dtype), x),
        )

    _, (out, up, gate) = lax.scan(
        lambda _, b: (None, lax.cond(b[2], run, skip, b[0], b[1])), None, (blocks, block_expert, block_used)
    )
    return out, up, gate


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blocks_ffn(
    activation: str, blocks: jax.Array, block_expert: jax.Array, block_used: jax.Array, experts: dict
) -> jax.Array:
    """The blocked grouped FFN with a hand-written backward: both passes skip unused blocks at run time and
    save only up/gate per block (autodiff of a cond inside a scan would stack the weights per block)."""
    return _blocks_forward(activation, blocks, block_expert, block_used, experts)[0]


def _blocks_ffn_fwd(
    activation: str, blocks: jax.Array, block_expert: jax.Array, block_used: jax.Array, experts: dict
) -> tuple[jax.Array, tuple]:
    out, up, gate = _blocks_forward(activation, blocks, block_expert, block_used, experts)
    return out, (blocks, block_expert, block_used, experts, up, gate)


def _blocks_ffn_bwd(activation: str, residuals: tuple, d_out: jax.Array) -> tuple:
    blocks, block_expert, block_used, experts, up, gate = residuals

    def run(
        dw: dict, x: jax.Array, e: jax.Array, up: jax.Array, gate: jax.Array | None, dy: jax.Array
    ) -> tuple[dict, jax.Array]:
        w = _expert(experts, e)
        if activation == "swiglu":
            h, act_vjp = jax.vjp(lambda u, g: activate(u, g, activation), up, gate)
        else:
            h, act_vjp = jax.vjp(lambda u: activate(u, None, activation), up)
        dh = dy @ w["w_out"].T
        d_act = act_vjp(dh)
        dx = d_act[0] @ w["w_in"].T
        grads = {"w_in": x.T @ d_act[0], "w_out": h.T @ dy}
        if activation == "swiglu":
            dx = dx + d_act[1] @ w["w_gate"].T
            grads["w_gate"] = x.T @ d_act[1]
        return {n: dw[n].at[e].add(grads[n].astype(jnp.float32)) for n in dw}, dx.astype(x.dtype)

    def skip(
        dw: dict, x: jax.Array, e: jax.Array, up: jax.Array, gate: jax.Array | None, dy: jax.Array
    ) -> tuple[dict, jax.Array]:
        return dw, jnp.zeros_like(x)

    def step(dw: dict, b: tuple) -> tuple[dict, jax.Array]:
        x, e, used, up, gate, dy = b
        return lax.cond(used, run, skip, dw, x, e, up, gate, dy)

    dw0 = {n: vary_like(jnp.zeros(w.shape, jnp.float32), w) for n, w in experts.items()}  # fp32 sums
    dw, d_blocks = lax.scan(step, dw0, (blocks, block_expert, block_used, up, gate, d_out))
    return d_blocks, None, None, {n: dw[n].astype(experts[n].dtype) for n in dw}


_blocks_ffn.defvjp(_blocks_ffn_fwd, _blocks_ffn_bwd)


def grouped_ffn(
    rows: jax.Array,
    experts: dict,
    group_sizes: jax.Array,
    activation: str,
    implementation: str = "auto",
    block_rows: int = 128,
) -> jax.Array:
    """rows [M, h] grouped by expert, experts {"w_in", "w_gate"?, "w_out"} [E_local, ...], group_sizes int32
    [E_local] -> [M, h] (partial over tp). implementation: "ragged_dot", "blocked", or "auto" (blocked on
    CPU, ragged_dot elsewhere)."""
    if implementation == "auto":
        implementation = "blocked" if jax.default_backend() == "cpu" else "ragged_dot"
    rows, experts = common_vma(rows, experts)
    if implementation == "ragged_dot":
        up = lax.ragged_dot(rows, experts["w_in"], group_sizes)
        gate = lax.ragged_dot(rows, experts["w_gate"], group_sizes) if activation == "swiglu" else None
        return lax.ragged_dot(activate(up, gate, activation), experts["w_out"], group_sizes)
    if implementation != "blocked":
        raise ValueError(f"grouped matmul {implementation!r} must be one of {', '.join(GROUPED_MATMULS)}")

    num_rows, hidden = rows.shape
    num_groups = group_sizes.shape[0]
    bm = max(1, min(block_rows, num_rows))
    num_blocks = -(-(num_rows + num_groups * (bm - 1)) // bm)  # worst case: every group ends mid-block
    padded_sizes = -(-group_sizes // bm) * bm
    padded_start, group_start = _exclusive_cumsum(padded_sizes), _exclusive_cumsum(group_sizes)

    q = jnp.arange(num_blocks * bm, dtype=jnp.int32)  # padded position -> source row
    g = jnp.minimum(_group_of(q, padded_start + padded_sizes), num_groups - 1)
    offset = q - padded_start[g]
    valid = (q < jnp.sum(padded_sizes)) & (offset < group_sizes[g])
    source = jnp.minimum(group_start[g] + offset, num_rows - 1)
    blocks = jnp.where(valid[:, None], rows[source], jnp.zeros((), rows.dtype)).reshape(num_blocks, bm, hidden)
    block_expert = g[::bm]
    block_used = jnp.arange(num_blocks) * bm < jnp.sum(padded_sizes)

    out = _blocks_ffn(activation, blocks, block_expert, block_used, experts)
    r = jnp.arange(num_rows, dtype=jnp.int32)  # row -> padded position
    gr = _group_of(r, group_start + group_sizes)
    position = padded_start[jnp.minimum(gr, num_groups - 1)] + r - group_start[jnp.minimum(gr, num_groups - 1)]
    out = out.reshape(num_blocks * bm, hidden)[jnp.minimum(position, num_blocks * bm - 1)]
    return jnp.where((gr < num_groups)[:, None], out, jnp.zeros((), out.dtype))


def batched_ffn(slots: jax.Array, experts: dict, activation: str) -> jax.Array:
    """slots [E_local, C, h] (row c of expert e's buffer) -> [E_local, C, h] (partial over tp); empty slots
    hold zeros and give zeros (no biases)."""
    slots, experts = common_vma(slots, experts)
    up = jnp.einsum("ech,ehf->ecf", slots, experts["w_in"])
    gate = jnp.einsum("ech,ehf->ecf", slots, experts["w_gate"]) if activation == "swiglu" else None
    return jnp.einsum("ecf,efh->ech", activate(up, gate, activation), experts["w_out"])


def dense_ffn(x: jax.Array, weights: dict, activation: str) -> jax.Array:
    """x [T, h], weights {"w_in", "w_gate"?: [h, f], "w_out": [f, h]} -> [T, h] (partial over tp)."""
    x, weights = common_vma(x, weights)
    return _ffn(x, weights, activation)
