"""Memory-efficient tensor parallelism, METP [METP] (REFERENCES.md), its generic ring: O = f(AB)C, the FFN.

Everything here runs inside `shard_map` over one axis (`tp`) of size p (`metp.py` is the tensor method, its
layouts and cost model; `metp_api.py` the same layers on global arrays). METP splits the *sequence* over
tp: rank i holds the token shard X_i = A_(i,:) and 1/p of every weight; activations never move, weights do.

Generic ring, Eq. (1), Algorithms 1-2 (`metp`): rank i holds A_i (rows), B_(:,i) and C_(i,:) and owns
O_i = Σ_r f(A_i B_r) C_r. The (B, C) blocks circulate; rank i holds block (i - j) mod p at step j:

  for j in 0 .. p-1:
      send (B, C) to rank i+1, receive the next pair from rank i-1 (issued before the compute: double buffer)
      T = A_i B^(j);  O_i += f(T) C^(j)

(Algorithm 1 sends to i-1; jaxring's rings all turn one way, `collectives.FORWARD`: the direction does not
change the sums or the bytes.)

Backward (`jax.custom_vjp`, recompute): the residuals are A_i and the rank's own B, C blocks only (no T, no
f(T)). The blocks go round again, with their gradient accumulators:

      T = A_i B^(j);  D = f(T);  ΔD = ΔO_i C^(j)ᵀ;  ΔC^(j) += Dᵀ ΔO_i;  ΔT = f'(T) ⊙ ΔD
      ΔA_i += ΔT B^(j)ᵀ;  ΔB^(j) += A_iᵀ ΔT;  send (ΔB, ΔC) on with their block

ΔB, ΔC make p hops (not p-1) so that they end on their owner: per device the forward moves (p-1) block pairs
and the backward (p-1) pairs plus p gradient pairs, (3p-2)/p·(k1k2 + k2n) elements in all (fp32
accumulators). The backward ring turns the other way (`collectives.BACKWARD`: rank i sends to i-1, holding
block (i + j) mod p) and carries the blocks transposed (Bᵀ, Cᵀ, the operands of ΔT Bᵀ
and ΔO Cᵀ): a hop identical to the forward's would let XLA reuse it when both passes are in one program,
holding the received blocks from forward to backward. The FFN is A = X, B = W_in (and W_gate for SwiGLU:
f takes both products, both blocks circulate), C = W_out.

Weights replicated over dp/fsdp: the custom VJPs return each shard's weight gradient summed over the data
axes (one psum of the rank's blocks at the end), which is what shard_map's varying-axes types expect.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxring.core.collectives import (
    BACKWARD,
    FORWARD,
    ring_steps,
    send_to_next,
)
from jaxring.core.vma import sum_like, vary_like
from jaxring.kernels.layer_math import add_bias, check_activation
from jaxring.parallel.tensor.metp_matmul import mm, outer, row_sum

__all__ = ["gelu", "metp", "metp_forward", "metp_mlp", "swiglu"]


def gelu(t: jax.Array) -> jax.Array:
    """f of the GeLU FFN (Eq. 2): tanh-approximate GeLU."""
    return jax.nn.gelu(t, approximate=True)


def swiglu(t_gate: jax.Array, t_in: jax.Array) -> jax.Array:
    """f of the SwiGLU FFN: silu(X W_gate) ⊙ (X W_in)."""
    return jax.nn.silu(t_gate) * t_in


# ---------------------------------------------------------------------------------------------------------
# O = f(AB)C (Algorithms 1-2)
# ---------------------------------------------------------------------------------------------------------


def metp(
    a: jax.Array,
    b: jax.Array | Sequence[jax.Array],
    c: jax.Array,
    *,
    f: Callable[..., jax.Array] = gelu,
    axis_name: str = "tp",
    b_bias: jax.Array | Sequence[jax.Array] | None = None,
) -> jax.Array:
    """O_i = Σ_r f(A_i B_r + β_r) C_r on a ring over `axis_name` (call inside `shard_map`).

    Args:
      a: local rows A_i [..., k1] (e.g. this rank's sequence shard [batch, s/p, hidden]); never moves.
      b: local column block B_(:,i) [k1, k2/p], or a tuple of them when f takes several products
        (SwiGLU: (W_gate block, W_in block)).
      c: local row block C_(i,:) [k2/p, n].
      f: element-wise function of the product(s) A_i B_r (one argument per B block).
      b_bias: optional bias blocks β_(i) [k2/p] of the products, one per B block (like b); they travel with
        their B block (and their gradients with ΔB).
    Returns: O_i [..., n] in a.dtype. Differentiable (custom_vjp: recompute, gradients ride the ring).
    """
    bs = tuple(b) if isinstance(b, (tuple, list)) else (b,)
    biases = () if b_bias is None else tuple(b_bias) if isinstance(b_bias, (tuple, list)) else (b_bias,)
    if biases and (len(biases) != len(bs) or any(x.shape != bs[0].shape[1:] for x in biases)):
        raise ValueError(f"b_bias {[x.shape for x in biases]} must be one [k2/p] = {bs[0].shape[1:]} block per B block")
    if not bs:
        raise ValueError("b must be an array or a non-empty tuple of arrays")
    for i, b_ in enumerate(bs):
        if b_.ndim != 2 or b_.shape != bs[0].shape:
            raise ValueError(f"b[{i}] has shape {b_.shape}; every B block must be [k1, k2/p] = {bs[0].shape}")
    if bs[0].shape[0] != a.shape[-1]:
        raise ValueError(f"a's last dim {a.shape[-1]} must equal B's rows k1 = {bs[0].shape[0]}")
    if c.ndim != 2 or c.shape[0] != bs[0].shape[1]:
        raise ValueError(f"c has shape {c.shape}; expected [k2/p, n] with k2/p = {bs[0].shape[1]}")
    return _metp(a, bs, biases, c, f, axis_name)


def _products(a: jax.Array, bs: Sequence[jax.Array], biases: Sequence[jax.Array]):
    """T_ij = A_i B^(j) (+ β^(j)), fp32."""
    t = [mm(a, b_j) for b_j in bs]
    return [t_r + beta.astype(jnp.float32) for t_r, beta in zip(t, biases)] if biases else t


def metp_forward(
    a: jax.Array,
    bs: tuple[jax.Array, ...],
    biases: tuple[jax.Array, ...],
    c: jax.Array,
    f: Callable[..., jax.Array],
    axis_name: str,
) -> jax.Array:
    """Algorithm 1 (the forward ring, without `metp`'s checks and custom VJP): a [..., k1], the B blocks
    [k1, k2/p] with their biases [k2/p] (or ()), c [k2/p, n]. Returns O_i fp32 [..., n]."""
    p = lax.axis_size(axis_name)

    def step(o: jax.Array, blocks: tuple, j: jax.Array) -> jax.Array:
        bs_j, biases_j, c_j = blocks
        t = _products(a, bs_j, biases_j)  # T_ij = A_i B^(j)
        d = f(*t).astype(c_j.dtype)  # D_ij = f(T_ij)
        return o + mm(d, c_j)  # O_i += D_ij C^(j)

    o = jnp.zeros_like(a, jnp.float32, shape=a.shape[:-1] + (c.shape[1],))
    send = lambda blocks: send_to_next(blocks, axis_name, shift=FORWARD)
    return ring_steps(step, o, (bs, biases, c), p, send)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _metp(
    a: jax.Array,
    bs: tuple[jax.Array, ...],
    biases: tuple[jax.Array, ...],
    c: jax.Array,
    f: Callable[..., jax.Array],
    axis_name: str,
):
    return metp_forward(a, bs, biases, c, f, axis_name).astype(a.dtype)


def _metp_fwd(
    a: jax.Array,
    bs: tuple[jax.Array, ...],
    biases: tuple[jax.Array, ...],
    c: jax.Array,
    f: Callable[..., jax.Array],
    axis_name: str,
):
    return _metp(a, bs, biases, c, f, axis_name), (a, bs, biases, c)  # A_i (and the rank's own blocks) only


def _metp_bwd(f: Callable[..., jax.Array], axis_name: str, residuals: tuple, do: jax.Array):
    """Algorithm 2: recompute T, ΔB/ΔC accumulators travel with their blocks (p hops: home at the end).

    The blocks circulate transposed (Bᵀ, Cᵀ: the operands of ΔT Bᵀ and ΔO Cᵀ). Besides, at p = 2 both rings
    are the same permutation, and XLA would otherwise reuse the forward's first hop in the backward when both
    passes are in one program, holding the received blocks from forward to backward.
    """
    a, bs, biases, c = residuals
    p = lax.axis_size(axis_name)
    send = lambda tree: send_to_next(tree, axis_name, shift=BACKWARD)

    def step(carry: tuple, blocks: tuple, j: jax.Array) -> tuple:
        da, (dbs, dbiases, dc) = carry
        bts_j, biases_j, ct_j = blocks  # B^(j)ᵀ, β^(j), C^(j)ᵀ
        t = _products(a, [bt.T for bt in bts_j], biases_j)  # T_ij = A_i B^(j) (+ β^(j))  (fp32, as forward)
        d, f_vjp = jax.vjp(f, *t)  # D_ij = f(T_ij)
        dd = mm(do, ct_j)  # ΔD_ij = ΔO_i C^(j)ᵀ
        dc = dc + outer(d.astype(ct_j.dtype), do)  # ΔC^(j) += D_ijᵀ ΔO_i
        dt = [g.astype(a.dtype) for g in f_vjp(dd)]  # ΔT_ij = f'(T_ij) ⊙ ΔD_ij
        da = da + sum(mm(dt_r, bt) for dt_r, bt in zip(dt, bts_j))  # ΔA_i += ΔT_ij B^(j)ᵀ
        dbs = tuple(db + outer(a, dt_r) for db, dt_r in zip(dbs, dt))  # ΔB^(j) += A_iᵀ ΔT_ij
        dbiases = tuple(dbeta + row_sum(dt_r) for dbeta, dt_r in zip(dbiases, dt))  # Δβ^(j) += Σ_rows ΔT_ij
        return da, send((dbs, dbiases, dc))  # ΔB, Δβ, ΔC move on with their block

    zeros = lambda w: vary_like(jnp.zeros_like(w, jnp.float32), a)
    init = (
        jnp.zeros_like(a, jnp.float32),
        (tuple(zeros(b_) for b_ in bs), tuple(zeros(beta) for beta in biases), zeros(c)),
    )
    blocks = (tuple(b_.T for b_ in bs), biases, c.T)
    da, (dbs, dbiases, dc) = ring_steps(step, init, blocks, p, send)
    dbs = tuple(sum_like(db, b_).astype(b_.dtype) for db, b_ in zip(dbs, bs))
    dbiases = tuple(sum_like(g, beta).astype(beta.dtype) for g, beta in zip(dbiases, biases))
    return da.astype(a.dtype), dbs, dbiases, sum_like(dc, c).astype(c.dtype)


_metp.defvjp(_metp_fwd, _metp_bwd)


def metp_mlp(
    x: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    w_gate: jax.Array | None = None,
    *,
    activation: str = "gelu",
    axis_name: str = "tp",
    b_in: jax.Array | None = None,
    b_gate: jax.Array | None = None,
    b_out: jax.Array | None = None,
) -> jax.Array:
    """The FFN as METP (Eq. 2), inside `shard_map`.

    x: local [batch, s/p, hidden]; w_in (and w_gate for swiglu): local [hidden, ffn/p]; w_out: [ffn/p, hidden].
    gelu: gelu(x W_in) W_out; swiglu: (silu(x W_gate) ⊙ x W_in) W_out (both column blocks circulate).
    Optional biases: b_in, b_gate local [ffn/p] (circulate with their blocks), b_out [hidden] (added after).
    """
    check_activation(activation)
    if (w_gate is not None) != (activation == "swiglu"):
        raise ValueError(f"w_gate must be given exactly when activation == 'swiglu' (activation {activation!r})")
    if activation == "swiglu":
        biases = None if b_in is None else (b_gate, b_in)
        out = metp(x, (w_gate, w_in), w_out, f=swiglu, axis_name=axis_name, b_bias=biases)
    else:
        out = metp(x, w_in, w_out, f=gelu, axis_name=axis_name, b_bias=b_in)
    return add_bias(out, b_out)
