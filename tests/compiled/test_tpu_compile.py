"""Deviceless TPU compiles (`jaxring.analysis.tpu`, `train.py --compile-for v5e-8`): the attention strategies'
collective bytes on a TPU slice equal the papers' formulas, in bf16 (XLA:TPU moves 2 bytes an element, where
XLA:CPU widens to 4), with the Pallas TPU block compute; train.py's TPU targets.

The compile tests need libtpu (`pip install -e ".[dev,tpu-compile]"`); elsewhere they skip and say why. The
target table and the torus ring run everywhere.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring.analysis import tpu
from jaxring.analysis.compiled import collective_traffic
from jaxring.core.accelerators import DEVICES
from jaxring.core.collectives import tree_rounds
from jaxring.core.torus import ring_hops, torus_ring
from jaxring.parallel.sequence.ring import ring_attention
from jaxring.parallel.sequence.ulysses import ulysses_attention
from jaxring.parallel.sequence.wallfacer import WF_AXES, wallfacer_attention, wallfacer_mesh
from jaxring.parallel.tensor import metp_api

AVAILABLE, WHY = tpu.available()
needs_libtpu = pytest.mark.skipif(not AVAILABLE, reason=f"deviceless TPU compile unavailable: {WHY}")


# ------------------------------------------------------------------------------ everywhere (plain install)


def test_targets_count_chips_as_cloud_tpu_names_them():
    t = tpu.TARGETS
    assert (t["v5p-8"].chips, t["v5p-8"].devices) == (4, 4)  # v5p names count TensorCores: 2 per chip
    assert (t["v5p-128"].chips, t["v5p-128"].topology) == (64, "v5p:4x4x4")
    assert t["v5e-8"].chips == t["v6e-8"].chips == 8 and t["v5litepod-8"] is t["v5e-8"]
    assert (t["tpu7x-8"].chips, t["tpu7x-8"].devices) == (4, 8)  # jax shows a TPU7x chip as two devices
    for target in t.values():
        spec = DEVICES[target.device]
        per_chip = spec.memory_bytes * spec.devices_per_chip / 2**30
        assert per_chip == target.hbm_gib_per_chip and spec.ici_links in (4, 6)
    with pytest.raises(ValueError, match="unknown TPU target 'v5p-7'"):
        tpu.target("v5p-7")


def test_unavailable_reason_names_the_extra():
    if not tpu.libtpu_installed():
        assert 'pip install -e ".[tpu-compile]"' in WHY


@dataclasses.dataclass(frozen=True)
class _Chip:  # a stand-in TPU device: what torus_ring reads
    id: int
    coords: tuple
    platform: str = "tpu"


@pytest.mark.parametrize("dims", [(2, 4, 1), (2, 2, 1), (2, 2, 2), (4, 4, 4), (3, 4, 1)])
def test_a_torus_ring_steps_one_link_at_a_time(dims):
    chips = [_Chip(i, (x, y, z)) for i, (z, y, x) in enumerate(__import__("numpy").ndindex(dims[::-1]))]
    ring = torus_ring(chips)
    assert sorted(c.id for c in ring) == list(range(len(chips)))
    assert ring_hops(ring) == [1] * len(chips)


# ------------------------------------------------------------------------------ with libtpu

B, SEQ, HQ, HKV, D = 1, 2048, 8, 2, 128  # 256 tokens per device of the 8-chip slice
E = 2  # bf16 bytes: XLA:TPU moves bf16 collectives as bf16


@functools.cache
def _mesh():
    return jaxring.make_mesh(sp=8, devices=tpu.tpu_devices("v5e-8"))


def _compile(local, mesh, axes, backward=False):
    """(bytes moved per kind, Mosaic calls) of `local` shard_mapped over `axes` of the TPU mesh, in bf16."""
    spec = P(None, axes, None, None)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    q = tpu.abstract((B, SEQ, HQ, D), jnp.bfloat16, mesh, spec)
    kv = tpu.abstract((B, SEQ, HKV, D), jnp.bfloat16, mesh, spec)
    args = (q, kv, kv)
    if backward:
        args = (*args, q)
        fwd = fn

        def fn(q, k, v, dout):  # the output used and the cotangent an argument, as in a training step
            out, vjp = jax.vjp(fwd, q, k, v)
            return out, vjp(dout)

    report = tpu.compile_for_tpu(jax.jit(fn), *args, target="v5e-8")
    moved, _ = collective_traffic(report.hlo, 8)
    return moved, report.mosaic_calls


def _kernel_present(calls):
    if tpu.BLOCK_OPS == "pallas_tpu":
        assert calls > 0, "the Pallas TPU block compute left no Mosaic call in the compiled program"


@needs_libtpu
def test_ring_on_a_tpu_slice_sends_the_papers_kv_blocks():
    p = 8
    local = functools.partial(ring_attention, layout="zigzag", causal=True, block_ops=tpu.BLOCK_OPS)
    moved, calls = _compile(local, _mesh(), "sp")
    chunk = B * (SEQ // p) * HKV * D
    assert moved["collective-permute"] == 2 * (p - 1) * chunk * E  # K and V, the last hop skipped
    _kernel_present(calls)


@needs_libtpu
def test_ring_backward_on_a_tpu_slice():
    p = 8
    local = functools.partial(ring_attention, layout="zigzag", causal=True, block_ops=tpu.BLOCK_OPS)
    moved, calls = _compile(local, _mesh(), "sp", backward=True)
    chunk = B * (SEQ // p) * HKV * D
    # forward 2(P-1) K/V; backward 2(P-1) K/V again + 2P dK/dV: 2(P-1) hops in fp32 and the hop home in bf16
    # (XLA:TPU moves the cast to the caller's dtype before that last send; XLA:CPU sends all 2P in fp32)
    assert moved["collective-permute"] == 4 * (p - 1) * chunk * E + 2 * (p - 1) * chunk * 4 + 2 * chunk * E
    _kernel_present(calls)


@needs_libtpu
def test_ulysses_on_a_tpu_slice_moves_four_all_to_alls():
    p = 8
    local = functools.partial(ulysses_attention, layout="contiguous", causal=True, block_ops=tpu.BLOCK_OPS)
    moved, calls = _compile(local, _mesh(), "sp")
    kv_sent = max(HKV, p)  # K/V heads repeated up to lcm(kv_heads, P) = 8
    assert moved["all-to-all"] == (p - 1) / p * E * B * (SEQ // p) * D * (HQ + 2 * kv_sent + HQ)
    assert moved["collective-permute"] == 0
    _kernel_present(calls)


@needs_libtpu
def test_wallfacer_on_a_tpu_slice_moves_a_team_sized_share_of_the_ring():
    p, c = 8, 2
    mesh = wallfacer_mesh(_mesh(), c)
    local = lambda q, k, v: wallfacer_attention(q, k, v, team_size=c, layout="zigzag", block_ops=tpu.BLOCK_OPS)
    moved, calls = _compile(local, mesh, WF_AXES)
    n = SEQ // p
    kv_block, q_block, lse_rows = B * n * HKV * D * E, B * n * HQ * D * E, B * n * HQ * 4
    init, sub_ring = 2 * c * kv_block, (p // c**2 - 1) * 2 * c * kv_block
    assert moved["collective-permute"] == init + sub_ring == p * 2 * kv_block // c  # ring's P sends over c
    assert moved["all-gather"] == (c - 1) * (q_block + 2 * kv_block) + (c - 1) * lse_rows
    _kernel_present(calls)


@needs_libtpu
def test_the_compile_time_hbm_check_reads_xla_peak_not_argument_plus_temp():
    """XLA:TPU's `temp` is above its buffer assignment's temporaries; the compiler's own HBM check (E1000) reads
    `peak_memory_in_bytes`: a program whose argument + temp is over a v6e chip's 31.24 GiB, its peak under,
    compiles (`tpu.memory_of`)."""
    mesh = jax.sharding.Mesh(tpu.tpu_devices("v6e-8"), ("x",))
    layers, hidden, n = 32, 2048, 196608  # a layer scan's stack of 32 bf16 [n, 2048] inputs, n per device

    def loss(w, x):
        def body(h, wl):
            return jax.checkpoint(lambda h, wl: jnp.tanh(h @ wl.astype(jnp.bfloat16)) + h)(h, wl), None

        h, _ = jax.lax.scan(body, x, w)
        return jnp.sum(h.astype(jnp.float32) ** 2)

    w = tpu.abstract((layers, hidden, hidden), jnp.float32, mesh, P())
    x = tpu.abstract((8 * n, hidden), jnp.bfloat16, mesh, P("x"))
    report = tpu.compile_for_tpu(jax.jit(lambda w, x: w - 0.1 * jax.grad(loss)(w, x), donate_argnums=0), w, x)
    hbm = 31.24 * 2**30
    assert report.xla_peak_bytes < hbm < report.peak_bytes
    assert report.memory["peak"] >= report.memory["argument"]
    offloaded = dataclasses.replace(report, memory={**report.memory, "host": 2**30})
    assert offloaded.xla_peak_bytes is None  # with host offload the peak counts host memory too


@needs_libtpu
def test_train_py_compiles_for_a_tpu_slice(capsys):
    import train as cli  # the repository's train.py

    args = ["--preset", "tiny", "--seq-len", "2048", "--batch-size", "1", "--sp", "8", "--attention", "ring"]
    assert cli.main([*args, "--compile-for", "v5e-8"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("fits: compiled") and "budget 14.4 GiB" in out[-1]
    assert any(line.startswith("TPU block compute:") for line in out)


def test_a_missing_libtpu_is_one_line(monkeypatch, capsys):
    import train as cli

    monkeypatch.setattr(tpu, "libtpu_installed", lambda: False)
    assert cli.main(["--preset", "tiny", "--sp", "8", "--compile-for", "v6e-8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'pip install -e ".[tpu-compile]"' in err


def _tp_mesh():
    return jaxring.make_mesh(tp=8, devices=tpu.tpu_devices("v5e-8"))


def _compiled_bytes(fn, *args):
    """Bytes moved per collective kind and Mosaic calls of jit(fn) compiled for the v5e-8 slice."""
    report = tpu.compile_for_tpu(jax.jit(fn), *args, target="v5e-8")
    return collective_traffic(report.hlo, 8)[0], report.mosaic_calls


@needs_libtpu
def test_metp_attention_on_a_tpu_slice_moves_the_papers_bytes():
    """METP's two-level attention, tp = 8, causal, fp32, with the TPU kernels as its inner ring's block compute:
    the forward's permutes are p broadcasts x ceil(log2 p) rounds of each rank's weight slices plus, per head
    group, p-1 hops of its K and V blocks and their int32 positions (tests/unit/parallel/test_metp.py's `mha_bytes`)."""
    p, b, s, h, heads, d = 8, 1, 2048, 1024, 8, 128
    mesh = _tp_mesh()
    x = tpu.abstract((b, s, h), jnp.float32, mesh, P())
    pos = tpu.abstract((b, s), jnp.int32, mesh, P())
    shapes = {"wq": (h, heads * d), "wk": (h, heads * d), "wv": (h, heads * d), "wo": (heads * d, h)}
    w = {n: tpu.abstract(shape, jnp.float32, mesh, P()) for n, shape in shapes.items()}
    attend = lambda x, w, pos: metp_api.attention_block(
        x, w, pos, mesh=mesh, num_heads=heads, num_kv_heads=heads, block_ops=tpu.BLOCK_OPS
    )
    moved, calls = _compiled_bytes(attend, x, w, pos)
    weights = (h * 3 * heads * d + heads * d * h) // p
    kv, positions = b * (s // p) * (heads // p) * d, b * (s // p)
    assert (
        moved["collective-permute"]
        == 4 * (p * tree_rounds(p) * weights + p * (p - 1) * 2 * kv) + 4 * p * (p - 1) * positions
    )
    _kernel_present(calls)
