"""The mixture-of-experts GPT through train.py: dropless expert parallelism gives the 1-device losses on every
mesh, the MoE metrics reach the metrics file, and bad MoE settings get one line and exit 2. (The block itself,
its bytes and its load balancing are tested in test_moe.py.)"""

import json

import jax
import numpy as np
import pytest

import train as cli
from jaxring.models import gpt

COMMON = [
    "--preset",
    "tiny-moe",
    "--steps",
    "3",
    "--batch-size",
    "8",
    "--seq-len",
    "32",
    "--lr",
    "3e-3",
    "--warmup",
    "1",
    "--sample-tokens",
    "0",
    "--no-progress",
]


def _losses(tmp_path, flags, name):
    metrics = tmp_path / f"{name}.jsonl"
    assert cli.main(COMMON + flags + ["--metrics-file", str(metrics)]) == 0
    return [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.fixture(scope="module")
def one_device():
    """The 1-device run, in process (the command line uses every device)."""
    from jaxring.run.spec import RunSpec
    from jaxring.train.loop import train

    cfg = RunSpec.of(
        model="gpt",
        preset="tiny-moe",
        steps=3,
        batch_size=8,
        seq_len=32,
        lr=3e-3,
        warmup=1,
        sample_tokens=0,
        progress=False,
    )
    return [dict(r) for r in train(cfg, devices=jax.devices()[:1], log=lambda *a: None)]


# sp4-ep2 and tp2-ep4 (38 s and 45 s in CI) with -m slow: test_moe.py checks the MoE block on those meshes against
# one device and the reference by default
@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(["--ep", "8"], id="ep8"),
        pytest.param(["--dp", "2", "--ep", "4"], id="dp2-ep4"),
        pytest.param(["--sp", "4", "--ep", "2"], id="sp4-ep2", marks=pytest.mark.slow),
        pytest.param(["--tp", "2", "--ep", "4"], id="tp2-ep4", marks=pytest.mark.slow),
    ],
)
def test_expert_parallel_meshes_match_one_device(flags, tmp_path, one_device):
    rows = _losses(tmp_path, flags, "run")
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in one_device], rtol=1e-3)
    np.testing.assert_allclose([r["moe_aux_loss"] for r in rows], [r["moe_aux_loss"] for r in one_device], rtol=1e-3)
    for r in rows:  # dropless: nothing dropped; the router's balance is reported
        assert r["drop_rate"] == 0 and r["load_imbalance"] >= 1.0 and r["moe_loss"] > 0


def test_capacity_path_drops_and_reports_it(tmp_path):
    rows = _losses(tmp_path, ["--ep", "8", "--override", "capacity_factor=0.5"], "capacity")
    assert all(0 < r["drop_rate"] < 1 for r in rows)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--ep", "8", "--override", "num_experts=12"], "num_experts=12 is not divisible by ep=8"),
        (["--override", "experts_per_token=9"], "experts_per_token=9 must be <= num_experts=8"),
        (["--override", "capacity_factor=0"], "capacity_factor"),
        (
            ["--tp", "4", "--dp", "2", "--tensor-parallel", "optimus"],
            "mixture-of-experts layers cannot run with tensor parallelism 'optimus'",
        ),
    ],
)
def test_bad_moe_settings_get_one_line(flags, message, capsys):
    assert cli.main(COMMON + flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_ep_without_experts_is_refused(capsys):
    assert cli.main(["--preset", "tiny", "--ep", "8", "--steps", "1", "--sample-tokens", "0"]) == 2
    assert "ep = 8 splits experts, but the model has none" in capsys.readouterr().err


def test_presets():
    mixtral = gpt.PRESETS["mixtral"]
    assert round(mixtral.num_params() / 1e9, 1) == 46.7 and round(mixtral.num_params(active=True) / 1e9, 1) == 12.9
    tiny = gpt.PRESETS["tiny-moe"]
    assert tiny.moe.num_experts == 8 and tiny.moe.experts_per_token == 2 and tiny.moe.dropless
