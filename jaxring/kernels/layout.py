"""Sequence layouts over the `sp` ring: which tokens each device holds, their positions, and the relayout.

With P devices and a global sequence of S tokens, each device holds n = S / P tokens:

  contiguous  rank r holds tokens [r*n, (r+1)*n)
  zigzag      the sequence is cut in 2P chunks of c = n/2; rank r holds chunks r and 2P-1-r (causal balance)
  striped     rank r holds tokens r, r+P, r+2P, ... (causal balance at token granularity)

`layout_positions` gives a rank's true token positions, so every block is masked exactly. `to_layout` and
`from_layout` move a naturally ordered (contiguous) shard into a layout and back inside `shard_map`, with
point-to-point `ppermute`s for zigzag (each device sends and receives two half chunks) and one `all_to_all`
for striped; `layout_permutation` gives the same map on a global array, for the data side and for tests.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxring.core.collectives import ppermute

LAYOUTS = ("contiguous", "zigzag", "striped")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")


def check_seq_len(seq_len: int, num_devices: int, layout: str, *, relayout: bool = False) -> None:
    """Raises unless seq_len splits over num_devices in this layout.

    relayout=True adds the rule of `to_layout` for striped: one all-to-all needs seq divisible by P².
    """
    check_layout(layout)
    multiple, rule = num_devices, f"sp = {num_devices}"
    if layout == "zigzag":
        multiple, rule = 2 * num_devices, f"2*sp = {2 * num_devices}, needed by the zigzag layout"
    elif layout == "striped" and relayout:
        multiple, rule = num_devices**2, f"sp² = {num_devices**2}, needed to re-layout to striped"
    if seq_len % multiple:
        raise ValueError(f"seq {seq_len} is not divisible by {rule}")


def layout_positions(layout: str, rank: int | jax.Array, num_devices: int, local_len: int) -> jax.Array:
    """True token positions held by `rank` (an int or a traced scalar): int32 [local_len]."""
    check_layout(layout)
    i = jnp.arange(local_len, dtype=jnp.int32)
    rank = jnp.asarray(rank, jnp.int32)
    if layout == "contiguous":
        return rank * local_len + i
    if layout == "striped":
        return i * num_devices + rank
    half = local_len // 2
    first = rank * half + i[:half]
    second = (2 * num_devices - 1 - rank) * half + i[:half]
    return jnp.concatenate([first, second])


def gathered_positions(
    layout: str, first_rank: int | jax.Array, count: int, num_devices: int, local_len: int
) -> jax.Array:
    """Positions of the shards of `count` consecutive layout ranks from `first_rank`, concatenated."""
    return jnp.concatenate([layout_positions(layout, first_rank + u, num_devices, local_len) for u in range(count)])


@dataclasses.dataclass(frozen=True)
class RankTokens:
    """The tokens a rank of a (sub-)ring holds: the layout shards of `inner` consecutive layout ranks.

    inner = 1 is the layout itself. USP's ring gathers the shards of its U Ulysses ranks (inner = U). For
    zig-zag the gathered shards [A_0 B_0 A_1 B_1 ...] (A_u the early chunk, B_u the late one) are put in run
    order [A_0 .. A_{U-1} B_{U-1} .. B_0] by `run_order`, so a rank still holds two contiguous runs.
    """

    layout: str
    inner: int = 1

    def run_order(self, local_len: int) -> np.ndarray | None:
        """Static permutation from the gathered (rank-major) order to run order, or None if identical."""
        if self.layout != "zigzag" or self.inner == 1:
            return None
        half = local_len // self.inner // 2
        chunk = lambda u, second: np.arange(half) + (2 * u + second) * half
        early = [chunk(u, 0) for u in range(self.inner)]
        late = [chunk(u, 1) for u in reversed(range(self.inner))]
        return np.concatenate(early + late)

    def positions(self, ring_rank: int | jax.Array, ring_size: int, local_len: int) -> jax.Array:
        """int32 [local_len] true positions held by `ring_rank` (int or traced), in run order."""
        per = local_len // self.inner
        pos = gathered_positions(self.layout, ring_rank * self.inner, self.inner, ring_size * self.inner, per)
        order = self.run_order(local_len)
        return pos if order is None else pos[order]

    def runs(self) -> int:
        """Contiguous position runs per rank, in run order (striped tokens form no runs: 1)."""
        return 2 if self.layout == "zigzag" else 1


def layout_permutation(layout: str, seq_len: int, num_devices: int) -> np.ndarray:
    """Global index map: x_layout = x_natural[..., perm, ...] along the sequence axis."""
    check_seq_len(seq_len, num_devices, layout)
    n = seq_len // num_devices
    return np.concatenate([np.asarray(layout_positions(layout, r, num_devices, n)) for r in range(num_devices)])


def natural_order(layout: str, seq_len: int, num_devices: int) -> np.ndarray | None:
    """Static index map from the gathered sequence (every rank's shard, in rank order) to natural order:
    x_natural = x_gathered[..., order, ...]; None for contiguous (already natural). Its inverse is
    `layout_permutation`. A sliding window's keys are one contiguous band in natural order only."""
    if layout == "contiguous":
        return None
    with jax.ensure_compile_time_eval():  # concrete even under jit
        return np.argsort(layout_permutation(layout, seq_len, num_devices))


def _zigzag_tables(p: int):
    """For each natural half-chunk slot j: the ppermute pairs and, per rank, the zigzag slot it lands in.

    Naturally, rank d holds chunks 2d and 2d+1 (slots 0, 1); in zigzag, rank r holds chunks r, 2P-1-r.
    """
    owner = lambda c: (c, 0) if c < p else (2 * p - 1 - c, 1)
    perms, slots = [], []
    for j in range(2):
        perms.append([(d, owner(2 * d + j)[0]) for d in range(p)])
        slot = np.zeros(p, np.int32)
        for d in range(p):
            r, s = owner(2 * d + j)
            slot[r] = s
        slots.append(slot)
    return perms, slots


def _halves(x: jax.Array, seq_dim: int):
    n = x.shape[seq_dim]
    return lax.slice_in_dim(x, 0, n // 2, axis=seq_dim), lax.slice_in_dim(x, n // 2, n, axis=seq_dim)


def to_layout(x: jax.Array, layout: str, axis_name: str | tuple[str, ...], seq_dim: int = 1) -> jax.Array:
    """Inside shard_map: a contiguous shard of the sequence -> this rank's shard in `layout`."""
    check_layout(layout)
    p = lax.axis_size(axis_name)
    if layout == "contiguous" or p == 1:
        return x
    if layout == "striped":
        n = x.shape[seq_dim]
        x = x.reshape(x.shape[:seq_dim] + (n // p, p) + x.shape[seq_dim + 1 :])
        x = lax.all_to_all(x, axis_name, split_axis=seq_dim + 1, concat_axis=seq_dim, tiled=True)
        return x.reshape(x.shape[:seq_dim] + (n,) + x.shape[seq_dim + 2 :])
    perms, slots = _zigzag_tables(p)
    rank = lax.axis_index(axis_name)
    recv = [ppermute(half, axis_name, perms[j]) for j, half in enumerate(_halves(x, seq_dim))]
    first_is_slot0 = jnp.asarray(slots[0])[rank] == 0
    return jnp.where(first_is_slot0, jnp.concatenate(recv, seq_dim), jnp.concatenate(recv[::-1], seq_dim))


def from_layout(x: jax.Array, layout: str, axis_name: str | tuple[str, ...], seq_dim: int = 1) -> jax.Array:
    """Inside shard_map: the inverse of `to_layout`."""
    check_layout(layout)
    p = lax.axis_size(axis_name)
    if layout == "contiguous" or p == 1:
        return x
    if layout == "striped":
        n = x.shape[seq_dim]
        x = x.reshape(x.shape[:seq_dim] + (p, n // p) + x.shape[seq_dim + 1 :])
        x = lax.all_to_all(x, axis_name, split_axis=seq_dim, concat_axis=seq_dim + 1, tiled=True)
        # received blocks arrive source-major: (source rank j, index a) -> natural index a*P + j
        x = x.reshape(x.shape[:seq_dim] + (p, n // p) + x.shape[seq_dim + 2 :])
        x = jnp.swapaxes(x, seq_dim, seq_dim + 1)
        return x.reshape(x.shape[:seq_dim] + (n,) + x.shape[seq_dim + 2 :])
    perms, slots = _zigzag_tables(p)
    rank = lax.axis_index(axis_name)
    lo, hi = _halves(x, seq_dim)
    sends = []
    for j in range(2):
        inverse = [(dst, src) for src, dst in perms[j]]
        here = jnp.asarray(slots[j])[rank] == 0
        sends.append(ppermute(jnp.where(here, lo, hi), axis_name, inverse))
    return jnp.concatenate(sends, seq_dim)
