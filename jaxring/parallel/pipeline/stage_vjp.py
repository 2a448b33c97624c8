"""One pipeline chunk's forward with the residuals its backward needs, and that backward: whole, or split into
B (input gradient) and W (weight gradient) as zero-bubble schedules need.

The pipeline runs a chunk's forward at one tick and its backward ticks later, so what `jax.vjp` keeps in its
closure must be stored between them. This module turns `stage_fn(chunk, x, mb) -> y` into jaxprs (traced once,
inside the caller's shard_map, so collectives and varying axes are those of the real program):

  forward(chunk, x, mb)             -> y, saved          saved: the residual leaves that depend on x or mb
  backward(chunk, saved, dy, mb)    -> dchunk, dx        the whole backward (gpipe, 1f1b, interleaved)
  backward_input(chunk, saved_b, dy, mb)   -> dx, stash, early dchunk leaves          (B)
  backward_weight(chunk, saved_w, stash, mb) -> late dchunk leaves                    (W)

Residuals that depend only on the chunk's parameters (the weights themselves, their casts) are not stored per
micro-batch: the backward recomputes them from the parameters (a cast at most; usually they are the parameters).

The B/W split is jax's own partial evaluator (`compat.partial_eval_jaxpr`, the machinery of `jax.linearize`)
run on the backward jaxpr with the "W-only" residuals (those the input gradient does not read, e.g. each
matmul's input) marked unknown: everything that does not need them (the whole input-gradient chain) is B; what
does (the weight-gradient matmuls) is W, and the values W needs from B (the gradients at each layer's matmul
outputs, stacked over a scanned layer stack) become the `stash` that B hands to W. No work is repeated: B + W
is exactly the whole backward, as in the zero-bubble paper (Qi et al. 2023, section 2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxring.core import compat
from jaxring.core.compat import ClosedJaxpr


def _used_inputs(jaxpr: Any, used_outputs: Sequence[bool]) -> list[bool]:
    return compat.dce_jaxpr(jaxpr, list(used_outputs))[1]


def _pick(values: Sequence, flags: Sequence[bool]) -> list:
    return [v for v, f in zip(values, flags) if f]


@dataclasses.dataclass
class StageVJP:
    """A chunk's forward and backward as jaxprs over flat leaves; see the module docstring.

    Built by `stage_vjp(...)`. Leaves are flat lists: chunk (parameters of one chunk), x / y / dy (the activation
    pytree passed between stages), mb (one micro-batch).
    """

    x_tree: Any
    chunk_tree: Any
    saved_avals: list  # residuals stored from F until the backward, per micro-batch
    fwd: ClosedJaxpr  # (chunk, x, mb) -> (y, saved)
    bwd: ClosedJaxpr  # (used inputs of chunk, saved, dy, mb) -> (dchunk, dx)
    bwd_used: list[bool]  # which of (chunk, saved, dy, mb) bwd reads
    split: SplitBackward | None = None

    def forward(self, chunk: list, x: list, mb: list) -> tuple[list, list]:
        out = compat.eval_closed_jaxpr(self.fwd, [*chunk, *x, *mb])
        nx = len(x)
        return out[:nx], out[nx:]

    def backward(self, chunk: list, saved: list, dy: list, mb: list) -> tuple[list, list]:
        out = compat.eval_closed_jaxpr(self.bwd, _pick([*chunk, *saved, *dy, *mb], self.bwd_used))
        nc = len(chunk)
        return out[:nc], out[nc:]


@dataclasses.dataclass
class SplitBackward:
    """The backward split into B and W (zero-bubble). Indices refer to `StageVJP.saved` and the chunk's leaves."""

    saved_b: list[int]  # residuals B reads (freed after B)
    saved_w: list[int]  # residuals only W reads (kept until W)
    early_leaves: list[int]  # chunk leaves whose gradient B already produces (e.g. a bias: sum of dy)
    late_leaves: list[int]  # chunk leaves whose gradient W produces
    stash_avals: list  # what B hands to W, per micro-batch
    b_jaxpr: ClosedJaxpr  # known inputs -> (known outputs, residuals)
    b_inputs: list[tuple[str, int]]  # ("chunk"|"saved"|"dy"|"mb", index) per input of b_jaxpr
    b_dx: list[int]  # positions of dx leaves among b_jaxpr's known outputs
    b_early: list[int]  # positions of early dchunk leaves among them
    n_known_out: int
    stash_from: list[int]  # positions (among b_jaxpr's residual outputs) stored in the stash
    w_jaxpr: ClosedJaxpr  # (residuals, unknown inputs) -> late dchunk leaves
    w_residuals: list[tuple[str, Any]]  # per residual input of w_jaxpr: ("stash", i) | ("chunk", i) | ("mb", i)
    # | ("const", value)
    w_unknown_inputs: list[int]  # saved indices of w_jaxpr's unknown inputs (in order)

    def backward_input(self, chunk: list, saved_b: list, dy: list, mb: list) -> tuple[list, list, list]:
        """B: -> (dx leaves, stash leaves, {chunk leaf index: gradient} for the early leaves)."""
        saved = dict(zip(self.saved_b, saved_b))
        source = {"chunk": chunk, "dy": dy, "mb": mb}
        args = [saved[i] if kind == "saved" else source[kind][i] for kind, i in self.b_inputs]
        out = compat.eval_closed_jaxpr(self.b_jaxpr, args)
        known, residuals = out[: self.n_known_out], out[self.n_known_out :]
        dx = [known[i] for i in self.b_dx]
        early = {leaf: known[i] for leaf, i in zip(self.early_leaves, self.b_early)}
        return dx, [residuals[i] for i in self.stash_from], early

    def backward_weight(self, chunk: list, saved_w: list, stash: list, mb: list) -> dict:
        """W: -> {chunk leaf index: gradient} for the late leaves."""
        saved = dict(zip(self.saved_w, saved_w))
        source = {"stash": stash, "chunk": chunk, "mb": mb}
        residuals = [value if kind == "const" else source[kind][value] for kind, value in self.w_residuals]
        out = compat.eval_closed_jaxpr(self.w_jaxpr, [*residuals, *(saved[i] for i in self.w_unknown_inputs)])
        return dict(zip(self.late_leaves, out))


