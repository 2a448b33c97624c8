"""docs/adding-an-option.md, followed as written: a strategy option added in its strategy's own file (here, in
process: a copy of the ring entry with one more Option) and a typed memory option (--offload: its own file
`jaxring/nn/offload.py`, one field of `MemorySettings`) reach the command line, the YAML form, `make_plan`, the
strategy itself and the planner's candidates with no generic file edited; every field of the one parallel settings
type (`ParallelSettings`) reaches the spec, the plan and the candidate. Fast: no step is compiled.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jaxring
from jaxring.nn import Offload
from jaxring.parallel.catalog import sequence_strategies, sequence_strategy
from jaxring.parallel.registry import Option
from jaxring.parallel.registry import registered as registered_entry
from jaxring.parallel.settings import FIELDS, ParallelSettings
from jaxring.planner.auto import held_settings
from jaxring.planner.fit import candidate_of
from jaxring.planner.space import NOT_CHOSEN, Candidate
from jaxring.run.cli import build_parser, parse_command_line
from jaxring.run.schema import MemorySettings, flag_name
from jaxring.run.spec import RunSpec

# ------------------------------------------------------------------------------------------ a strategy option

SEEN = []  # the option's values as the strategy's attend received them


def _check_passes(passes: int, sp: int) -> None:
    """The option's rule: one line naming the value and the rule."""
    if isinstance(passes, bool) or not isinstance(passes, int) or not 1 <= passes <= sp:
        raise ValueError(f"--toy-passes {passes!r} must be an integer in [1, sp = {sp}]")


TOY_PASSES = Option(
    "toy_passes", "passes over the ring (a test's option)", _check_passes, default=1, search=lambda sp: (1, 2)
)


def _attend(q, k, v, segment_ids=None, *, toy_passes, **kw):
    SEEN.append(toy_passes)
    return sequence_strategy("ring").attend(q, k, v, segment_ids, **kw)


# the strategy's own file: its entry, with the new Option among its options
TOY = dataclasses.replace(
    sequence_strategy("ring"), name="toyring", attend=_attend, options=(*sequence_strategy("ring").options, TOY_PASSES)
)


@pytest.fixture
def toy():
    with registered_entry(TOY) as entry:
        yield entry
    assert "toyring" not in sequence_strategies()


def test_a_strategy_option_is_a_flag_a_yaml_key_a_plan_keyword_and_a_candidate_setting(toy):
    help_text = " ".join(build_parser().format_help().split())
    assert "--toy-passes TOY_PASSES toyring: passes over the ring (a test's option) (default: 1)" in help_text

    flags, _ = parse_command_line(["--sp", "8", "--attention", "toyring", "--toy-passes", "2"])
    from_yaml = RunSpec.from_yaml("parallel:\n  sp: 8\n  attention: toyring\n  toy_passes: 2\n")
    assert flags.parallel.options == from_yaml.parallel.options == {"toy_passes": 2}
    resolved = from_yaml.resolved(device_count=8)
    assert resolved.parallel.options["toy_passes"] == 2
    assert "toy_passes: 2" in resolved.to_yaml()
    with pytest.raises(ValueError, match=r"--toy-passes 9 must be an integer in \[1, sp = 8\]"):
        RunSpec.of(sp=8, attention="toyring", toy_passes=9).resolved(device_count=8)

    plan = jaxring.make_plan(sp=8, attention="toyring", toy_passes=2)
    assert plan.strategy_options["toy_passes"] == 2 and "toy_passes=2" in plan.describe()
    assert resolved.plan().strategy_options == plan.strategy_options

    # the strategy receives it (traced, not compiled)
    SEEN.clear()
    q = jnp.zeros((1, 64, 2, 8))
    attend = lambda q: jaxring.sharded_attention(q, q, q, mesh=plan.mesh, strategy="toyring", toy_passes=2)
    jax.eval_shape(attend, q)
    assert SEEN and set(SEEN) == {2}

    # the planner: the values it searches, a candidate's settings, flags and description
    assert {g["toy_passes"] for g in toy.option_grid(8)} == {1, 2}
    c = Candidate.of(sp=8, attention="toyring", toy_passes=2)
    assert c.settings()["toy_passes"] == 2
    assert c.train_flags()[-2:] == ["--toy-passes", "2"]
    assert "toy_passes=2" in c.describe()
    assert RunSpec.of(**c.settings()).parallel.options["toy_passes"] == 2


