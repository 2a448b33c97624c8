"""The cuDNN block compute on CPU: its call contract's jnp stand-in against jax.nn.dot_product_attention, the
block decomposition's classes per layout, and every strategy with block_ops="cudnn_reference" against the
dense reference, forward and dQ/dK/dV (fp32 inputs: the stand-in takes them, so tolerances stay tight)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, check, padded_segments, qkv, with_reference
from test_reliability import CLI, SMALL_FLAGS

import jaxring
from jaxring.analysis import gpu
from jaxring.core import compat
from jaxring.kernels import cudnn_contract as cc
from jaxring.kernels.block_compute import (
    AUTO_BLOCK_OPS,
    BLOCK_OPS,
    auto_block_ops,
    get_block_ops,
    local_attention,
    resolve_name,
)
from jaxring.kernels.cudnn_blocks import (
    CLASS_NAMES,
    FALLBACK,
    REAL_CALLS,
    planned_classes,
    stand_in_output,
)
from jaxring.kernels.layout import RankTokens, layout_permutation, layout_positions
from jaxring.models import gpt
from jaxring.planner import Cluster, Workload
from jaxring.planner import cost_model as cost
from jaxring.planner.calibration import calibration
from jaxring.planner.space import Candidate

SLOW = pytest.mark.slow


def _unused(dtype):
    return [jnp.zeros(0, dtype)] + [jnp.zeros(0, jnp.int32)] * 4 + [jnp.zeros(0, dtype)] * 2


def _params(mask_type, window=None, layout=cc.BTNH):
    return dict(
        scale=0.25,
        seed=0,
        dropout_rate=0.0,
        variadic_args=(False, False),
        mask_type=mask_type,
        layout=layout,
        sliding_window_length=window,
    )


@pytest.mark.parametrize(
    "mask_type,window,t,s,layout",
    [
        (cc.NO_MASK, None, 8, 24, cc.BTNH),
        (cc.CAUSAL, None, 8, 24, cc.BTNH),  # top-left: with T != S a bottom-right mask differs
        (cc.CAUSAL, None, 24, 8, cc.BNTH),
        (cc.CAUSAL, 5, 16, 16, cc.BTNH),
    ],
    ids=["none", "causal-top-left", "causal-tall-bnth", "window"],
)
def test_contract_matches_jax(mask_type, window, t, s, layout):
    """Stand-in forward (out, stats = lse [B, N, T]) and backward from (stats, O, dO) vs JAX's dense attention."""
    q, _, _, do = qkv(1, 2, t, 4, 2, 16)
    _, k, v, _ = qkv(2, 2, s, 4, 2, 16)
    causal = mask_type == cc.CAUSAL
    keep = np.tril(np.ones((t, s), bool)) if causal else np.ones((t, s), bool)
    if window:
        keep &= np.arange(s)[None] > np.arange(t)[:, None] - window
    mask = jnp.asarray(keep)[None, None]

    def reference(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=0.25, mask=mask, implementation="xla")

    to = (lambda x: x) if layout == cc.BTNH else (lambda x: jnp.swapaxes(x, 1, 2))  # its own inverse
    params = _params(mask_type, window, layout)

    @jax.jit
    def both(q, k, v, do):
        out_r, vjp = jax.vjp(reference, q, k, v)
        logits = jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k, 2, axis=2)) * 0.25
        lse_r = jax.nn.logsumexp(jnp.where(mask, logits, -jnp.inf), axis=-1)  # [B, N, T]
        out, stats = cc.forward(to(q), to(k), to(v), *_unused(q.dtype), **params)
        grads = cc.backward(to(q), to(k), to(v), *_unused(q.dtype), stats, out, to(do), **params)
        return (to(out), stats, *(to(g) for g in grads)), (out_r, lse_r, *vjp(do))

    got, ref = both(q, k, v, do)
    assert got[1].shape == (2, 4, t) and got[1].dtype == jnp.float32
    for name, x, x_r in zip(("out", "stats", "dq", "dk", "dv"), got, ref):
        assert_close(x, x_r, 1e-5, name)


def test_mask_values_are_the_private_ones():
    """The stand-in's mask numbers are cuDNN's MaskType values of this JAX (where it has them)."""
    if not compat.has_cudnn_attention():
        pytest.skip("this jax has no cuDNN attention primitives")
    types = compat.cudnn_mask_types()
    assert (types["none"].value, types["padding"].value, types["causal"].value) == (cc.NO_MASK, cc.PADDING, cc.CAUSAL)
    assert types["padding_causal"].value == cc.PADDING_CAUSAL