def stage_vjp(stage_fn: Callable, chunk: Any, x: Any, mb: Any, *, split: bool) -> StageVJP:
    """Traces `stage_fn(chunk, x, mb) -> y` (y like x) at these example values (tracers inside shard_map are fine;
    only their types are used) into a `StageVJP`; `split=True` also builds the B/W split."""
    chunk_leaves, chunk_tree = jax.tree.flatten(chunk)
    x_leaves, x_tree = jax.tree.flatten(x)
    mb_leaves, mb_tree = jax.tree.flatten(mb)
    nc, nx, nm = len(chunk_leaves), len(x_leaves), len(mb_leaves)
    rebuild = lambda c, xs, ms: (chunk_tree.unflatten(c), x_tree.unflatten(xs), mb_tree.unflatten(ms))

    def fwd_all(c: Any, xs: Any, ms: Any) -> tuple[list, list]:
        chunk_, x_, mb_ = rebuild(c, xs, ms)
        y, vjp_fn = jax.vjp(lambda c_, x__: stage_fn(c_, x__, mb_), chunk_, x_)
        y_leaves, y_tree = jax.tree.flatten(y)
        if y_tree != x_tree:
            raise ValueError(f"stage_fn must return its input's structure; got {y_tree}, expected {x_tree}")
        return y_leaves, jax.tree.leaves(vjp_fn)

    full = jax.make_jaxpr(fwd_all)(chunk_leaves, x_leaves, mb_leaves)
    n_res = len(full.out_avals) - nx
    for got, want in zip(full.out_avals[:nx], x_leaves):
        if got.shape != want.shape or got.dtype != want.dtype:
            raise ValueError(
                f"stage_fn must keep the activation's shape and dtype: {want.shape} {want.dtype} "
                f"in, {got.shape} {got.dtype} out"
            )
    # a residual is stored per micro-batch when it depends on the activation or the micro-batch
    saved_idx = []
    for k in range(n_res):
        used = _used_inputs(full.jaxpr, [False] * nx + [j == k for j in range(n_res)])
        if any(used[nc:]):
            saved_idx.append(k)
    keep = [True] * nx + [k in saved_idx for k in range(n_res)]
    fwd = compat.close_jaxpr(compat.dce_jaxpr(full.jaxpr, keep, instantiate=True)[0], full.consts)
    saved_avals = [full.out_avals[nx + k] for k in saved_idx]

    def bwd_all(c: Any, saved: list, dys: list, ms: Any, x_like: Any) -> tuple[list, list]:
        chunk_, x_, mb_ = rebuild(c, x_like, ms)
        _, vjp_fn = jax.vjp(lambda c_, x__: stage_fn(c_, x__, mb_), chunk_, x_)
        leaves, tree = jax.tree.flatten(vjp_fn)
        if len(leaves) != n_res:
            raise RuntimeError("stage_fn traced to a different residual structure twice")
        for k, value in zip(saved_idx, saved):
            leaves[k] = value
        dchunk, dx = tree.unflatten(leaves)(x_tree.unflatten(dys))
        return jax.tree.leaves(dchunk), jax.tree.leaves(dx)

    y_avals = full.out_avals[:nx]
    bwd_full = jax.make_jaxpr(bwd_all)(chunk_leaves, saved_avals, y_avals, mb_leaves, x_leaves)
    bwd_jaxpr, used = compat.dce_jaxpr(bwd_full.jaxpr, [True] * len(bwd_full.out_avals))
    n_in = nc + len(saved_idx) + nx + nm
    if any(used[n_in:]):
        raise RuntimeError("the backward still reads the forward's input after its residuals were substituted")
    bwd_used = used[:n_in]
    bwd = compat.close_jaxpr(bwd_jaxpr, bwd_full.consts)
    result = StageVJP(x_tree, chunk_tree, saved_avals, fwd, bwd, bwd_used)
    if split:
        result.split = _split(bwd, bwd_used, nc, len(saved_idx), nx, nm)
    return result