# ------------------------------------------------------------------------------------------ a memory option


@pytest.mark.parametrize("text", ["none", "layer_inputs", "optimizer", "layer_inputs+optimizer", "weights"])
def test_a_typed_memory_option_is_parsed_once_and_written_as_its_text(text):
    value = Offload.parse(text)
    assert str(value) == text and Offload.parse(value) is value
    flags, _ = parse_command_line(["--offload", text])
    from_yaml = RunSpec.from_yaml(f"memory:\n  offload: {text}\n")
    assert flags.memory.offload == from_yaml.memory.offload == value  # typed from the first read
    assert isinstance(flags.memory.offload, Offload)
    assert f"offload: {text}" in flags.to_yaml()  # run.yaml keeps the flag's text
    c = Candidate.of(sp=8, attention="ring", offload=text)
    assert c.memory.offload == value and c.settings()["offload"] == value
    assert ("--offload" in c.train_flags()) == bool(value)
    assert RunSpec.of(**c.settings()).memory.offload == value


def test_the_memory_option_parts_and_its_one_line_error():
    both = Offload.parse("layer_inputs+weights")
    assert (both.layer_inputs, both.optimizer, both.weights) == (True, True, True)  # the weights take the state
    assert both.parts == {"layer_inputs", "optimizer", "weights"} and both.beyond_optimizer
    assert not Offload.parse("optimizer").beyond_optimizer and not Offload.parse("none")
    with pytest.raises(ValueError, match=r"--offload 'weight' is not one of none, layer_inputs, .*"):
        Offload.parse("weight")
    with pytest.raises(ValueError, match=r"--offload 'weight' is not one of none, layer_inputs, .*did you mean"):
        RunSpec.of(offload="weight").validate()  # the spec's own one-line check, as before


# a non-default value of each memory choice (the budgets are the run's, not a choice of its plan)
NON_DEFAULT = {"remat": "full", "remat_layers": 2, "loss_tile": 128, "mlp_tile": 64, "offload": "layer_inputs"}
NEEDS = {"remat_layers": {"remat": "full"}, "offload": {"remat": "full"}}  # what the option's own rule needs


def test_every_memory_choice_reaches_the_candidate_with_no_planner_edit():
    """The planner's candidate holds the run's own `MemorySettings` (budgets left out): a memory option added to
    the configuration type is a candidate setting, a train.py flag of it, a part of its description and a value
    the search holds, with no edit of the planner. NON_DEFAULT must name every choice, so a new one fails here
    until it is given a value."""
    defaults = MemorySettings().choices()
    assert set(NON_DEFAULT) == set(defaults), "give the new memory choice a non-default value in NON_DEFAULT"
    for name, text in NON_DEFAULT.items():
        spec = RunSpec.of(sp=8, **NEEDS.get(name, {}), **{name: text})
        value = getattr(spec.memory, name)
        assert value != defaults[name]
        c = candidate_of(spec.resolved(device_count=8))
        assert c.setting(name) == value and c.memory == spec.memory.choice(), name
        assert c.settings()[name] == value and RunSpec.of(**c.settings()).memory.choices() == spec.memory.choices()
        flags = c.train_flags()
        assert flags[flags.index(flag_name(name)) + 1] == str(value), (name, flags)
        assert f"{name}={value}" in c.describe(), c.describe()
        assert Candidate.of(sp=8, attention="ring", **NEEDS.get(name, {}), **{name: text}).memory == c.memory
        assert held_settings(spec)[name] == value  # --plan auto holds what the user gave
    assert Candidate.of(sp=8).memory.device_memory_gib is None
    budgeted = candidate_of(RunSpec.of(sp=8, device_memory_gib=40.0).resolved(device_count=8))
    assert budgeted == candidate_of(RunSpec.of(sp=8).resolved(device_count=8))  # a budget is no plan choice


# ------------------------------------------------------------------------------------------ a parallel setting

