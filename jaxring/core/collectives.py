"""Ring communication shared by every ring-based strategy (used inside `shard_map`).

Every point-to-point transfer in jaxring goes through `ppermute` here, because inside a pipeline stage's branch
(`stage_local`: the pipeline's `lax.switch` runs different code on different stages) a plain ppermute over sp
is one collective-permute over the pairs of *every* stage, which the other stages, running other branches,
never join. There `ppermute` addresses only the stage's own devices:

  "ppermute"    a collective-permute whose pairs name only this stage's devices (GPU: only they join it);
  "all_to_all"  XLA:CPU, whose collective-permute waits for every device of the program whatever its pairs:
                an all-to-all over the stage's group (grouped collectives meet per group) carrying the block to
                its target and zeros elsewhere: the same result, (N-1) times the bytes of the ring hop.

XLA:CPU runs each simulated device's program on its own thread and a collective waits, blocking, for every
device's thread. A loop holding collectives (a ring) that is independent of a collective issued beside it
in the same loop body (the next head group's weight broadcast in METP's outer loop, issued before this
group's inner ring) may then run in one order on some devices and in the other on the rest: each side waits
at a different collective for ever (notebook 02's METP attention at tp=8, seq 1024, hidden 256 aborted on
its first run, the threads waiting at two different permutes). On CPU `prefetch_steps` therefore makes each
step's compute wait for the transfer issued before it (`waits_for`: a data dependency, free on the wire;
GPU/TPU programs are unchanged and keep their overlap); tests/unit/core/test_cpu_collectives.py checks the compiled
programs for such independent pairs and runs them repeatedly.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxring.core import compat
from jaxring.core.vma import vary, varying_axes

# The pipeline stage being traced, set only inside `stage_local` (a context manager the pipeline interpreter
# enters around each stage's branch, jaxring/parallel/pipeline/interpreter.py) and reset when it exits: an explicit,
# lexically scoped setting of how `ppermute` addresses devices while that branch is traced, never global.
_STAGE = contextvars.ContextVar("jaxring_pipeline_stage", default=None)


_CPU_LOWERING = []  # set once the CPU lowering below is registered


def own_channel_per_cpu_permute() -> bool:
    """On CPU, lower every collective-permute with a channel id of its own (idempotent). Returns whether the
    lowering is in place (False: JAX's internals moved, its own lowering stays).

    Not done on import: it replaces JAX's CPU lowering of `ppermute` for the whole process, so the entry
    points that simulate devices ask for it (`jaxring.core.device_setup.use_simulated_devices`, called by
    `use_cpu_devices_if_no_accelerator`: train.py, the notebooks, the benchmarks; tests/conftest.py).

    Why: inside shard_map JAX gives every collective the same channel id (1), and XLA:CPU keys the in-process
    rendezvous of a collective-permute by it: two different permutes in quick succession (METP's tree rounds,
    a ring's K, V and positions) can meet in one rendezvous, which aborts the process ("Check failed:
    state.use_count() == num_threads") or mixes their data. Seen in the METP tp=8 train step, 3 runs of 5 at
    30 steps; none in 11 with this lowering. Only the channel ids change: same transfers, same bytes. (The private
    JAX modules it needs are behind `jaxring.core.compat`.)
    """
    if not _CPU_LOWERING:
        _CPU_LOWERING.append(compat.register_cpu_ppermute_lowering_with_own_channels())
    return _CPU_LOWERING[0]


STAGE_PERMUTES = ("ppermute", "all_to_all")


@contextlib.contextmanager
def stage_local(axis_name: str, stage: int, permute: str = "ppermute") -> Iterator[None]:
    """While tracing the branch of pipeline stage `stage` (rank on `axis_name`): point-to-point transfers
    (`ppermute`) involve only the devices of that stage, as a stage-local collective-permute or an all-to-all
    (`permute`, see the module docstring)."""
    if permute not in STAGE_PERMUTES:
        raise ValueError(f"stage permute {permute!r} must be one of {', '.join(STAGE_PERMUTES)}")
    token = _STAGE.set((axis_name, stage, permute))
    try:
        yield
    finally:
        _STAGE.reset(token)


def ppermute(x: jax.Array, axis_name: str | tuple[str, ...], perm: Sequence[tuple[int, int]]) -> jax.Array:
    """`lax.ppermute`, or inside `stage_local` the same transfers among this pipeline stage's devices only."""
    stage = _STAGE.get()
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    if stage is None or stage[0] in axes:
        return lax.ppermute(x, axis_name, perm)
    pipeline_axis, s, how = stage
    if how == "all_to_all":
        return _permute_by_all_to_all(x, axes, perm)
    n = math.prod(lax.axis_size(a) for a in axes)
    pairs = [(s * n + src, s * n + dst) for src, dst in perm]
    return lax.ppermute(vary(x, (pipeline_axis,)), (pipeline_axis, *axes), pairs)


def _permute_by_all_to_all(x: jax.Array, axes: tuple[str, ...], perm: Sequence[tuple[int, int]]) -> jax.Array:
    """lax.ppermute(x, axes, perm) as one all-to-all over `axes`: every device sends x in the chunk of its
    target (zeros in the others) and keeps the chunk from its source (zeros without one)."""
    n = math.prod(lax.axis_size(a) for a in axes)
    target, source = np.full(n, -1, np.int32), np.full(n, -1, np.int32)
    for src, dst in perm:
        target[src], source[dst] = dst, src
    me = lax.axis_index(axes)
    to, fr = jnp.asarray(target)[me], jnp.asarray(source)[me]
    chunks = jnp.zeros((n,) + x.shape, x.dtype)
    chunks = jnp.where(to >= 0, lax.dynamic_update_index_in_dim(chunks, x, jnp.maximum(to, 0), 0), chunks)
    received = lax.all_to_all(vary(chunks, axes), axes, 0, 0, tiled=True)
    out = lax.dynamic_index_in_dim(received, jnp.maximum(fr, 0), 0, keepdims=False)
    return jnp.where(fr >= 0, out, jnp.zeros_like(out))


# One direction convention for every ring in jaxring (attention, RSA, WallFacer, METP): forward passes send
# to the next rank (r -> r+1), backward passes the other way. Either is correct; a backward permutation unlike
# the forward's also keeps XLA from merging a backward hop with the forward's when both passes are in one
# program (that would hold every received block from forward to backward).
FORWARD, BACKWARD = 1, -1


def _bits32(x: jax.Array) -> jax.Array:
    """One element of `x` (its first) as an opaque uint32: its bit pattern (XLA cannot know its value)."""
    x = x.reshape(-1)[0]
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = x.dtype.itemsize
    if size == 8:
        return lax.bitcast_convert_type(x, jnp.uint32)[0]
    as_uint = lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * size}"))
    return as_uint.astype(jnp.uint32)


def _waits_for(tree: Any, after: Any) -> Any:
    sources = [(varying_axes(a), _bits32(a)) for a in jax.tree.leaves(after) if a is not None and a.size]

    def one(x: jax.Array | None) -> jax.Array | None:
        if x is None:
            return x
        axes = varying_axes(x)  # (inside shard_map the result must vary over x's axes only)
        bits = [b for over, b in sources if over <= axes]
        if not bits:
            return x
        never = (functools.reduce(lambda a, b: a ^ b, bits) | 1) == 0  # false, but XLA cannot tell
        return jnp.where(never, jnp.zeros_like(x), x)

    return jax.tree.map(one, tree)


def waits_for(tree: Any, after: Any) -> Any:
    """`tree` unchanged, but on CPU every array of it data-depends on the arrays of `after` (those varying over
    no more mesh axes than it does): what uses it waits for them. GPU/TPU: the identity. Why: the module
    docstring (XLA:CPU's blocking collectives)."""
    return lax.platform_dependent(tree, after, cpu=_waits_for, default=lambda t, a: t)


def prefetch_steps(
    step_fn: Callable[[Any, Any, Any], Any],
    carry: Any,
    first: Any,
    advance: Callable[[Any, Any], Any],
    num_steps: int,
    compute_communicates: bool = True,
) -> Any:
    """for s in 0..n-1: carry = step_fn(carry, data_s, s), with data_0 = first and data_{s+1} = advance(data_s,
    s) issued before step s's compute (a ring hop, a broadcast of the next block), so the two can overlap.

    A `lax.scan` over the first n-1 steps and the last step on its own: a step's transfer cannot be hoisted
    out of its iteration, so a device holds the current and the next block only (not all n), and exactly n-1
    transfers are made. Returns the final carry. The step loop of every ring and broadcast loop in jaxring.

    compute_communicates: `step_fn` holds collectives, so on XLA:CPU it waits for the transfer issued before
    it (`waits_for`, the module docstring). False for a step that only computes (Optimus' C += A_il B_lj):
    nothing to order, and the guard's copy of the step's data (one block of A and of B) is not made.
    """

    def body(state: tuple, s: jax.Array) -> tuple:
        carry, data = state
        upcoming = advance(data, s)  # issued before this step's compute
        if compute_communicates:
            carry, data = waits_for((carry, data), upcoming)  # XLA:CPU: see the module docstring
        return (step_fn(carry, data, s), upcoming), None

    data = first
    if num_steps > 1:
        (carry, data), _ = lax.scan(body, (carry, data), jnp.arange(num_steps - 1))
    return step_fn(carry, data, num_steps - 1)


def ring_pairs(size: int, shift: int = FORWARD) -> list[tuple[int, int]]:
    """ppermute pairs sending rank i to rank (i + shift) % size."""
    return [(i, (i + shift) % size) for i in range(size)]


def send_to_next(tree: Any, axis_name: str | tuple[str, ...], shift: int = FORWARD, *, fuse: bool = False) -> Any:
    """ppermute every array of `tree` one hop along the ring over `axis_name` (None leaves stay None).

    fuse=True sends all the arrays as one buffer (`fused_ppermute`): one collective-permute per hop.
    """
    size = lax.axis_size(axis_name)
    if fuse:
        return fused_ppermute(tree, axis_name, ring_pairs(size, shift))
    return jax.tree.map(lambda x: ppermute(x, axis_name, ring_pairs(size, shift)), tree)


def fused_ppermute(tree: Any, axis_name: str | tuple[str, ...], perm: Sequence[tuple[int, int]]) -> Any:
    """One ppermute of all the arrays of `tree`, packed into one byte buffer and unpacked on arrival.

    Same bytes on the wire as one ppermute per array. Why: XLA's GPU scheduler keeps one collective-permute
    in flight at a time, and its combiner merges separate permutes only up to ~30 MiB, so at real sizes (a
    GPT-7B K block alone is 32 MiB at 4k tokens per device) a ring step's K, V (and dK, dV) would go as
    several permutes of which only one can overlap the block compute. Costs a pack and an unpack copy.

    Arrays that vary over different mesh axes (a ring's K/V split over tp beside its segment ids, the same
    on every tp rank) go as one buffer per set of axes: each arrives with its own varying axes, as the loop
    that carries it requires.
    """
    leaves, treedef = jax.tree.flatten(tree)
    groups: dict[frozenset, list[int]] = {}
    for i, x in enumerate(leaves):
        groups.setdefault(varying_axes(x), []).append(i)
    out = list(leaves)
    for members in groups.values():
        received = _permute_packed([leaves[i] for i in members], axis_name, perm)
        for i, x in zip(members, received, strict=True):
            out[i] = x
    return jax.tree.unflatten(treedef, out)


def _permute_packed(leaves: list[jax.Array], axis_name: str | tuple[str, ...], perm: Sequence[tuple[int, int]]):
    """One ppermute of `leaves` (arrays varying over the same mesh axes) packed into one byte buffer."""
    if len(leaves) == 1:
        return [ppermute(leaves[0], axis_name, perm)]
    as_bytes = lambda x: (
        x.astype(jnp.uint8) if x.dtype == jnp.bool_ else lax.bitcast_convert_type(x, jnp.uint8)
    ).reshape(-1)
    buffer = ppermute(jnp.concatenate([as_bytes(x) for x in leaves]), axis_name, perm)
    out, start = [], 0
    for x in leaves:
        size = x.size * x.dtype.itemsize
        chunk = lax.slice_in_dim(buffer, start, start + size)
        start += size
        if x.dtype == jnp.bool_:
            out.append(chunk.reshape(x.shape).astype(jnp.bool_))
        elif x.dtype.itemsize == 1:
            out.append(lax.bitcast_convert_type(chunk.reshape(x.shape), x.dtype))
        else:
            out.append(lax.bitcast_convert_type(chunk.reshape(x.shape + (x.dtype.itemsize,)), x.dtype))
    return out


def ring_steps(
    step_fn: Callable[[Any, Any, Any], Any], carry: Any, kv: Any, num_steps: int, send: Callable[[Any], Any]
) -> Any:
    """for step in 0..P-1: send the K/V block on (not after the last step), then `step_fn` on it: the
    `prefetch_steps` loop with the ring hop as the transfer (P-1 hops; O(S/P) memory, not O(S)). Returns the
    final carry."""
    return prefetch_steps(step_fn, carry, kv, lambda kv, _: send(kv), num_steps)


def ring_steps_accumulating(
    step_fn: Callable[..., tuple[Any, Any]], carry: Any, blocks: Any, num_steps: int, send: Callable[[Any], Any]
) -> tuple[Any, Any]:
    """A ring whose travelling blocks gather a sum on the way (the backward's K/V with their dK/dV).

    step_fn(carry, blocks, step, acc) -> (carry, acc): this rank's work on the blocks it holds, adding its
    share to their accumulator `acc` (None at step 0: the first holder starts the sum). The accumulator of
    a block travels one hop behind the block itself:

      step 0:         send blocks on;                        carry, acc = step_fn(carry, blocks, 0, None)
      step 1 .. P-1:  send blocks on (not at the last step) and acc, as one send;
                      carry, acc = step_fn(carry, blocks, step, received acc)
      after:          send acc on (the P-th hop: it reaches the rank after the last one that added to it)

    Each step's send is issued before its compute and does not depend on it, so the transfer can run while
    the block compute runs (the sequential form, "compute, add, then send the sum", serialises them) as long
    as step_fn adds the received acc after its block compute. Exactly P-1 block hops and P accumulator
    hops, one received block and one received accumulator in flight per device. Returns (carry, acc).
    """
    nxt = send(blocks) if num_steps > 1 else blocks
    carry, acc = step_fn(carry, blocks, 0, None)
    blocks = nxt

    def middle(state: tuple, step: jax.Array) -> tuple:
        (carry, acc), blocks = state
        nxt, received = send((blocks, acc))  # one send: with a fusing `send`, one transfer per step
        return (step_fn(carry, blocks, step, received), nxt), None

    if num_steps > 2:
        ((carry, acc), blocks), _ = lax.scan(middle, ((carry, acc), blocks), jnp.arange(1, num_steps - 1))
    if num_steps > 1:
        carry, acc = step_fn(carry, blocks, num_steps - 1, send(acc))
    return carry, send(acc)


def tree_rounds(size: int) -> int:
    """ceil(log2(size)): rounds of a binomial-tree broadcast or reduce over `size` ranks."""
    return max(size - 1, 0).bit_length()


def tree_broadcast(x: jax.Array, axis_name: str, root: jax.typing.ArrayLike) -> jax.Array:
    """Every rank of `axis_name` gets root's `x`, by a binomial tree of ceil(log2 P) ppermute rounds.

    `root` may be traced (e.g. a scan step). In round t each rank sends to rank + 2^t (a fixed shift, so the
    permutation is static) and a rank keeps what it received when its distance from root is in [2^t, 2^(t+1)).
    Each rank receives one block per round, ceil(log2 P) blocks in all, the log-tree cost the papers assume.
    Never gathers more than the one block. Its transpose (autodiff) is the matching tree reduce onto root.
    """
    size = lax.axis_size(axis_name)
    rel = (lax.axis_index(axis_name) - root) % size
    for t in range(tree_rounds(size)):
        shift = 1 << t
        received = ppermute(x, axis_name, ring_pairs(size, shift))
        x = jnp.where((rel >= shift) & (rel < 2 * shift), received, x)
    return x


def tree_reduce(x: jax.Array, axis_name: str, root: jax.typing.ArrayLike) -> jax.Array:
    """Sum of `x` over `axis_name`, valid on rank `root` (other ranks hold partial sums).

    The reverse binomial tree: in round t (from the widest) rank root + r sends to root + r - 2^t, which adds
    it when r < 2^t. ceil(log2 P) ppermute rounds, one block received per round.
    """
    size = lax.axis_size(axis_name)
    rel = (lax.axis_index(axis_name) - root) % size
    for t in reversed(range(tree_rounds(size))):
        shift = 1 << t
        received = ppermute(x, axis_name, ring_pairs(size, -shift))
        x = jnp.where((rel < shift) & (rel + shift < size), x + received, x)
    return x