def test_the_private_primitives_take_jaxrings_operands():
    """cuDNN's forward and backward primitives, in this jax's call contract (0.11's; 0.12's adds score_mod), take
    the operands and parameters jaxring binds: lowered for CUDA on a CPU (no GPU needed) they become cuDNN's
    fused-attention custom calls (a parameter missing or extra fails the lowering)."""
    if not compat.has_cudnn_attention():
        pytest.skip("this jax has no cuDNN attention primitives")
    q = jax.ShapeDtypeStruct((1, 128, 4, 64), jnp.bfloat16)

    def forward_backward(q, do):
        out, stats = REAL_CALLS.forward(q, q, q, *_unused(q.dtype), **_params(cc.CAUSAL))
        return REAL_CALLS.backward(q, q, q, *_unused(q.dtype), stats, out, do, **_params(cc.CAUSAL))

    text = jax.jit(forward_backward).trace(q, q).lower(lowering_platforms=("cuda",)).as_text()
    assert "@__cudnn$fmhaSoftmax(" in text and "@__cudnn$fmhaSoftmaxBackward(" in text


def test_stand_in_output_rowsum():
    """O' (in bf16) has rowsum(dO ∘ O') = delta to far better than bf16's own rounding."""
    _, _, _, do = qkv(3, 2, 32, 4, 4, 64, jnp.bfloat16)
    delta = jax.random.normal(jax.random.PRNGKey(4), do.shape[:3]) * 3.0
    delta = delta.at[0, 0, 0].set(0.0)
    do = do.at[1, 2].set(0)  # a zero row: delta must then be 0 (it is rowsum(dO ∘ O))
    delta = delta.at[1, 2].set(0.0)
    o = jax.jit(stand_in_output)(do, delta)
    assert o.dtype == jnp.bfloat16
    got = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
    assert float(jnp.max(jnp.abs(got - delta))) <= 2e-4 * float(jnp.max(jnp.abs(delta)))


@pytest.mark.parametrize("layout", jaxring.LAYOUTS)
@pytest.mark.parametrize("inner", [1, 2], ids=["ring", "usp2"])
def test_ring_blocks_need_no_fallback(layout, inner):
    """Every causal ring step of every layout (and USP's gathered shards) maps to cuDNN calls: no FALLBACK."""
    sp, n = 8 // inner, 32
    tokens = RankTokens(layout, inner)
    seen = set()
    for r in range(sp):
        for r2 in range(sp):
            classes = planned_classes(tokens.positions(r, sp, n), tokens.positions(r2, sp, n), causal=True)
            seen.update(CLASS_NAMES[c] for c in classes)
            assert FALLBACK not in classes, (layout, r, r2, classes)
    assert "causal" in seen and FALLBACK not in seen


def test_what_falls_back():
    """Honest fallbacks: a window on a striped block; all-gather's K against a shard is chunked, not fallen back."""
    q = layout_positions("striped", 3, 4, 16)
    assert FALLBACK in planned_classes(q, layout_positions("striped", 1, 4, 16), causal=True, window=9)
    q = layout_positions("contiguous", 2, 4, 16)
    classes = planned_classes(q, jnp.arange(64, dtype=jnp.int32), causal=True)
    assert FALLBACK not in classes and len(classes) == 16


def test_names():
    """ "auto" stays jnp on CPU; "cudnn" off an NVIDIA GPU is a one-line error naming the stand-in."""
    assert resolve_name("auto") == "jnp"
    assert get_block_ops("cudnn_reference").name == "cudnn_reference"
    with pytest.raises(ValueError, match=r"needs an NVIDIA GPU .*'cudnn_reference'") as err:
        get_block_ops("cudnn")
    assert "\n" not in str(err.value)


def test_auto_is_stated_per_backend(monkeypatch):
    """What "auto" means is one table (AUTO_BLOCK_OPS) read by one function: Pallas on GPU, Pallas TPU on TPU,
    jnp on CPU and on a backend the table does not name; a "cudnn" entry off an NVIDIA GPU is "pallas"."""
    assert {b: auto_block_ops(b) for b in ("gpu", "tpu", "cpu", "metal")} == {
        "gpu": "pallas",
        "tpu": "pallas_tpu",
        "cpu": "jnp",
        "metal": "jnp",
    }
    assert set(AUTO_BLOCK_OPS.values()) <= set(BLOCK_OPS) - {"auto"}
    monkeypatch.setitem(AUTO_BLOCK_OPS, "gpu", "cudnn")
    assert auto_block_ops("gpu") == "pallas"  # this CPU is no NVIDIA GPU


def test_train_cudnn_on_cpu_is_one_line(capsys, tmp_path):
    """train.py --block-ops cudnn without an NVIDIA GPU: exit 2 and one line, before any step."""
    try:
        code = CLI.main([*SMALL_FLAGS, "--steps", "1", "--block-ops", "cudnn", "--out-dir", str(tmp_path)])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "'cudnn' needs an NVIDIA GPU" in err[0], err


