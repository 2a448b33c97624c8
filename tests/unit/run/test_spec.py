"""The run specification: flags, YAML and make_plan generated from one declaration of every setting."""

import dataclasses
import re

import jax
import pytest

import jaxring
import train as cli
from jaxring.run.cli import build_parser, parse_command_line
from jaxring.run.schema import SECTIONS, setting_fields
from jaxring.run.spec import RunSpec

TINY = ["--override", "num_layers=1", "--override", "hidden=32", "--override", "num_heads=4", "--override", "ffn=64"]
SHORT = ["--steps", "2", "--seq-len", "64", "--batch-size", "8", "--sample-tokens", "0", "--no-progress"]


def _print_config(argv, capsys) -> str:
    assert cli.main(["--print-config", *argv]) == 0
    return capsys.readouterr().out


def test_every_setting_is_a_flag_with_its_default_in_help():
    text = build_parser().format_help()
    for section, cls in SECTIONS.items():
        for name, f in setting_fields(cls).items():
            if name == "options":
                continue
            flag = "--" + (f.metadata.get("flag") or name).replace("_", "-")
            assert flag in text, (section, flag)
    assert "(default: 150)" in text and "(default: 0.003)" in text  # steps, lr
    for option in ("--team-size", "--ulysses-size", "--placement", "--virtual-stages"):  # registry options
        assert option in text


def test_print_config_round_trips(tmp_path, capsys):
    first = _print_config(["--sp", "8", "--attention", "wallfacer", "--team-size", "2", "--lr", "1e-3"], capsys)
    path = tmp_path / "run.yaml"
    path.write_text(first)
    assert _print_config(["--config", str(path)], capsys) == first
    spec = RunSpec.from_yaml(first)
    assert spec.parallel.attention == "wallfacer" and spec.parallel.options["team_size"] == 2
    assert spec.parallel.layout == "zigzag" and spec.parallel.options["placement"] == "team_inner"  # resolved
    assert spec.optimizer.lr == 1e-3 and spec.parallel.sp == 8 and spec.parallel.dp == 1


def test_flags_override_the_config_file(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("training:\n  steps: 7\n  batch_size: 16\nparallel:\n  sp: 4\n  dp: 2\n")
    out = RunSpec.from_yaml(_print_config(["--config", str(path), "--steps", "3"], capsys))
    assert (out.training.steps, out.training.batch_size, out.parallel.sp, out.parallel.dp) == (3, 16, 4, 2)


@pytest.mark.parametrize(
    "text,message",
    [
        ("training:\n  stepz: 3\n", "unknown key 'stepz' in section 'training' (did you mean 'steps'?)"),
        ("training:\n  lr: 0.1\n", "unknown key 'lr' in section 'training' (it belongs in section 'optimizer')"),
        ("trainig:\n  steps: 3\n", "unknown section 'trainig' (did you mean 'training'?)"),
        ("training: [1, 2]\n", "section 'training' must be a mapping"),
        ("training:\n  steps: [\n", "not valid YAML"),
    ],
)
def test_bad_config_files_are_one_line(text, message, tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as e:
        parse_command_line(["--config", str(path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize(
    "text,message",
    [
        ("training:\n  steps: three\n", "--steps 'three' must be a positive integer"),
        ("optimizer:\n  lr: .nan\n", "--lr nan must be a finite number > 0"),
        ("parallel:\n  attention: rings\n", "--attention 'rings' is not one of"),
        ("parallel:\n  team_size: 2\n", "team_size=2 is an option of wallfacer, not of the chosen attention 'ring'"),
    ],
)
def test_bad_values_in_a_config_are_one_line(text, message, tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert cli.main(["--config", str(path), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_make_plan_is_the_plan_train_py_builds(capsys):
    settings = dict(dp=2, sp=4, attention="usp", ulysses_size=2, zero=1)
    plan = jaxring.make_plan(**settings)
    spec = RunSpec.from_yaml(
        _print_config(["--dp", "2", "--sp", "4", "--attention", "usp", "--ulysses-size", "2", "--zero", "1"], capsys)
    )
    assert spec.plan(jax.devices()).describe() == plan.describe()
    assert plan.describe() == "dp=2 × sp=4, attention=usp (ulysses_size=2), zero=1"
    with pytest.raises(ValueError, match=re.escape("make_plan: unknown parallel setting 'ulysess_size'")):
        jaxring.make_plan(sp=8, attention="usp", ulysess_size=2)


@pytest.mark.heavy
def test_every_run_writes_its_resolved_spec_and_repeats_from_it(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main([*TINY, *SHORT, "--sp", "8", "--out-dir", str(out)]) == 0
    saved = RunSpec.load(str(out / "run.yaml"))
    assert saved.output.out_dir == str(out) and saved.parallel.sp == 8 and saved.parallel.attention == "ring"
    first = [line for line in (out / "metrics.jsonl").read_text().splitlines()]
    again = tmp_path / "again"
    assert cli.main(["--config", str(out / "run.yaml"), "--out-dir", str(again)]) == 0
    assert (again / "metrics.jsonl").read_text().count("\n") == len(first) == 2
    capsys.readouterr()


def test_spec_of_takes_flat_names_and_refuses_unknown_ones():
    spec = RunSpec.of(sp=8, steps=5, lr=1e-3, team_size=2, attention="wallfacer")
    assert spec.parallel.sp == 8 and spec.training.steps == 5 and spec.parallel.options == {"team_size": 2}
    assert spec.flat()["lr"] == 1e-3
    with pytest.raises(ValueError, match=re.escape("unknown setting 'stepz' (did you mean 'steps'?)")):
        RunSpec.of(stepz=3)
    assert dataclasses.replace(spec.training, steps=9).steps == 9


def test_tp_without_a_method_resolves_megatrons_options():
    """tp > 1 with no --tensor-parallel is Megatron: the resolved options are its (none) and the strategy's, not
    the "none" method's vocab_split (which Megatron's plan would refuse)."""
    spec = RunSpec.of(tp=2, sp=4).resolved(8)
    assert "vocab_split" not in spec.parallel.options, spec.parallel.options
    assert spec.plan(jax.devices()).tensor_parallel == "megatron"
