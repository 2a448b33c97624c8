"""The registry: a sequence strategy registered from outside the library, with an option and a cost of its own,
is a flag of train.py, a key of its YAML, a keyword of make_plan, and a plan the planner prices and ranks, with
no other file edited. A strategy registered without a cost makes the planner refuse it in one line.

The strategy here ("mine") is all-gather context parallelism done in `chunks` head groups: q, k, v are split
into `chunks` groups of heads (K/V head j serves query heads of group j // (kv_heads / chunks)), each group
gathers its own K/V and attends (`allgather_attention`), and the outputs are concatenated. The same bytes as
"allgather" in `chunks` times the messages.
"""

import dataclasses
import json
from importlib.metadata import EntryPoint

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxring
from jaxring.kernels.reference import attention_reference
from jaxring.parallel import registry
from jaxring.parallel.catalog import ENTRY_POINT_GROUP, load_entry_points, sequence_strategies, sequence_strategy
from jaxring.parallel.registry import Option, SequenceStrategy, registered
from jaxring.parallel.sequence.allgather import allgather_attention, allgather_cost
from jaxring.parallel.sequence.ring import ring_attention
from jaxring.run.spec import RunSpec

# ------------------------------------------------------------------------------------------ the new strategy


def _attend(q, k, v, segment_ids=None, *, axis_name, layout, causal, sm_scale, block_ops, chunks):
    groups = zip(*(jnp.split(x, chunks, axis=2) for x in (q, k, v)))
    kw = dict(axis_name=axis_name, layout=layout, causal=causal, sm_scale=sm_scale, block_ops=block_ops)
    return jnp.concatenate([allgather_attention(qg, kg, vg, segment_ids, **kw) for qg, kg, vg in groups], axis=2)


def _check_chunks(chunks, sp):
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks {chunks!r} must be a positive integer")


def _check_heads(q_heads, kv_heads, sp, options):
    if kv_heads % options["chunks"]:
        raise ValueError(f"kv heads {kv_heads} are not divisible by chunks = {options['chunks']}")


def _cost(shape, options):
    gathered = allgather_cost(shape, {})
    more = tuple(dataclasses.replace(t, messages=t.messages * options["chunks"]) for t in gathered.transfers)
    return dataclasses.replace(gathered, transfers=more)


MINE = SequenceStrategy(
    "mine",
    "all-gather context parallelism in head groups (a test's strategy)",
    attend=_attend,
    check_heads=_check_heads,
    cost=_cost,
    options=(
        Option("chunks", "head groups gathered one after another", _check_chunks, default=2, search=lambda sp: (2, 4)),
    ),
)

SMALL = {"num_layers": 1, "hidden": 64, "num_heads": 8, "ffn": 128}
FLAGS = ["--steps", "2", "--batch-size", "4", "--seq-len", "64", "--sample-tokens", "0", "--no-progress"]
FLAGS += [x for k, v in SMALL.items() for x in ("--override", f"{k}={v}")]


@pytest.fixture
def mine():
    with registered(MINE) as entry:
        yield entry
    assert "mine" not in sequence_strategies()


