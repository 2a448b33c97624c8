"""Runs a schedule table inside a shard_map the caller owns: loss and gradients of a pipelined layer stack.

Each tick, every stage (device on the `pp` axis) looks up its action in the table and runs it with one
`lax.switch` (a stage-dependent index); then, outside the switch, the activations that the table says are sent
this tick go forward and the input gradients backward with `lax.ppermute`, whose source-target pairs are
exactly the stages that send (static per tick). What arrives is put in an inbox slot; residuals wait in slot
buffers between a micro-batch's forward and its backward:

  F   x = embed_fn(shared, mb) on the first virtual stage, else the inbox; y, saved = forward(chunk, x, mb);
      saved -> residual slot; on the last virtual stage (loss, aux) = loss_fn(shared, y, mb) and its vjp right
      away (the head's gradient is accumulated now, dy waits in the gradient inbox); else send y on.
  BW  dchunk, dx = backward(chunk, saved, dy, mb); accumulate dchunk; send dx back (first virtual stage:
      accumulate the embedding's gradient instead, from embed_fn's vjp recomputed there).
  B   dx, stash = backward_input(...); the W-only residuals and the stash wait for W.      (zero-bubble)
  W   dchunk = backward_weight(...); accumulate.                                           (zero-bubble)

Each branch declares how often its stages run it at its tick position (`jaxring.analysis.compiled.branch_runs`, counted
from the table), so the compiled program's collective counter counts the ring hops inside the stages' branches as
the devices run them, not every branch every tick.

Loop structure (see lowering.py): ticks whose send pattern repeats periodically run as one `fori_loop` over the
period; the others are unrolled. So the compiled program sends exactly what the schedule sends: 2·m activations
per stage boundary per step (v·m forward over each link for interleaved, (v-1)·m over the wrap-around link).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from jaxring.analysis.compiled import branch_runs
from jaxring.core.collectives import stage_local
from jaxring.core.vma import vary, varying_axes
from jaxring.parallel.pipeline.lowering import Branch, Lowered, Segment, lower
from jaxring.parallel.pipeline.schedules import BW, IDLE, B, F, Schedule, W
from jaxring.parallel.pipeline.stage_vjp import stage_vjp


def pipeline_loss_and_grads(
    schedule: Schedule,
    *,
    embed_fn: Callable,
    stage_fn: Callable,
    loss_fn: Callable,
    stage_params: Any,
    shared_params: Any,
    microbatches: Any,
    axis_name: str = "pp",
    data_axes: tuple[str, ...] | None = None,
    reduce_data_axes: bool = True,
    poison: bool = False,
    stage_permute: str | None = None,
) -> tuple[jax.Array, Any, Any, Any]:
    """Loss and gradients of `loss_fn(head(stage_fn^(v·p)(embed_fn(mb))))` summed over micro-batches, pipelined.

    Call inside `jax.shard_map` (check_vma=True or False) over a mesh with `axis_name` of size
    schedule.num_stages; other mesh axes may be present (the micro-batches split over data axes, stage_fn using
    tp / sp collectives): only `axis_name` carries the pipeline's traffic.

    Args:
      schedule: `make_schedule(name, pp, m, v)`.
      embed_fn(shared, mb) -> x: the first virtual stage's input (x: a pytree of arrays, e.g. [b, s, h]).
      stage_fn(chunk, x, mb) -> x: one chunk of layers (it scans its layers itself); x keeps shape and dtype.
      loss_fn(shared, x, mb) -> (loss_sum, aux): on the last virtual stage; aux a pytree of fp32 scalars.
        An auxiliary loss that should be trained (MoE balance) must be part of loss_sum; stage_fn can carry
        it to the head inside x.
      stage_params: this device's chunks, every leaf [v, layers_per_chunk, ...]; chunk c of pp rank s is
        virtual stage c·pp + s.
      shared_params: parameters outside the stack (embedding, final norm, head), replicated over `axis_name`.
      microbatches: pytree, every leaf [m, ...] (this device's share of the batch).
      data_axes: the mesh axes the batch is split over (the loss is a sum over them). Default: the axes the
        micro-batches vary over (other than `axis_name`), read from their types; with check_vma=False the types
        are empty, so name them here (default then: none).
      reduce_data_axes: sum loss, aux and gradients over the data axes once per step. False: leave them per
        device (varying over those axes) for the caller to reduce, e.g. with psum_scatter for ZeRO.
      poison: fill every buffer slot and unsent message with NaN (a debugging aid; a correct table never reads
        them, so results stay finite).
      stage_permute: how jaxring's point-to-point transfers inside stage_fn (ring attention's hops) reach only
        their stage's devices: "ppermute" or "all_to_all" (`jaxring.core.collectives`); default: all_to_all on the
        CPU backend, whose collective-permute waits for every device, else ppermute.

    Returns:
      (loss_sum, aux_sum, d_stage_params, d_shared_params): loss and aux summed over micro-batches (and, with
      reduce_data_axes, over the data axes), invariant over `axis_name`; d_stage_params like stage_params (this
      stage's chunks); d_shared_params like shared_params, summed over `axis_name` so every stage holds the
      total. Gradients have the varying axes of their parameters (plus the data axes when not reduced).
    """
    p, v, m = schedule.num_stages, schedule.virtual_stages, schedule.num_microbatches
    pp_size = lax.axis_size(axis_name)
    if pp_size != p:
        raise ValueError(f"schedule has {p} stages but mesh axis {axis_name!r} has size {pp_size}")
    for path, leaf in jax.tree_util.tree_leaves_with_path(stage_params):
        if leaf.ndim < 1 or leaf.shape[0] != v:
            raise ValueError(
                f"stage_params{jax.tree_util.keystr(path)} has shape {leaf.shape}; every leaf needs a "
                f"leading chunk dimension of virtual_stages = {v}"
            )
    for path, leaf in jax.tree_util.tree_leaves_with_path(microbatches):
        if leaf.ndim < 1 or leaf.shape[0] != m:
            raise ValueError(
                f"microbatches{jax.tree_util.keystr(path)} has shape {leaf.shape}; every leaf needs a "
                f"leading micro-batch dimension of num_microbatches = {m}"
            )
    lowered = lower(schedule)
    if stage_permute is None:
        stage_permute = "all_to_all" if jax.default_backend() == "cpu" else "ppermute"
    run = _Interpreter(
        lowered,
        embed_fn,
        stage_fn,
        loss_fn,
        stage_params,
        shared_params,
        microbatches,
        axis_name,
        data_axes,
        poison,
        stage_permute,
    )
    state = run.run()
    return run.finish(state, stage_params, shared_params, reduce_data_axes)


def _index(tree: Any, i: int | jax.Array):
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _read(buffers: list, slot: int | jax.Array) -> list:
    return [lax.dynamic_index_in_dim(b, slot, keepdims=False) for b in buffers]


def _write(buffers: list, slot: int | jax.Array, values: list) -> list:
    return [
        lax.dynamic_update_index_in_dim(b, vary(x.astype(b.dtype), varying_axes(b)), slot, 0)
        for b, x in zip(buffers, values)
    ]


def _vma(aval: jax.core.ShapedArray) -> frozenset:
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def _full(aval: jax.core.ShapedArray, count: int, fill: float, extra_vma: frozenset[str] = frozenset()):
    value = fill if jnp.issubdtype(aval.dtype, jnp.floating) else 0
    return vary(jnp.full((count, *aval.shape), value, aval.dtype), _vma(aval) | extra_vma)


class _Interpreter:
    def __init__(
        self,
        lowered: Lowered,
        embed_fn: Callable,
        stage_fn: Callable,
        loss_fn: Callable,
        stage_params: Any,
        shared_params: Any,
        microbatches: Any,
        axis_name: str,
        data_axes: tuple[str, ...] | None,
        poison: bool,
        stage_permute: str | None,
    ):
        self.lowered, self.schedule = lowered, lowered.schedule
        self.stage_permute = stage_permute
        self.embed_fn, self.stage_fn, self.loss_fn = embed_fn, stage_fn, loss_fn
        self.axis_name, self.fill = axis_name, float("nan") if poison else 0.0
        self.split = self.schedule.split_backward
        pp = frozenset({axis_name})
        # data axes: what the micro-batches vary over. Parameters are cast to vary over them too, so each
        # tick's gradient stays per device (no reduction per micro-batch); `finish` reduces once.
        # check_vma=False leaves every type empty: then nothing can be read from types, and `finish` reduces
        # over the pipeline axis (and the named data axes) unconditionally
        self.typed = axis_name in varying_axes(jax.tree.leaves(stage_params)[0])
        if data_axes is None:
            data_axes = frozenset().union(*(varying_axes(x) for x in jax.tree.leaves(microbatches)))
        self.data_axes = frozenset(data_axes) - pp
        self.stage_params = jax.tree.map(lambda a: vary(a, self.data_axes), stage_params)
        self.shared = jax.tree.map(lambda a: vary(a, self.data_axes | pp), shared_params)
        self.microbatches = jax.tree.map(lambda a: vary(a, pp), microbatches)
        self.stage = lax.axis_index(axis_name)
        self._trace_stage(pp)

    # ---- tracing the pieces once (types only; nothing here runs) ----
    def _trace_stage(self, pp: frozenset[str]):
        """Types of the activation (x), the residuals and the loss. Activations vary over what the embedding
        output varies over, the pipeline axis and the data axes (every leaf alike), and over whatever more
        stage_fn's output varies over (e.g. a sequence-parallel axis)."""
        mb0 = _index(self.microbatches, 0)
        chunk0 = _index(self.stage_params, 0)
        x_shape = jax.eval_shape(self.embed_fn, self.shared, mb0)
        x_vma = frozenset().union(*(_vma(a) for a in jax.make_jaxpr(self.embed_fn)(self.shared, mb0).out_avals))
        x_vma |= pp | self.data_axes
        for _ in range(3):

            def embed_x(shared: Any, mb: Any, x_vma: frozenset[str] = x_vma):
                return jax.tree.map(lambda a: vary(a, x_vma), self.embed_fn(shared, mb))

            x_avals = jax.make_jaxpr(embed_x)(self.shared, mb0).out_avals
            self.x_tree = jax.tree.structure(x_shape)
            with stage_local(self.axis_name, 0, self.stage_permute):
                self.vjp = stage_vjp(self.stage_fn, chunk0, self.x_tree.unflatten(x_avals), mb0, split=self.split)
            y_avals = self.vjp.fwd.out_avals[: len(x_avals)]
            y_vma = frozenset().union(*(_vma(y) for y in y_avals))
            if y_vma <= x_vma:
                break
            x_vma |= y_vma
        else:
            raise RuntimeError("could not find varying axes that stage_fn's output keeps")
        self.x_avals = x_avals
        self.x_vma = self.x_tree.unflatten([_vma(a) for a in x_avals])
        # one traced forward/backward per stage: its point-to-point collectives address that stage's devices
        self.vjps = [self.vjp]
        for s in range(1, self.schedule.num_stages):
            with stage_local(self.axis_name, s, self.stage_permute):
                self.vjps.append(
                    stage_vjp(self.stage_fn, chunk0, self.x_tree.unflatten(x_avals), mb0, split=self.split)
                )
        y_example = self.x_tree.unflatten(x_avals)
        loss_jaxpr, (_, self.aux_shape) = jax.make_jaxpr(self.loss_fn, return_shape=True)(self.shared, y_example, mb0)
        self.loss_avals = loss_jaxpr.out_avals
        if self.loss_avals[0].shape != ():
            raise ValueError(
                f"loss_fn must return (loss_sum, aux) with a scalar loss_sum; got loss_sum of shape "
                f"{self.loss_avals[0].shape}"
            )

    # ---- the state carried from tick to tick ----
    def init_state(self):
        # Every buffer is this stage's own state: typed as varying over the pipeline axis even when a traced
        # residual is not (an integer index computed from constants, say, is per stage inside the switch).
        slots, fill, pp = self.lowered.slots, self.fill, frozenset({self.axis_name})
        full = lambda a, count: _full(a, count, fill, pp)
        state = {"x": [full(a, slots["x"]) for a in self.x_avals], "dy": [full(a, slots["dy"]) for a in self.x_avals]}
        saved = self.vjp.saved_avals
        if self.split:
            sp = self.vjp.split
            state["res"] = [full(saved[i], slots["res"]) for i in sp.saved_b]
            state["wres"] = [full(saved[i], slots["wres"]) for i in sp.saved_w]
            state["stash"] = [full(a, slots["stash"]) for a in sp.stash_avals]
        else:
            state["res"] = [full(a, slots["res"]) for a in saved]
        state["d_stage"] = self._zeros_like(self.stage_params)
        state["d_shared"] = self._zeros_like(self.shared)
        state["loss"] = vary(jnp.zeros((), jnp.float32), self.loss_vma)
        state["aux"] = jax.tree.map(lambda a: vary(jnp.zeros(a.shape, jnp.float32), self.loss_vma), self.aux_shape)
        return state

    @staticmethod
    def _zeros_like(tree: Any):
        return jax.tree.map(lambda a: vary(jnp.zeros(a.shape, jnp.float32), varying_axes(a)), tree)

    @property
    def loss_vma(self):
        return frozenset().union(*(_vma(a) for a in self.loss_avals)) | {self.axis_name} | self.data_axes

    # ---- the actions ----
    # A branch gets the buffer slots its tick reads (read before the switch) and returns only small values:
    # slot contents to write back, messages, gradient contributions. Buffers and accumulators are updated
    # outside the switch: a conditional's outputs never share memory with its operands, so passing the buffers
    # through it would copy every buffer on every tick.
    def _chunk(self, c: int | jax.Array):
        if self.schedule.virtual_stages == 1:
            return jax.tree.map(lambda a: a[0], self.stage_params)
        return _index(self.stage_params, c)

    def _embed(self, shared: Any, mb: Any):
        return jax.tree.map(lambda a, e: vary(a, e), self.embed_fn(shared, mb), self.x_vma)

    def _embed_grad(self, mb: Any, dx_leaves: list[jax.Array]):
        """The embedding's gradient on the first virtual stage: embed_fn's vjp, recomputed (a lookup)."""
        _, embed_vjp = jax.vjp(lambda shared: self._embed(shared, mb), self.shared)
        return embed_vjp(self.x_tree.unflatten(dx_leaves))[0]

    def _nothing(self):
        return [
            vary(jnp.full(a.shape, self.fill if jnp.issubdtype(a.dtype, jnp.floating) else 0, a.dtype), _vma(a))
            for a in self.x_avals
        ]

    def _stage_grads(self, grads: dict):
        """{chunk leaf index: gradient} -> a full chunk gradient (fp32, zeros elsewhere)."""
        return [
            vary(grads[j].astype(jnp.float32), varying_axes(a))
            if j in grads
            else vary(jnp.zeros(a.shape[1:], jnp.float32), varying_axes(a))
            for j, a in enumerate(jax.tree.leaves(self.stage_params))
        ]

    def _action(self, branch: Branch):
        """The switch branch for `branch`: (slots read, fields) -> {output name: value} (what it produces)."""
        vjp = self.vjps[max(branch.stage, 0)]
        split = vjp.split

        def idle(read: dict[str, list[jax.Array]], f: dict[str, jax.Array]):
            return {}

        def forward(read: dict[str, list[jax.Array]], f: dict[str, jax.Array]):
            mb = _index(self.microbatches, f["mb"])
            chunk = jax.tree.leaves(self._chunk(f["chunk"]))
            x = jax.tree.leaves(self._embed(self.shared, mb)) if branch.first else read["x"]
            y, saved = vjp.forward(chunk, x, jax.tree.leaves(mb))
            if self.split:
                out = {"res": [saved[i] for i in split.saved_b], "wres": [saved[i] for i in split.saved_w]}
            else:
                out = {"res": saved}
            if not branch.last:
                return {**out, "send_f": y}
            (loss, loss_vjp, aux) = jax.vjp(
                lambda shared, y_: self.loss_fn(shared, y_, mb), self.shared, self.x_tree.unflatten(y), has_aux=True
            )
            d_shared, dy = loss_vjp(jnp.ones_like(loss))
            return {**out, "d_shared": d_shared, "loss": (loss, aux), "dy": jax.tree.leaves(dy)}

        def backward(read: dict[str, list[jax.Array]], f: dict[str, jax.Array]):  # BW (whole) or B (input gradient)
            mb = _index(self.microbatches, f["mb"])
            chunk = jax.tree.leaves(self._chunk(f["chunk"]))
            if branch.kind == BW:
                dchunk, dx = vjp.backward(chunk, read["res"], read["dy"], jax.tree.leaves(mb))
                out = {"d_stage": self._stage_grads(dict(enumerate(dchunk)))}
            else:
                dx, stash, early = split.backward_input(chunk, read["res"], read["dy"], jax.tree.leaves(mb))
                out = {"d_stage": self._stage_grads(early), "stash": stash}
            if branch.first:
                return {**out, "d_shared": self._embed_grad(mb, dx)}
            return {**out, "send_b": dx}

        def weight(read: dict[str, list[jax.Array]], f: dict[str, jax.Array]):  # W
            mb = _index(self.microbatches, f["mb"])
            chunk = jax.tree.leaves(self._chunk(f["chunk"]))
            late = split.backward_weight(chunk, read["wres"], read["stash"], jax.tree.leaves(mb))
            return {"d_stage": self._stage_grads(late)}

        return {IDLE: idle, F: forward, B: backward, BW: backward, W: weight}[branch.kind]

    # ---- ticks ----
    _SLOT: ClassVar[dict[str, str]] = {
        "x": "x_slot",
        "dy": "dy_slot",
        "res": "res_slot",
        "wres": "wres_slot",
        "stash": "stash_slot",
    }

    def _tick(
        self,
        state: dict[str, Any],
        t: int | jax.Array,
        branches: list[Branch],
        fwd_pairs: tuple[tuple[int, int], ...],
        bwd_pairs: tuple[tuple[int, int], ...],
        runs: list[int],
    ):
        """One tick: `branches` are what the stages run at this tick position, branch i on runs[i] of the
        (tick, stage) pairs the position stands for (the counts declared to the collective counter)."""
        row = self.table[t, self.stage]
        f = {
            name: row[self.lowered.field(name)]
            for name in (
                "branch",
                "mb",
                "chunk",
                "x_slot",
                "dy_slot",
                "res_slot",
                "wres_slot",
                "stash_slot",
                "recv_x_slot",
                "recv_dy_slot",
            )
        }
        kinds = {b.kind for b in branches}
        # which buffers this tick position reads (r) and writes (w), and which results it produces: static
        reads = {"x"} if any(b.kind == F and not b.first for b in branches) else set()
        writes = set()
        if F in kinds:
            writes |= {"res", "wres"} if self.split else {"res"}
        if any(b.kind == F and b.last for b in branches):
            writes.add("dy")
        if B in kinds:
            writes.add("stash")
        if kinds & {B, BW}:
            reads |= {"res", "dy"}
        if W in kinds:
            reads |= {"wres", "stash"}
        produced = set(writes)
        produced |= {"send_f"} if fwd_pairs else set()
        produced |= {"send_b"} if bwd_pairs else set()
        if kinds & {B, BW, W}:
            produced.add("d_stage")
        if any((b.kind == F and b.last) or (b.kind in (B, BW) and b.first) for b in branches):
            produced.add("d_shared")
        if any(b.kind == F and b.last for b in branches):
            produced.add("loss")
        slot = {name: jnp.maximum(f[self._SLOT[name]], 0) for name in reads | writes}
        read = {name: _read(state[name], slot[name]) for name in reads | writes}

        def complete(action: Callable[[dict, dict], dict]):
            """Runs a branch and fills in what it does not produce: a written slot keeps its content, messages
            are `fill`, contributions zero; every value cast to one type across branches."""

            def run(read: dict[str, list[jax.Array]], f: dict[str, jax.Array]):
                out = action(read, f)
                result = {}
                for name in sorted(produced):
                    if name in writes:
                        value = out.get(name, read[name])
                        result[name] = [vary(v, varying_axes(b)) for v, b in zip(value, read[name])]
                    elif name in ("send_f", "send_b"):
                        result[name] = [
                            vary(v, _vma(a)) for v, a in zip(out.get(name) or self._nothing(), self.x_avals)
                        ]
                    elif name == "d_stage":
                        result[name] = out.get(name) or self._stage_grads({})
                    elif name == "d_shared":
                        zeros = self._zeros_like(self.shared)
                        result[name] = jax.tree.map(
                            lambda g, z: vary(g.astype(jnp.float32), varying_axes(z)), out.get(name, zeros), zeros
                        )
                    elif name == "loss":
                        loss, aux = out.get(
                            name,
                            (jnp.zeros((), jnp.float32), jax.tree.map(lambda a: jnp.zeros(a.shape), self.aux_shape)),
                        )
                        result[name] = jax.tree.map(lambda a: vary(a.astype(jnp.float32), self.loss_vma), (loss, aux))
                return result

            return run

        def on_stage(action: Callable[[dict, dict], dict], stage: int, k: int):
            """Traced as stage `stage`'s own branch (its collectives address that stage's devices), declaring
            how often it runs (`branch_runs`: the counter weights its collectives by it)."""

            def run(read: dict[str, list[jax.Array]], f: dict[str, jax.Array]):
                with branch_runs(k, sum(runs)):
                    if stage < 0:
                        return action(read, f)
                    with stage_local(self.axis_name, stage, self.stage_permute):
                        return action(read, f)

            return run

        actions = [on_stage(complete(self._action(b)), b.stage, k) for b, k in zip(branches, runs)]
        out = actions[0](read, f) if len(actions) == 1 else lax.switch(f["branch"], actions, read, f)

        state = dict(state)
        for name in writes:
            state[name] = _write(state[name], slot[name], out[name])
        if "d_stage" in produced:
            state["d_stage"] = self._accumulate_stage(state["d_stage"], jnp.maximum(f["chunk"], 0), out["d_stage"])
        if "d_shared" in produced:
            state["d_shared"] = jax.tree.map(jnp.add, state["d_shared"], out["d_shared"])
        if "loss" in produced:
            loss, aux = out["loss"]
            state["loss"] = state["loss"] + loss
            state["aux"] = jax.tree.map(jnp.add, state["aux"], aux)
        for pairs, message, inbox, recv in (
            (fwd_pairs, "send_f", "x", "recv_x_slot"),
            (bwd_pairs, "send_b", "dy", "recv_dy_slot"),
        ):
            if pairs:
                received = [lax.ppermute(a, self.axis_name, list(pairs)) for a in out[message]]
                state[inbox] = self._receive(state[inbox], f[recv], received)
        return state

    def _accumulate_stage(self, acc_tree: Any, c: jax.Array, grads: list):
        leaves, tree = jax.tree.flatten(acc_tree)
        if self.schedule.virtual_stages == 1:
            leaves = [acc.at[0].add(g) for acc, g in zip(leaves, grads)]
        else:
            leaves = [
                lax.dynamic_update_index_in_dim(acc, lax.dynamic_index_in_dim(acc, c, keepdims=False) + g, c, 0)
                for acc, g in zip(leaves, grads)
            ]
        return tree.unflatten(leaves)

    @staticmethod
    def _receive(buffers: list[jax.Array], slot: jax.Array, received: list[jax.Array]):
        valid = slot >= 0
        slot = jnp.maximum(slot, 0)
        old = _read(buffers, slot)
        return _write(buffers, slot, [jnp.where(valid, vary(r, varying_axes(o)), o) for r, o in zip(received, old)])

    def run(self):
        self.table = jnp.asarray(self.lowered.fields)
        lowered = self.lowered
        state = self.init_state()
        for seg in lowered.segments:

            def period(state: dict[str, Any], r: int | jax.Array, seg: Segment = seg):
                for j in range(seg.period):
                    t0 = seg.start + j
                    t = t0 if isinstance(r, int) else t0 + r * seg.period
                    ticks = lowered.fields[t0 : seg.start + seg.period * seg.repeats : seg.period]
                    index = ticks[:, :, lowered.field("branch")]
                    runs = [int((index == i).sum()) for i in range(len(seg.branches[j]))]
                    state = self._tick(state, t, seg.branches[j], lowered.fwd_pairs[t0], lowered.bwd_pairs[t0], runs)
                return state

            if seg.repeats == 1:
                state = period(state, 0)
            else:
                state = lax.fori_loop(0, seg.repeats, lambda r, s: period(s, r), state)
        return state

    def finish(self, state: dict[str, Any], stage_params: Any, shared_params: Any, reduce_data_axes: bool):
        pp = frozenset({self.axis_name})
        data = self.data_axes if reduce_data_axes else frozenset()

        def reduce(g: jax.Array, like: jax.Array, axes: frozenset[str]):
            axes = tuple(sorted(axes & varying_axes(g) if self.typed else axes))
            g = lax.psum(g, axes) if axes else g
            return g.astype(like.dtype)

        d_stage = jax.tree.map(lambda g, a: reduce(g, a, data - varying_axes(a)), state["d_stage"], stage_params)
        d_shared = jax.tree.map(
            lambda g, a: reduce(g, a, (data | pp) - varying_axes(a)), state["d_shared"], shared_params
        )
        loss = reduce(state["loss"], state["loss"], data | pp)
        aux = jax.tree.map(lambda a: reduce(a, a, data | pp), state["aux"])
        return loss, aux, d_stage, d_shared
