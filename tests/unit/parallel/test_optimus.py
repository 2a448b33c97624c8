"""Optimus 2D tensor parallelism [Optimus]: SUMMA AB / ABᵀ / AᵀB forward and gradients, the MLP, attention,
layernorm, embedding and cross-entropy blocks against plain jnp (forward and every gradient) on q = 2 (tp = 4)
and dp = 2 × tp = 4, bytes moved against the paper's log-tree counts (Table 1), the one-block memory claim
(stepwise SUMMA vs gathered panels, at q = 4 in a 16-device subprocess) and error messages."""

import json
import math
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from helpers import ROOT, assert_close, attention_block_reference, mlp_block_reference
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxring import make_mesh
from jaxring.analysis import compile_stats
from jaxring.parallel.tensor import optimus, optimus_api, optimus_layers

RTOL = 1e-4
BLOCK = P("tpr", "tpc")


@pytest.fixture(scope="module")
def meshes():
    return {"q2": make_mesh(tp=4, devices=jax.devices()[:4]), "dp2_q2": make_mesh(dp=2, tp=4)}


def _normal(seed, *shapes, scale=1.0):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    return [scale * jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes)]


def _check_all(got, want, names):
    for g, w, n in zip(got, want, names):
        jax.tree.map(lambda a, b, n=n: assert_close(a, b, RTOL, n), g, w)


def _value_and_vjp(fn, args, cotangent):
    out, vjp = jax.vjp(fn, *args)
    return out, vjp(cotangent)


def _compare(ours, ref, args, cotangent, names):
    """fn's output and the gradient of every arg, ours against ref. Each runs in its own jit: XLA's SPMD
    partitioner (jax 0.10.2, CPU) miscomputes some auto-sharded dot chains, e.g. (dy @ w2.T) @ w1.T with dy
    P((a, b), None, c) and w P(b, c) on a 2×2×2 mesh, so the reference is kept away from our shardings."""
    run = lambda fn: jax.jit(lambda args, ct: _value_and_vjp(fn, args, ct))(args, cotangent)
    (out, grads), (out_r, grads_r) = run(ours), run(ref)
    _check_all([out, *grads], [out_r, *grads_r], names)


# ---------------------------------------------------------------------------------------------------------
# plain jnp references
# ---------------------------------------------------------------------------------------------------------