# a non-default value of each parallel setting, with what its own rules need (8 devices)
NON_DEFAULT_PARALLEL = {
    "dp": (2, {"sp": 4}),
    "fsdp": (2, {"sp": 4}),
    "pp": (2, {"sp": 4, "microbatches": 4}),
    "tp": (2, {"sp": 4}),
    "sp": (4, {"dp": 2}),
    "ep": (2, {"sp": 4, "preset": "tiny-moe"}),
    "attention": ("ulysses", {"sp": 8}),
    "layout": ("contiguous", {"sp": 8}),
    "tensor_parallel": ("metp", {"tp": 8}),
    "zero": (1, {"dp": 2, "sp": 4}),
    "pipeline_schedule": ("gpipe", {"pp": 2, "sp": 4, "microbatches": 4}),
    "microbatches": (4, {"pp": 2, "sp": 4}),
    "block_ops": ("jnp", {"sp": 8}),
}
# what the candidate holds otherwise: fsdp counts as dp (the same program)
CANDIDATE_HOLDS = {"fsdp": ("dp", 2 * 1)}


def test_the_run_the_planner_and_the_plan_hold_one_parallel_settings_value():
    """`ParallelSettings` (jaxring/parallel/settings.py) is declared once: the run's parallel section is it (plus
    --plan), the planner's candidate holds it, and the plan takes it and holds it resolved. Each field, given a
    non-default value, reaches the flag, the YAML form, the candidate and the plan with no other edit;
    NON_DEFAULT_PARALLEL must name every field, so a new one fails here until it is given a value."""
    assert set(NON_DEFAULT_PARALLEL) == set(FIELDS), "give the new parallel setting a value in NON_DEFAULT_PARALLEL"
    devices = jax.devices()[:8]
    for name, (value, needs) in NON_DEFAULT_PARALLEL.items():
        spec = RunSpec.of(**needs, **{name: value})
        assert isinstance(spec.parallel, ParallelSettings) and getattr(spec.parallel, name) == value
        flags, _ = parse_command_line([f"{flag_name(name)}={value}", *_flags(needs)])
        assert getattr(flags.parallel, name) == value, name
        assert getattr(RunSpec.from_yaml(spec.to_yaml()).parallel, name) == value, name
        resolved = spec.resolved(device_count=8)
        plan = resolved.plan(devices)
        assert type(plan.settings) is ParallelSettings and plan.settings == resolved.parallel.settings(), name
        assert getattr(plan.settings, name) == value, name
        c = candidate_of(resolved)
        held, expected = CANDIDATE_HOLDS.get(name, (name, value))
        assert getattr(c.parallel, held) == expected, (name, c)
        assert c.plan(devices).settings == dataclasses.replace(
            plan.settings, dp=c.dp, fsdp=1, zero=plan.settings.zero
        ), name
        settings, flags = c.settings(), c.train_flags()
        if name in NOT_CHOSEN:  # the run's own (the per-block compute): --plan auto keeps it as given
            assert name not in settings and flag_name(name) not in flags
            continue
        assert settings[held] == expected and flags[flags.index(flag_name(held)) + 1] == str(expected), (name, flags)
        again = RunSpec.of(**{**needs, **settings}).resolved(device_count=8)
        assert getattr(again.parallel, held) == expected and candidate_of(again) == c, name


def _flags(settings: dict) -> list[str]:
    return [f"{flag_name(k)}={v}" for k, v in settings.items()]


def test_a_plan_takes_the_settings_as_one_value_or_by_name_and_refuses_a_degree_the_mesh_lacks():
    mesh = jaxring.make_mesh(dp=2, sp=4)
    by_value = jaxring.ParallelPlan(mesh, ParallelSettings(attention="wallfacer", options={"team_size": 2}))
    by_name = jaxring.ParallelPlan(mesh, attention="wallfacer", team_size=2)
    assert by_value.settings == by_name.settings and by_name.options["team_size"] == 2
    assert by_name.settings.sp == 4 and by_name.attention == "wallfacer" and by_name.zero_stage == 0
    assert jaxring.ParallelPlan(mesh).attention == "ring"  # sp > 1: the run's default strategy
    with pytest.raises(ValueError, match=r"^sp=8 in the parallel settings, but the mesh's sp is 4$"):
        jaxring.ParallelPlan(mesh, ParallelSettings(sp=8))
    with pytest.raises(TypeError, match="as one value or by name, not both"):
        jaxring.ParallelPlan(mesh, ParallelSettings(), attention="ring")
