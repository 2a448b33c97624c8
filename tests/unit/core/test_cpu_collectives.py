"""Programs on simulated CPU devices never deadlock in XLA:CPU's collectives (see jaxring/core/collectives.py).

XLA:CPU runs every simulated device on a thread of its own and a collective blocks until every device's
thread has joined it. Notebook 02's METP attention block at tp=8 (seq 1024, hidden 256) aborted on its first
run: two devices waited in a permute of the inner K/V ring (a loop) while six waited in a round of the next
head group's weight broadcast, issued beside that loop in the outer loop's body and independent of it. Two
checks:

* the compiled programs (METP, Optimus, ring; forward and backward in one program) hold no such pair: inside
  a loop body, no loop or conditional holding collectives is independent of another collective (a static
  check on the HLO; METP's forward and backward bodies had 12 and 15 such pairs before the fix);
* the programs run repeatedly at two sizes, in a child process whose collectives give up after 20 s (XLA's
  own timeout, instead of its 40 s) so that a deadlock is a failed test, never a hang.
"""

import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT
from jax.sharding import PartitionSpec as P

import jaxring

COLLECTIVE = re.compile(
    r"\b(collective-permute|all-reduce|all-gather|all-to-all|reduce-scatter|collective-broadcast)(-start)?\("
)
CALLED = re.compile(
    r"\b(?:body|condition|to_apply|calls|branch_computations|true_computation|false_computation)"
    r"=(\{[^}]*\}|%?[\w.\-]+)"
)


def _computations(hlo: str) -> tuple[dict[str, list[tuple[str, str]]], str]:
    """{computation: [(instruction, its text)]} of a compiled module's text, and the entry's name."""
    comps, current, entry = {}, None, ""
    for line in hlo.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{") and "=" not in line.split("(")[0]:
            current = re.match(r"^(?:ENTRY )?%?([\w.\-]+)", line).group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
            continue
        m = re.match(r"\s+(?:ROOT )?%([\w.\-]+) = (.*)$", line)
        if current is not None and m:
            comps[current].append((m.group(1), m.group(2)))
    return comps, entry


def _called(text: str) -> list[str]:
    return [n.strip().lstrip("%") for group in CALLED.findall(text) for n in group.strip("{}").split(",") if n.strip()]


def _ancestors(operands: dict[str, set[str]]) -> dict[str, set[str]]:
    """{instruction: every instruction it depends on, directly or not}."""
    out = {}
    for n in operands:
        seen, stack = set(), list(operands[n])
        while stack:
            m = stack.pop()
            if m not in seen:
                seen.add(m)
                stack.extend(operands.get(m, ()))
        out[n] = seen
    return out


def independent_collectives(hlo: str) -> list[tuple[str, str, str]]:
    """(computation, a, b) for every pair in a loop body or branch where a is a while/conditional holding
    collectives, b a collective (or another such op), and neither depends on the other."""
    comps, entry = _computations(hlo)
    memo = {}

    def holds(c, path=()):
        if c not in memo:
            if c in path or c not in comps:
                return False
            memo[c] = any(COLLECTIVE.search(t) for _, t in comps[c]) or any(
                holds(d, (*path, c)) for _, t in comps[c] for d in _called(t)
            )
        return memo[c]

    found = []
    for c, instructions in comps.items():
        if c == entry:
            continue
        names = {n for n, _ in instructions}
        operands = {n: set(re.findall(r"%([\w.\-]+)", t.split(", metadata=")[0])) & names for n, t in instructions}
        kind = {}
        for n, t in instructions:
            if COLLECTIVE.search(t):
                kind[n] = "collective"
            elif re.search(r"\b(while|conditional)\(", t) and any(holds(d) for d in _called(t)):
                kind[n] = "control"
        if "control" not in kind.values():
            continue
        before = _ancestors(operands)
        ops = list(kind)
        for i, a in enumerate(ops):
            for b in ops[i + 1 :]:
                if "control" in (kind[a], kind[b]) and a not in before[b] and b not in before[a]:
                    found.append((c, a, b))
    return found


def _forward_backward(f):
    def run(x, w, positions, dy):
        out, vjp = jax.vjp(lambda x, w: f(x, w, positions), x, w)
        return out, vjp(dy)

    return run


def _tensor_program(method: str, seq: int, hidden: int):
    """(jitted forward + backward of a method's attention block, its abstract arguments)."""
    from jaxring.parallel.tensor import metp_api, optimus_api

    module, mesh = {
        "metp": (metp_api, jaxring.make_mesh(tp=8)),
        "optimus": (optimus_api, jaxring.make_mesh(dp=2, tp=4)),
    }[method]
    batch = 4
    block = lambda x, w, p: module.attention_block(x, w, p, mesh=mesh, num_heads=8, num_kv_heads=8, causal=True)
    x = jax.ShapeDtypeStruct((batch, seq, hidden), jnp.float32)
    w = {n: jax.ShapeDtypeStruct((hidden, hidden), jnp.float32) for n in ("wq", "wk", "wv", "wo")}
    return jax.jit(_forward_backward(block)), (x, w, jax.ShapeDtypeStruct((batch, seq), jnp.int32), x)


@pytest.mark.heavy
@pytest.mark.parametrize("method", ["metp", "optimus"])
def test_no_loop_body_holds_independent_collectives(method):
    """METP's outer loop bodies held 27 such pairs (the next group's broadcast beside the inner ring; the
    W_proj gradient's tree reduce beside the backward ring) before `prefetch_steps` and METP's backward made
    them wait; the deadlock in notebook 02 was one of them."""
    run, args = _tensor_program(method, 128, 64)
    hazards = independent_collectives(run.lower(*args).compile().as_text())
    assert hazards == [], hazards[:5]


def test_the_check_finds_an_independent_pair():
    """The static check is not vacuous: a ring loop beside an unrelated permute inside a scan is found."""
    from jaxring.core.collectives import ppermute, ring_pairs, ring_steps, send_to_next

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))

    def local(a, b):
        def body(carry, _):
            a, b = carry
            ring = ring_steps(lambda c, kv, s: c + kv, jnp.zeros_like(a), a, 8, lambda kv: send_to_next(kv, "x"))
            return (ring, ppermute(b, "x", ring_pairs(8, 4))), None

        a, b = jax.lax.scan(body, (a, b), jnp.arange(2))[0]
        return a + b

    run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))
    x = jax.ShapeDtypeStruct((64, 8), jnp.float32)
    assert independent_collectives(run.lower(x, x).compile().as_text())