def layer_norm_ref(x, scale, bias, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * scale + bias


def cross_entropy_ref(x, w_head, targets):
    logits = x @ w_head
    label = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - label


# ---------------------------------------------------------------------------------------------------------
# SUMMA products
# ---------------------------------------------------------------------------------------------------------


def _summa(form, grid):
    fn = {"ab": optimus_layers.summa_ab, "abt": optimus_layers.summa_abt, "atb": optimus_layers.summa_atb}[form]
    return jax.shard_map(fn, mesh=grid, in_specs=(BLOCK, BLOCK), out_specs=BLOCK)


FORMS = {
    "ab": (lambda a, b: a @ b, (8, 12), (12, 16)),  # C [8, 16]
    "abt": (lambda a, b: a @ b.T, (8, 12), (16, 12)),
    "atb": (lambda a, b: a.T @ b, (12, 8), (12, 16)),
}


def test_summa_forms_and_gradients(meshes):
    grid, _, _ = optimus.grid_mesh(meshes["q2"])
    inputs = {f: _normal(i, sa, sb, (8, 16)) for i, (f, (_, sa, sb)) in enumerate(FORMS.items())}

    ours = jax.jit(lambda inputs: {f: _value_and_vjp(_summa(f, grid), (a, b), g) for f, (a, b, g) in inputs.items()})
    ref = jax.jit(lambda inputs: {f: _value_and_vjp(FORMS[f][0], (a, b), g) for f, (a, b, g) in inputs.items()})
    got, want = ours(inputs), ref(inputs)
    for form in FORMS:
        _check_all(
            [got[form][0], *got[form][1]], [want[form][0], *want[form][1]], [f"{form} C", f"{form} dA", f"{form} dB"]
        )


def test_summa_block_shape_errors():
    with pytest.raises(ValueError, match="A block columns must equal B block rows"):
        optimus_layers.summa_ab(jnp.ones((4, 3)), jnp.ones((4, 3)))
    with pytest.raises(ValueError, match="same number of columns"):
        optimus_layers.summa_abt(jnp.ones((4, 3)), jnp.ones((4, 4)))
    with pytest.raises(ValueError, match="same number of rows"):
        optimus_layers.summa_atb(jnp.ones((3, 4)), jnp.ones((4, 4)))


# ---------------------------------------------------------------------------------------------------------
# Transformer blocks against jnp (forward and the gradient of every input)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_name,activation", [("q2", "gelu"), ("dp2_q2", "swiglu")])
def test_mlp_block(meshes, mesh_name, activation):
    mesh = meshes[mesh_name]
    b, s, h, f = 4, 4, 8, 16
    x, w_in, w_out, w_gate, dy = _normal(1, (b, s, h), (h, f), (f, h), (h, f), (b, s, h), scale=0.5)
    params = {"w_in": w_in, "w_out": w_out} | ({"w_gate": w_gate} if activation == "swiglu" else {})

    _compare(
        lambda x, p: optimus_api.mlp_block(x, p, mesh=mesh, activation=activation),
        lambda x, p: mlp_block_reference(x, p, activation),
        (x, params),
        dy,
        ["y", "dx", "dparams"],
    )


@pytest.mark.parametrize("mesh_name,causal,kv_heads", [("q2", True, 4), ("dp2_q2", False, 2)])
def test_attention_block(meshes, mesh_name, causal, kv_heads):
    mesh = meshes[mesh_name]
    b, s, h, n, d = 4, 8, 16, 4, 4
    x, wq, wk, wv, wo, dy = _normal(
        2, (b, s, h), (h, n * d), (h, kv_heads * d), (h, kv_heads * d), (n * d, h), (b, s, h), scale=0.5
    )
    params = {"wq": wq, "wk": wk, "wv": wv, "wo": wo}
    positions = jnp.arange(s, dtype=jnp.int32)[None, :] + 3 * jnp.arange(b, dtype=jnp.int32)[:, None]

    _compare(
        lambda x, p: optimus_api.attention_block(
            x, p, positions, mesh=mesh, num_heads=n, num_kv_heads=kv_heads, causal=causal
        ),
        lambda x, p: attention_block_reference(x, p, positions, n, kv_heads, causal, 10000.0),
        (x, params),
        dy,
        ["y", "dx", "dparams"],
    )


def test_layer_norm(meshes):
    mesh = meshes["dp2_q2"]
    x, scale, bias, dy = _normal(3, (4, 4, 8), (8,), (8,), (4, 4, 8))
    x = 3.0 * x + 1.0

    _compare(
        lambda *a: optimus_api.layer_norm(*a, mesh=mesh),
        layer_norm_ref,
        (x, scale, bias),
        dy,
        ["y", "dx", "dscale", "dbias"],
    )


def test_embed_and_cross_entropy(meshes):
    """embed → cross-entropy, untied (w_head [h, v], Algorithm 1) and tied (the table, Algorithm 2)."""
    mesh = meshes["dp2_q2"]
    b, s, h, v = 4, 4, 8, 12
    table, w_head, d_emb, dloss, dloss_t = _normal(4, (v, h), (h, v), (b, s, h), (b, s), (b, s))
    tokens = jax.random.randint(jax.random.PRNGKey(5), (b, s), 0, v)
    targets = jax.random.randint(jax.random.PRNGKey(6), (b, s), 0, v)

    def model(embed, ce):
        def fn(table, w_head):
            x = embed(tokens, table)
            return x, ce(x, w_head, targets, False), ce(x, table, targets, True)

        return fn

    ours = model(
        lambda t, e: optimus_api.embed(t, e, mesh=mesh),
        lambda x, w, y, tied: optimus_api.cross_entropy(x, w, y, mesh=mesh, tied=tied),
    )
    ref = model(lambda t, e: e[t], lambda x, w, y, tied: cross_entropy_ref(x, w.T if tied else w, y))

    loss = jax.jit(ours)(table, w_head)[1]
    assert loss.dtype == jnp.float32 and loss.shape == (b, s)
    _compare(ours, ref, (table, w_head), (d_emb, dloss, dloss_t), ["outputs", "dtable", "dw_head"])


# ---------------------------------------------------------------------------------------------------------
# Communication: elements received per device, from the compiled program (fp32: 4 bytes an element)
#
# The paper counts ceil(log2 q) = R tree rounds per broadcast and per reduce, q of each per product. In the
# compiled program a *broadcast* costs 1 + q(R-1) blocks, not qR: round 0 of the binomial tree does not depend
# on the root (every rank sends its own block to rank + 1), so XLA computes it once for all q steps (loop-
# invariant code motion; merged across the unrolled steps at q = 2) and keeps the one received block. A
# *reduce* carries step-dependent partial sums: qR blocks. So
#   AB: bcast(A) + bcast(B),  ABᵀ: bcast(B) + reduce(C),  AᵀB: bcast(A) + reduce(C)
# and against the paper's Table 1 every term is scaled by (1 + q(R-1)) / (qR) (1/2 at q = 2).
# ---------------------------------------------------------------------------------------------------------


def _rounds(q):
    return math.ceil(math.log2(q))


def bcast(q, size):
    return (1 + q * (_rounds(q) - 1)) * size


def reduce(q, size):
    return q * _rounds(q) * size


def _sds(grid, shape, spec, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(grid, spec))


def _permute_elements(fn, *args, devices=4):
    stats = compile_stats(fn, *args, num_devices=devices)
    assert stats.total_bytes_moved == stats.bytes_moved["collective-permute"], stats.bytes_moved
    return stats.bytes_moved["collective-permute"] // 4


def test_summa_bytes(meshes):
    grid, q, _ = optimus.grid_mesh(meshes["q2"])
    m, k, n = 16, 64, 32  # global; local blocks (m/q)×(k/q) etc.
    blk = lambda r, c: (r // q) * (c // q)
    shapes = {"ab": ((m, k), (k, n)), "abt": ((m, k), (n, k)), "atb": ((k, m), (k, n))}
    expected = {
        "ab": bcast(q, blk(m, k)) + bcast(q, blk(k, n)),
        "abt": bcast(q, blk(n, k)) + reduce(q, blk(m, n)),
        "atb": bcast(q, blk(k, m)) + reduce(q, blk(m, n)),
    }
    for form, (sa, sb) in shapes.items():
        got = _permute_elements(_summa(form, grid), _sds(grid, sa, BLOCK), _sds(grid, sb, BLOCK))
        assert got == expected[form], (form, got, expected[form])
    assert expected["ab"] * 2 == q * _rounds(q) * (blk(m, k) + blk(k, n))  # the paper's count, at q = 2


@pytest.mark.parametrize("form", list(FORMS))
def test_summa_backward_keeps_only_the_input_blocks(meshes, form):
    """The custom_vjp saves A and B (the local blocks) and nothing else: no received blocks, as autodiff
    through the scan would (its backward is made of the other two SUMMA forms)."""
    grid, _, _ = optimus.grid_mesh(meshes["q2"])
    _, sa, sb = FORMS[form]
    a, b = _normal(7, sa, sb)
    _, vjp = jax.vjp(jax.jit(_summa(form, grid)), a, b)
    residuals = [x for x in jax.tree.leaves(vjp) if hasattr(x, "shape")]
    assert sorted(x.size for x in residuals) == sorted([a.size, b.size]), [x.shape for x in residuals]


def test_layer_forward_bytes_against_table1(meshes):
    """Forward per device: MLP (h→4h, 4h→h) log(p)/(2√p)·(5bsh + 8h²), attention (fused QKV, output
    projection) log(p)/(2√p)·(2bsh + 4h²); together Table 1's log(p)/(2√p)·(7bsh + 12h²); each scaled by
    (1 + q(R-1))/(qR) for the shared tree round 0 (see above)."""
    mesh = meshes["q2"]
    grid, q, _data = optimus.grid_mesh(mesh)
    p = q * q
    b, s, h, n = 4, 8, 16, 4
    factor = math.log2(p) / (2 * math.sqrt(p)) * bcast(q, 1) / (q * _rounds(q))
    x_spec, tok_spec = P(("dp", "fsdp", "tpr"), None, "tpc"), P(("dp", "fsdp", "tpr"), None)
    x = _sds(grid, (b, s, h), x_spec)
    mlp = {"w_in": _sds(grid, (h, 4 * h), BLOCK), "w_out": _sds(grid, (4 * h, h), BLOCK)}
    attn = {name: _sds(grid, (h, h), BLOCK) for name in ("wq", "wk", "wv", "wo")}
    positions = _sds(grid, (b, s), tok_spec, jnp.int32)

    mlp_fwd = _permute_elements(lambda x, w: optimus_api.mlp_block(x, w, mesh=mesh), x, mlp)
    attn_fwd = _permute_elements(
        lambda x, w, pos: optimus_api.attention_block(x, w, pos, mesh=mesh, num_heads=n, num_kv_heads=n),
        x,
        attn,
        positions,
    )
    assert mlp_fwd == factor * (5 * b * s * h + 8 * h * h)
    assert attn_fwd == factor * (2 * b * s * h + 4 * h * h)
    assert mlp_fwd + attn_fwd == factor * (7 * b * s * h + 12 * h * h)


def test_embedding_bytes(meshes):
    """Only table blocks travel: forward broadcasts E_lj down the columns, backward reduces dE onto row l."""
    mesh = meshes["q2"]
    grid, q, _ = optimus.grid_mesh(mesh)
    b, s, v, h = 4, 8, 64, 32
    tok = _sds(grid, (b, s), P(("dp", "fsdp", "tpr"), None), jnp.int32)
    table = _sds(grid, (v, h), BLOCK)
    block = (v // q) * (h // q)
    assert _permute_elements(lambda t, e: optimus_api.embed(t, e, mesh=mesh), tok, table) == bcast(q, block)

    def fwd_bwd(t, e, g):
        return _value_and_vjp(lambda e: optimus_api.embed(t, e, mesh=mesh), (e,), g)

    g = _sds(grid, (b, s, h), P(("dp", "fsdp", "tpr"), None, "tpc"))
    assert _permute_elements(fwd_bwd, tok, table, g) == bcast(q, block) + reduce(q, block)


# ---------------------------------------------------------------------------------------------------------
# Memory: a few blocks in flight (stepwise) vs gathered row/column panels (collapsed all_gather)
# ---------------------------------------------------------------------------------------------------------


def collapsed_ab(a, b):
    """Algorithm 1 with the whole row panel of A and column panel of B gathered at once (q blocks each)."""
    return jax.lax.all_gather(a, "tpc", axis=1, tiled=True) @ jax.lax.all_gather(b, "tpr", axis=0, tiled=True)


def _memory_stats(grid, q, block_rows=16, block_cols=1024):
    """Compiled temp bytes and bytes moved of stepwise and collapsed AB, with A blocks [16, 1024] and B
    blocks [1024, 16] (the long contraction makes the A and B blocks dominate C)."""
    m, k = block_rows * q, block_cols * q
    args = (_sds(grid, (m, k), BLOCK), _sds(grid, (k, m), BLOCK))
    out = {}
    for name, fn in (("stepwise", optimus_layers.summa_ab), ("collapsed", collapsed_ab)):
        stats = compile_stats(
            jax.shard_map(fn, mesh=grid, in_specs=(BLOCK, BLOCK), out_specs=BLOCK), *args, num_devices=q * q
        )
        out[name] = {"temp": stats.temp_bytes, "moved": stats.total_bytes_moved}
    return out, 2 * block_rows * block_cols * 4  # |A block| + |B block| in bytes


def test_stepwise_summa_uses_less_memory_than_panels(meshes):
    grid, q, _ = optimus.grid_mesh(meshes["q2"])
    r, blocks = _memory_stats(grid, q)
    assert r["stepwise"]["temp"] < r["collapsed"]["temp"], r
    assert r["stepwise"]["moved"] == bcast(q, blocks) == r["collapsed"]["moved"]  # q = 2: one block each


MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path[:0] = ["tests/unit/parallel", "tests"]  # this module, and the helpers it imports
    import jax
    import test_optimus as t
    from jaxring import make_mesh
    from jaxring.parallel.tensor import optimus, optimus_api, optimus_layers
    grid, q, _ = optimus.grid_mesh(make_mesh(tp=jax.device_count()))
    r, blocks = t._memory_stats(grid, q)
    print(json.dumps({"q": q, "blocks": blocks, **r}))
""")


def test_stepwise_memory_is_constant_in_q_panels_grow():
    """At q = 8 (64 simulated devices, compiled only, in a subprocess): stepwise SUMMA holds a constant
    number of blocks (the shared round-0 block, the current and the prefetched one, and one round in flight:
    under 4 per matrix; 3.5 measured: its steps only compute, so they carry no guard against XLA:CPU's
    rendezvous deadlock, whose copy of the data made it 4.5), the collapsed form q-block panels (at least
    2q = 16)."""
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=64", JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="64"
    )
    root = str(ROOT)
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    r = json.loads(result.stdout.strip().splitlines()[-1])
    q, blocks = r["q"], r["blocks"]  # blocks: |A block| + |B block| in bytes
    assert q == 8
    assert r["stepwise"]["temp"] < 4 * blocks, r
    assert r["collapsed"]["temp"] >= q * blocks, r
    assert r["stepwise"]["moved"] == bcast(q, blocks), r  # (1 + 8·2) blocks of A and of B


# ---------------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------------


def test_errors(meshes):
    x = jnp.zeros((4, 4, 8))
    mlp = {"w_in": jnp.zeros((8, 16)), "w_out": jnp.zeros((16, 8))}
    with pytest.raises(ValueError, match="tp = 8 is not a perfect square"):
        optimus_api.mlp_block(x, mlp, mesh=make_mesh(tp=8))
    with pytest.raises(ValueError, match="sp=2 > 1 cannot be used"):
        optimus_api.mlp_block(x, mlp, mesh=make_mesh(sp=2, tp=4))
    with pytest.raises(ValueError, match="batch 2 is not divisible by data degree × q = 2×2"):
        optimus_api.mlp_block(jnp.zeros((2, 4, 8)), mlp, mesh=meshes["dp2_q2"])
    with pytest.raises(ValueError, match="w_in dimension 5 is not divisible by q"):
        optimus_api.mlp_block(x, {"w_in": jnp.zeros((8, 5)), "w_out": jnp.zeros((5, 8))}, mesh=meshes["q2"])
    with pytest.raises(ValueError, match="needs params\\['w_gate'\\]"):
        optimus_api.mlp_block(x, mlp, mesh=meshes["q2"], activation="swiglu")
    attn = {"wq": jnp.zeros((8, 12)), "wk": jnp.zeros((8, 4)), "wv": jnp.zeros((8, 4)), "wo": jnp.zeros((12, 8))}
    pos = jnp.zeros((4, 4), jnp.int32)
    with pytest.raises(ValueError, match="num_heads 3 is not divisible by q"):
        optimus_api.attention_block(x, attn, pos, mesh=meshes["q2"], num_heads=3, num_kv_heads=1)
    attn["wq"], attn["wo"] = jnp.zeros((8, 16)), jnp.zeros((16, 8))
    with pytest.raises(ValueError, match="num_kv_heads 1 is not divisible by q"):
        optimus_api.attention_block(x, attn, pos, mesh=meshes["q2"], num_heads=4, num_kv_heads=1)
    with pytest.raises(ValueError, match="vocab 5 is not divisible by q"):
        optimus_api.embed(jnp.zeros((4, 4), jnp.int32), jnp.zeros((5, 8)), mesh=meshes["q2"])
    with pytest.raises(ValueError, match="vocab 7 is not divisible by q"):
        optimus_api.cross_entropy(x, jnp.zeros((8, 7)), jnp.zeros((4, 4), jnp.int32), mesh=meshes["q2"])
    with pytest.raises(ValueError, match="hidden 5 is not divisible by q"):
        optimus_api.layer_norm(jnp.zeros((4, 4, 5)), jnp.ones(5), jnp.zeros(5), mesh=meshes["q2"])
    specs = optimus_api.param_specs(meshes["q2"], {"w_in": (8, 16), "scale": (8,)})
    assert specs["w_in"].spec == BLOCK and specs["scale"].spec == P("tpc")