def _split(bwd: ClosedJaxpr, bwd_used: list[bool], nc: int, ns: int, nx: int, nm: int) -> SplitBackward:
    """B/W split of the backward jaxpr (inputs: the used ones of chunk, saved, dy, mb; outputs: dchunk, dx)."""
    names = (
        [("chunk", i) for i in range(nc)]
        + [("saved", i) for i in range(ns)]
        + [("dy", i) for i in range(nx)]
        + [("mb", i) for i in range(nm)]
    )
    inputs = _pick(names, bwd_used)
    n_out = len(bwd.out_avals)  # nc dchunk leaves, then nx dx leaves
    reads_b = _used_inputs(bwd.jaxpr, [j >= nc for j in range(n_out)])
    saved_b = sorted(i for (kind, i), r in zip(inputs, reads_b) if kind == "saved" and r)
    saved_w = sorted(i for (kind, i), r in zip(inputs, reads_b) if kind == "saved" and not r)
    unknowns = [kind == "saved" and i in saved_w for kind, i in inputs]
    b_jaxpr, w_jaxpr, out_unknowns, _ = compat.partial_eval_jaxpr(bwd, unknowns, instantiate=False)
    if any(out_unknowns[nc:]):
        raise RuntimeError("the input gradient depends on a residual the dce said it does not read")
    known_positions = [j for j, u in enumerate(out_unknowns) if not u]
    pos = {j: k for k, j in enumerate(known_positions)}
    early_leaves = [j for j in range(nc) if not out_unknowns[j]]
    late_leaves = [j for j in range(nc) if out_unknowns[j]]
    n_known_out = len(known_positions)
    b_inputs = [name for name, u in zip(inputs, unknowns) if not u]
    w_unknown_inputs = [i for (kind, i), u in zip(inputs, unknowns) if u]
    # classify B's residual outputs: forwarded inputs that W can read itself (chunk, mb), constants, or stash
    jaxpr = b_jaxpr.jaxpr
    invar_pos = {v: k for k, v in enumerate(jaxpr.invars)}
    const_pos = {v: k for k, v in enumerate(jaxpr.constvars)}
    w_residuals, stash_from, stash_avals = [], [], []
    for r, var in enumerate(jaxpr.outvars[n_known_out:]):
        if compat.is_literal(var):
            w_residuals.append(("const", var.val))
        elif var in const_pos:
            w_residuals.append(("const", b_jaxpr.consts[const_pos[var]]))
        elif var in invar_pos and b_inputs[invar_pos[var]][0] in ("chunk", "mb"):
            w_residuals.append(b_inputs[invar_pos[var]])
        else:
            w_residuals.append(("stash", len(stash_from)))
            stash_from.append(r)
            stash_avals.append(var.aval)
    return SplitBackward(
        saved_b,
        saved_w,
        early_leaves,
        late_leaves,
        stash_avals,
        b_jaxpr,
        b_inputs,
        [pos[nc + i] for i in range(nx)],
        [pos[j] for j in early_leaves],
        n_known_out,
        stash_from,
        w_jaxpr,
        w_residuals,
        w_unknown_inputs,
    )