STRESS = textwrap.dedent(
    """
    import sys, time
    import jax, jax.numpy as jnp, numpy as np
    from jaxring.core.device_setup import use_cpu_devices_if_no_accelerator
    devices = use_cpu_devices_if_no_accelerator(8)
    sys.path[:0] = {tests!r}  # this module's folder and the helpers'
    import jaxring
    from test_cpu_collectives import _tensor_program
    mesh = jaxring.make_mesh(sp=8)

    def ring_program(seq, heads):
        def run(q, k, v, do):
            attend = lambda q, k, v: jaxring.sharded_attention(q, k, v, mesh=mesh, strategy="ring", causal=True)
            out, vjp = jax.vjp(attend, q, k, v)
            return out, vjp(do)
        q = jax.ShapeDtypeStruct((2, seq, heads, 32), jnp.float32)
        return jax.jit(run), (q, q, q, q)

    programs = [_tensor_program(m, s, h) for m in ("metp", "optimus") for s, h in ((128, 64), (64, 32))]
    programs += [ring_program(s, h) for s, h in ((256, 8), (128, 4))]
    for i, (run, args) in enumerate(programs):
        keys = jax.random.split(jax.random.PRNGKey(i), len(jax.tree.leaves(args)))
        values = [jax.random.normal(k, a.shape).astype(a.dtype) if a.dtype != jnp.int32
                  else jnp.broadcast_to(jnp.arange(a.shape[1], dtype=jnp.int32), a.shape)
                  for k, a in zip(keys, jax.tree.leaves(args))]
        values = jax.tree.unflatten(jax.tree.structure(args), values)
        compiled = run.lower(*args).compile()
        for _ in range(3):
            jax.block_until_ready(compiled(*values))
        print("ok", i, flush=True)
    """
)


@pytest.mark.slow  # a 2-4 minute stress run in a child process
def test_tensor_and_ring_programs_run_repeatedly_without_deadlock(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
        # a deadlocked collective aborts the child after 20 s (XLA's default: 40 s) instead of waiting
        XLA_FLAGS="--xla_cpu_collective_call_terminate_timeout_seconds=20",
    )
    script = tmp_path / "stress.py"
    script.write_text(STRESS.format(tests=[str(ROOT / "tests" / "unit" / "core"), str(ROOT / "tests")]))
    try:
        out = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path
        )
    except subprocess.TimeoutExpired as e:  # (subprocess.run kills the child)
        pytest.fail(f"the programs hung: {e}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [w for i in range(6) for w in ("ok", str(i))]


def test_the_cpu_permute_lowering_is_explicit():
    """Importing jaxring changes none of JAX's lowerings; use_simulated_devices() gives each CPU
    collective-permute its own channel id."""
    code = textwrap.dedent(
        """
        import re, jax, jax.numpy as jnp, numpy as np
        from jax.sharding import PartitionSpec as P
        import jaxring, jaxring.core.collectives, jaxring.core.device_setup, jaxring.parallel.tensor.metp, jaxring.train.loop
        from jaxring.core.collectives import tree_broadcast
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
        f = jax.jit(jax.shard_map(lambda a: tree_broadcast(a, "x", 0), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        channels = lambda: sorted(set(re.findall(r"collective-permute.*channel_id=(\\d+)", f.lower(jnp.ones(8)).as_text("hlo"))))
        before = channels()
        jaxring.core.device_setup.use_simulated_devices()
        f = jax.jit(jax.shard_map(lambda a: tree_broadcast(a, "x", 1), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        print(len(before), len(channels()))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "3"]


def test_persistent_compilation_cache_is_off_on_simulated_devices(capsys):
    """A cache directory set by the user is turned off on several simulated CPU devices, in one line; one
    device, or an accelerator, keeps it. (A step read back from the cache hung train.py's second run.)"""
    from jaxring.core.device_setup import no_compilation_cache_on_simulated_devices

    was, where = jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", "/tmp/some-cache")
    try:
        assert not no_compilation_cache_on_simulated_devices(jax.devices()[:1])
        assert jax.config.jax_enable_compilation_cache == was
        assert no_compilation_cache_on_simulated_devices(jax.devices()) == was
        assert not jax.config.jax_enable_compilation_cache
        if was:
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and "/tmp/some-cache" in err[0] and "8 simulated CPU devices" in err[0], err
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        jax.config.update("jax_compilation_cache_dir", where)