def test_the_new_strategy_attends_as_the_reference(mine):
    """Forward and dQ/dK/dV against the dense reference (causal, GQA) on 8 devices."""
    mesh = jaxring.make_mesh(sp=8)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (2, 64, 8, 16))
    k, v = (jax.random.normal(key, (2, 64, 4, 16)) for key in keys[1:3])
    dout = jax.random.normal(keys[3], q.shape)

    def loss(f):
        return lambda q, k, v: jnp.sum(f(q, k, v) * dout)

    ours = lambda q, k, v: jaxring.sharded_attention(q, k, v, mesh=mesh, strategy="mine", causal=True, chunks=2)
    ref = lambda q, k, v: attention_reference(q, k, v, causal=True)[0]
    np.testing.assert_allclose(ours(q, k, v), ref(q, k, v), rtol=1e-5, atol=1e-5)
    for got, want in zip(jax.grad(loss(ours), (0, 1, 2))(q, k, v), jax.grad(loss(ref), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.heavy
def test_the_new_strategy_is_a_flag_a_yaml_key_a_plan_and_trains(mine, tmp_path):
    import train
    from jaxring.run.cli import build_parser

    help_text = " ".join(build_parser().format_help().split())
    assert "--chunks CHUNKS mine: head groups gathered one after another (default: 2)" in help_text
    assert "mine: all-gather context parallelism in head groups" in help_text

    plan = jaxring.make_plan(sp=8, attention="mine", chunks=2)
    assert plan.attention == "mine" and plan.strategy_options == {"chunks": 2}
    with pytest.raises(ValueError, match="chunks 0 must be a positive integer"):
        jaxring.make_plan(sp=8, attention="mine", chunks=0)

    flags_metrics, yaml_metrics = tmp_path / "flags.jsonl", tmp_path / "yaml.jsonl"
    argv = ["--sp", "8", "--attention", "mine", "--chunks", "4", *FLAGS]
    assert train.main([*argv, "--metrics-file", str(flags_metrics), "--out-dir", str(tmp_path / "a")]) == 0
    written = RunSpec.load(tmp_path / "a" / "run.yaml")
    # the resolved run names every option of its entries: the strategy's and the tensor method's ("none")
    assert written.parallel.attention == "mine"
    assert written.parallel.options == {"chunks": 4, "vocab_split": "none"}

    config = tmp_path / "run.yaml"
    config.write_text(written.updated(metrics_file=str(yaml_metrics), out_dir=str(tmp_path / "b")).to_yaml())
    assert "chunks: 4" in config.read_text()
    assert train.main(["--config", str(config)]) == 0
    losses = [[json.loads(line)["loss"] for line in f.read_text().splitlines()] for f in (flags_metrics, yaml_metrics)]
    assert len(losses[0]) == 2 and np.isfinite(losses[0]).all()
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)  # the same run, from flags and from YAML


def test_the_planner_prices_and_ranks_the_new_strategy(mine):
    from jaxring.models import gpt
    from jaxring.planner import Candidate, Cluster, Workload, evaluate, search
    from jaxring.planner import cost_model as cost

    w = Workload("gpt", gpt.GPTConfig(vocab_size=128, num_layers=2, hidden=64, num_heads=8, ffn=256), 512, 8, "fp32")
    cluster = Cluster.of("cpu", 8)
    theirs = evaluate(w, Candidate.of(sp=8, attention="allgather", micro_batch=8), cluster)
    ours = evaluate(w, Candidate.of(sp=8, attention="mine", chunks=4, micro_batch=8), cluster)
    core = [t for t in ours.transfers if t.axes == ("sp",) and "K/V" in t.what]
    assert core and all(t.bytes > 0 for t in core)
    assert ours.bytes_by_axes() == theirs.bytes_by_axes()  # the same collectives, split in head groups
    # in 4 head groups: 4× the all-gather's and the reduce-scatter's messages
    mine_core = cost.shapes(w, Candidate.of(sp=8, attention="mine", chunks=4, micro_batch=8)).core.transfers
    allgather_core = cost.shapes(w, Candidate.of(sp=8, attention="allgather", micro_batch=8)).core.transfers
    assert [t.messages for t in mine_core] == [4 * t.messages for t in allgather_core]

    result = search(w, cluster, only={"sp": 8})
    chosen = {(ev.candidate.attention, ev.candidate.option("chunks")) for ev in result.ranked}
    assert {("mine", 2), ("mine", 4), ("allgather", None), ("ring", None)} <= chosen
    mine_plans = [ev for ev in result.ranked if ev.candidate.attention == "mine"]
    assert "mine(chunks=" in mine_plans[0].candidate.describe()
    assert "--chunks" in mine_plans[0].candidate.train_flags()


def test_a_strategy_without_a_cost_is_refused_by_the_planner_in_one_line(capsys):
    from jaxring.planner import Cluster, Workload, search
    from jaxring.planner.__main__ import main as planner_main

    def attend(q, k, v, segment_ids=None, *, axis_name, layout, causal, sm_scale, block_ops):
        return ring_attention(
            q, k, v, segment_ids, axis_name=axis_name, layout=layout, causal=causal, block_ops=block_ops
        )

    with registered(SequenceStrategy("costless", "a ring without a cost model", attend=attend)):
        w = Workload.of("gpt", "tiny", seq_len=256, global_batch=8, precision="fp32")
        with pytest.raises(ValueError, match="sequence strategy 'costless' has no cost model") as e:
            search(w, Cluster.of("cpu", 8), only={"attention": "costless"})
        assert "\n" not in str(e.value)
        argv = ["--preset", "tiny", "--seq-len", "256", "--global-batch", "8", "--devices", "8", "--device", "cpu"]
        assert planner_main([*argv, "--only", "attention=costless"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: sequence strategy 'costless' has no cost model") and err.count("\n") == 1


# ------------------------------------------------------------------------------------------ entry points

PLUGIN = """
from jaxring.parallel.registry import SequenceStrategy
from jaxring.parallel.sequence.ring import STRATEGY as RING

STRATEGY = SequenceStrategy("plugged", "a ring from another package", attend=RING.attend, cost=RING.cost)
NOT_AN_ENTRY = 42
ANOTHER_RING = SequenceStrategy("ring", "a second entry of a taken name", attend=RING.attend)
"""


def test_an_entry_point_is_registered_and_a_broken_one_is_one_line(tmp_path, monkeypatch):
    """The catalog registers what the `jaxring.parallel` entry points of installed packages name; one that
    does not load, or names no entry, ends in one line naming it."""
    (tmp_path / "jaxring_test_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_SEQUENCE", sequence_strategies())  # the registry as it was, afterwards
    load_entry_points([EntryPoint("plugged", "jaxring_test_plugin:STRATEGY", ENTRY_POINT_GROUP)])
    assert sequence_strategy("plugged").summary == "a ring from another package"
    assert jaxring.make_plan(sp=8, attention="plugged").strategy.name == "plugged"

    for value, reason in [
        ("jaxring_no_such_plugin:STRATEGY", "ModuleNotFoundError: No module named 'jaxring_no_such_plugin'"),
        ("jaxring_test_plugin:NOT_AN_ENTRY", "TypeError: 42 is not a SequenceStrategy, TensorMethod or"),
        ("jaxring_test_plugin:ANOTHER_RING", "ValueError: sequence strategy 'ring' is already registered"),
    ]:
        with pytest.raises(ValueError) as e:
            load_entry_points([EntryPoint("broken", value, ENTRY_POINT_GROUP)])
        message = str(e.value)
        assert message.startswith(f"entry point broken = {value} (group jaxring.parallel) is broken: "), message
        assert reason in message and "\n" not in message


def test_an_option_named_like_a_run_setting_is_refused_in_one_line():
    """A registered entry's option would be a flag and a YAML key of the parallel section: one named like a
    run setting (steps) is refused when the specification builds its settings."""

    def attend(q, k, v, segment_ids=None, **kw):
        raise AssertionError("not called")

    shadow = SequenceStrategy(
        "shadow", "a strategy with an option named steps", attend=attend, options=(Option("steps", "?", _check_chunks),)
    )
    from jaxring.run.cli import build_parser

    builds = (build_parser, lambda: RunSpec.of(team_size=2), lambda: jaxring.make_plan(sp=8))
    with registered(shadow):
        for build in builds:
            with pytest.raises(ValueError) as e:
                build()
            assert str(e.value) == "sequence strategy 'shadow': option 'steps' would shadow a run setting"
    build_parser()  # gone with its entry
