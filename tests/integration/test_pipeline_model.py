"""Pipeline parallelism in the GPT train step, through train.py: every schedule gives the 1-device losses, on
pp alone and composed with dp, sp (ring attention inside the stages), tp and ZeRO; refused settings get one
line and exit 2. (Schedules, the simulator and the interpreter on their own: test_pipeline.py.)"""

import json

import jax
import numpy as np
import pytest

import train as cli

SMALL = ["--override", "num_layers=4", "--override", "hidden=64", "--override", "num_heads=8", "--override", "ffn=128"]
COMMON = SMALL + [
    "--steps",
    "3",
    "--batch-size",
    "8",
    "--seq-len",
    "64",
    "--lr",
    "3e-3",
    "--warmup",
    "1",
    "--sample-tokens",
    "0",
    "--no-progress",
]


@pytest.fixture(scope="module")
def one_device():
    from jaxring.run.spec import RunSpec
    from jaxring.train.loop import train

    cfg = RunSpec.of(
        model="gpt",
        preset="tiny",
        overrides={"num_layers": 4, "hidden": 64, "num_heads": 8, "ffn": 128},
        steps=3,
        batch_size=8,
        seq_len=64,
        lr=3e-3,
        warmup=1,
        sample_tokens=0,
        progress=False,
    )
    return [r["loss"] for r in train(cfg, devices=jax.devices()[:1], log=lambda *a: None)]


def _losses(tmp_path, flags):
    metrics = tmp_path / "m.jsonl"
    assert cli.main(COMMON + flags + ["--metrics-file", str(metrics)]) == 0
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


RUNS = {
    "pp2-gpipe": ["--pp", "2", "--dp", "4", "--microbatches", "2", "--pipeline-schedule", "gpipe"],
    "pp2-1f1b": ["--pp", "2", "--dp", "4", "--microbatches", "2", "--pipeline-schedule", "1f1b"],
    "pp2-interleaved": [
        "--pp",
        "2",
        "--dp",
        "4",
        "--microbatches",
        "2",
        "--pipeline-schedule",
        "interleaved",
        "--virtual-stages",
        "2",
    ],
    "pp2-zero-bubble": ["--pp", "2", "--dp", "4", "--microbatches", "2", "--pipeline-schedule", "zero-bubble"],
    "pp4-1f1b": ["--pp", "4", "--dp", "2", "--microbatches", "4", "--pipeline-schedule", "1f1b"],
    "pp4-zero-bubble": ["--pp", "4", "--dp", "2", "--microbatches", "4", "--pipeline-schedule", "zero-bubble"],
    "pp2-ring-sp4": ["--pp", "2", "--sp", "4", "--microbatches", "2"],
    "pp2-tp4": ["--pp", "2", "--tp", "4", "--microbatches", "2"],
    "pp2-dp2-tp2-zero3": ["--pp", "2", "--dp", "2", "--tp", "2", "--microbatches", "2", "--zero", "3"],
}


# `slow` (not in CI's default run): pp4, which repeats the pp2 schedules' paths at 4 stages, and pp2-gpipe, whose
# path through the train step is 1F1B's with another order of the same actions (test_pipeline.py checks every
# schedule's gradients against the sequential stack by default), and pp2-ring-sp4 (the pipeline with a ring inside
# its stages: tests/integration/test_documents_model.py's pp2 x dp2 x sp2 row runs that train step by default)
SLOW_RUNS = ("pp4-1f1b", "pp4-zero-bubble", "pp2-gpipe", "pp2-ring-sp4")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_RUNS else n for n in RUNS])
def test_pipelined_training_matches_one_device(name, tmp_path, one_device):
    np.testing.assert_allclose(_losses(tmp_path, RUNS[name]), one_device, rtol=1e-3)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--pp", "4", "--dp", "2", "--microbatches", "2"], "--microbatches 2 is less than --pp 4"),
        (
            ["--pp", "2", "--dp", "4", "--microbatches", "2", "--virtual-stages", "2"],
            "virtual_stages=2 is an option of interleaved, not of the chosen",
        ),
        (["--pp", "8", "--microbatches", "8"], "num_layers 4 is not divisible by pp 8"),
        (["--pp", "2", "--dp", "4", "--microbatches", "2", "--zero", "2"], "zero stage 2 does not combine with pp > 1"),
        (["--pp", "2", "--dp", "4", "--grad-accum", "2"], "the pipeline's micro-batches are the gradient accumulation"),
        (
            ["--pp", "2", "--dp", "4", "--microbatches", "4"],
            "--batch-size 8 does not split into 16 equal parts (--dp 4 × --microbatches 4); use --batch-size 16, "
            "or --microbatches 2",
        ),
        (["--dp", "8", "--microbatches", "2"], "--microbatches 2 sets the pipeline's micro-batches, but --pp is 1"),
    ],
)
def test_refused_pipelines_get_one_line(flags, message, capsys):
    assert cli.main(COMMON + flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_unknown_schedule_is_a_cli_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(COMMON + ["--pp", "2", "--dp", "4", "--pipeline-schedule", "pipedream"])
    assert e.value.code == 2 and "invalid choice: 'pipedream'" in capsys.readouterr().err