def _strategy(mesh_kw, strategy, layout, *, causal=True, segment_ids=None, window=None, **options):
    mesh = jaxring.make_mesh(**mesh_kw)

    def fn(q, k, v):
        return jaxring.sharded_attention(
            q, k, v, mesh=mesh, strategy=strategy, causal=causal, layout=layout, segment_ids=segment_ids,
            block_ops="cudnn_reference", window=window, **options,
        )  # fmt: skip

    return fn


def _reference_window(window):
    """The dense reference with a sliding window (jaxring.attention_reference takes it)."""

    def fn(q, k, v):
        return jaxring.attention_reference(q, k, v, causal=True, window=window)[0]

    return fn


CASES = [
    pytest.param("ring", "zigzag", {}, 4, 2, id="ring-zigzag-gqa"),
    pytest.param("ring", "striped", {}, 4, 4, id="ring-striped", marks=SLOW),
    pytest.param("ring", "contiguous", {}, 4, 1, id="ring-contiguous-mqa", marks=SLOW),
    pytest.param("ulysses", "zigzag", {}, 8, 8, id="ulysses-zigzag"),
    pytest.param("usp", "zigzag", {"ulysses_size": 2}, 4, 2, id="usp-zigzag", marks=SLOW),
    pytest.param("allgather", "zigzag", {}, 4, 2, id="allgather-zigzag", marks=SLOW),
    pytest.param("wallfacer", "zigzag", {"team_size": 2}, 4, 2, id="wallfacer-zigzag", marks=SLOW),
]


@pytest.mark.heavy
@pytest.mark.parametrize("strategy,layout,options,q_heads,kv_heads", CASES)
def test_strategies_match_reference(strategy, layout, options, q_heads, kv_heads):
    q, k, v, dout = qkv(hash(strategy) % 100, 1, 128, q_heads, kv_heads, 16)
    fn = _strategy(dict(sp=8), strategy, layout, **options)
    check(*with_reference(fn, q, k, v, dout, causal=True), 2e-4)


def test_dense_local_attention():
    """sp = 1 (the plan's dense path) with tokens in zig-zag order: sorted into one run, one cuDNN call, GQA."""
    q, k, v, dout = qkv(5, 2, 64, 4, 2, 16)
    order = jnp.asarray(layout_permutation("zigzag", 64, 4))  # token i holds position order[i]
    assert planned_classes(jnp.sort(order), jnp.sort(order), causal=True) == [CLASS_NAMES.index("causal")]
    kw = dict(q_positions=order, kv_positions=order, causal=True)
    fn = functools.partial(local_attention, "cudnn_reference", **kw)
    ref = lambda q, k, v: jaxring.attention_reference(q, k, v, **kw)[0]
    check(with_reference(fn, q, k, v, dout, causal=True)[0], with_reference(ref, q, k, v, dout, causal=True)[0], 2e-4)


@SLOW
def test_window_and_documents():
    """A window on the zig-zag ring (diagonal chunks: cuDNN's band; others whole, hidden or the fallback) and
    packed documents (segment ids: the whole block falls back to the jnp pair)."""
    q, k, v, dout = qkv(6, 2, 128, 4, 2, 16)
    fn = _strategy(dict(sp=8), "ring", "zigzag", window=12)
    got = with_reference(fn, q, k, v, dout, causal=True)[0]
    check(got, with_reference(_reference_window(12), q, k, v, dout, causal=True)[0], 2e-4)
    seg = jnp.asarray(padded_segments("zigzag", 128, 8))
    fn = _strategy(dict(sp=8), "ring", "zigzag", segment_ids=seg)
    check(*with_reference(fn, q, k, v, dout, causal=True, segment_ids=seg), 2e-4)


DEVICELESS, WHY_NOT = gpu.available()


def test_planner_prices_the_block_compute():
    """On an H100, the Pallas kernel's attention FLOPs take 1/0.385 of cuDNN's time (the measured ratio);
    everything else, and the CPU pricing, is unchanged."""
    w = Workload("gpt", gpt.PRESETS["7b"], 65536, 1, "bf16")
    c = Candidate.of(sp=8, attention="ring")
    cluster = Cluster.of("h100", 8)
    s = cost.shapes(w, c)
    ops = ("auto", "pallas", "cudnn")
    times = {o: cost.step_time(w, c.with_parallel(block_ops=o), [], cluster, {}, s=s).compute for o in ops}
    _, attention, _ = cost.compute_flops(w, c, c.memory.remat, s)
    seconds = attention / (cluster.device.flops * cluster.efficiency)
    assert times["pallas"] - times["cudnn"] == pytest.approx(seconds * (1 / 0.385 - 1), rel=1e-9)
    assert times["auto"] == times["pallas"]  # (until cuDNN has run on a GPU: block_compute.AUTO_BLOCK_OPS)
    speeds = {t: calibration(t).block_compute_speed for t in ("cpu", "gpu")}
    assert speeds["cpu"]["pallas"] == speeds["gpu"]["cudnn"] == 1.0 and speeds["gpu"]["pallas"] == 0.385
