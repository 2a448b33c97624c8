"""Memory decided by the compiler: on accelerators and for --compile-for, a manual plan is refused for memory
only by its compiled program (`jaxring.planner.fit.decide`, `jaxring.aot.fits`, `jaxring.aot.compile_for`); the
estimate refuses before compiling only beyond `FAR_BEYOND` times the budget. A deliberately pessimistic
calibration (JAXRING_CALIBRATION: the activation terms 3x) makes the estimate say a plan does not fit where its
compiled program does. Simulated CPU devices keep the estimate's check. The TPU case needs libtpu."""

from __future__ import annotations

import json

import jax
import pytest

from jaxring.aot import compile_for, fits
from jaxring.aot.memory_check import compiled_bytes_on
from jaxring.planner import calibration, fit
from jaxring.planner.fit import FAR_BEYOND, GIB, DoesNotFit, check_fits, decide
from jaxring.run.spec import RunSpec

# the terms that scale a layer's activations and working set, made 3x: an estimate well above the compiled bytes
PESSIMISTIC = ("layer_working_share", "recomputed_stream_arrays", "untiled_mlp_backward_arrays")
# remat full: one layer's working set (3x here) is most of the step's memory; 0.03 GiB compiled, 0.1 estimated
SPEC = RunSpec.of(preset="tiny", seq_len=8192, batch_size=1, sp=8, attention="ring", remat="full")


@pytest.fixture
def pessimistic(tmp_path, monkeypatch):
    """JAXRING_CALIBRATION pointing at a folder of the packaged calibrations with PESSIMISTIC 3x."""
    for target in calibration.TARGETS:
        data = json.loads(
            (calibration.resources.files("jaxring.planner") / "calibrations" / f"{target}.json").read_text()
        )
        for name in PESSIMISTIC:
            entry = data["terms"][name]
            v = entry["value"]
            entry["value"] = {k: 3 * x for k, x in v.items()} if isinstance(v, dict) else 3 * v
        (tmp_path / f"{target}.json").write_text(json.dumps(data))
    monkeypatch.setenv(calibration.ENV, str(tmp_path))
    return tmp_path


def test_decide_refuses_before_compiling_only_far_beyond_the_budget_on_accelerators():
    assert decide(9.0, 10.0, compiler_decides=True) == decide(9.0, 10.0, compiler_decides=False) == "fits"
    assert decide(9.0, None, compiler_decides=False) == "fits"  # no budget to check
    assert decide(11.0, 10.0, compiler_decides=False) == "refuse"  # simulated CPU devices: the estimate's check
    assert decide(11.0, 10.0, compiler_decides=True) == "compile"
    assert decide(FAR_BEYOND * 10.0, 10.0, compiler_decides=True) == "compile"
    assert decide(FAR_BEYOND * 10.0 + 1, 10.0, compiler_decides=True) == "refuse"
    assert fit.RECORDED_ERROR[1] < FAR_BEYOND  # the factor is beyond the estimate's recorded overstatement


def test_a_pessimistic_calibration_file_is_read_and_a_bad_one_is_one_line(pessimistic, tmp_path, monkeypatch):
    k = calibration.calibration("gpu")
    assert k.source.startswith(str(pessimistic)) and k.layer_working_share["full"] == 3 * 0.75
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"terms": {"layer_working_share": {"value": {}}, "mystery": {"value": 1}}}))
    monkeypatch.setenv(calibration.ENV, str(bad))
    with pytest.raises(ValueError, match=r"calibration .*bad.json: missing terms .* unknown terms \['mystery'\]"):
        calibration.calibration("cpu")
    monkeypatch.setenv(calibration.ENV, str(tmp_path / "none.json"))
    with pytest.raises(ValueError, match="no calibration file"):
        calibration.calibration("cpu")


def _budget_between(compiled: float, estimate: float) -> float:
    """A budget (GiB) that the compiled bytes fit and the estimate exceeds, by less than FAR_BEYOND times."""
    budget = max(compiled * 1.01, estimate / 1.5)
    assert compiled <= budget < estimate <= FAR_BEYOND * budget, (compiled / GIB, estimate / GIB)
    return budget / GIB


@pytest.mark.heavy
def test_on_accelerators_a_manual_plan_whose_compiled_step_fits_runs_though_the_estimate_says_not(
    pessimistic, monkeypatch
):
    """The platform stubbed (no GPU here): the run's step compiled for real on the simulated devices, the
    estimate (pessimistic) above the budget, the compiled bytes within it: accepted. On the same devices as CPUs,
    the estimate's check refuses it, as before."""
    devices = jax.devices()[:8]
    compiled = compiled_bytes_on(SPEC, devices)
    monkeypatch.setattr(fit, "on_cpu", lambda devices: False)
    monkeypatch.setattr(fits, "on_cpu", lambda devices: False)
    estimate = fit.estimate(SPEC.resolved(8), devices).total  # priced for the accelerator
    spec = SPEC.updated(device_memory_gib=_budget_between(compiled, estimate))
    resolved = spec.resolved(8)
    assert check_fits(resolved, devices).total == estimate  # left to the compiler, not refused
    lines = []
    assert fits.check_compiled_fits(spec, devices, log=lines.append) == compiled
    assert len(lines) == 1 and lines[0].startswith("fits by the compiled step: compiled"), lines

    over = spec.memory.device_memory_gib * GIB * 1.01  # a compiled step above the budget: refused
    with pytest.raises(DoesNotFit) as caught:
        fits.check_compiled_fits(spec, devices, log=lines.append, compiled=lambda s, d: (over, 0.0))
    assert len(str(caught.value).splitlines()) == 1 and "compiled" in str(caught.value)

    far = spec.updated(device_memory_gib=estimate / (FAR_BEYOND * 1.1) / GIB)  # far beyond: the estimate refuses
    with pytest.raises(DoesNotFit, match=f"more than {FAR_BEYOND:g}x"):
        check_fits(far.resolved(8), devices)
    assert fits.check_compiled_fits(far, devices, compiled=lambda s, d: pytest.fail("compiled")) is None

    monkeypatch.undo()  # the same devices as simulated CPUs: the estimate's check refuses, as before
    monkeypatch.setenv(calibration.ENV, str(pessimistic))
    with pytest.raises(DoesNotFit, match=r"the run does not fit: estimated .* above the .* GiB device memory"):
        check_fits(resolved, devices)
    assert fits.check_compiled_fits(spec, devices, compiled=lambda s, d: pytest.fail("compiled")) is None


@pytest.mark.heavy
def test_compile_for_accepts_a_manual_plan_whose_compiled_program_fits(pessimistic, monkeypatch):
    """--compile-for's decision without a plugin: the target's compile stubbed by the compile on the simulated
    devices. The pessimistic estimate is above the budget; the compiled bytes fit: exit 0, "fits". Far beyond the
    budget, refused before compiling, in one line."""
    devices = jax.devices()[:8]
    compiled = compiled_bytes_on(SPEC, devices)
    monkeypatch.setattr(compile_for, "require_plugin", lambda target: None)
    monkeypatch.setattr(compile_for, "target_devices", lambda target: devices)
    calls = []

    def compile_stub(spec, devices, log):
        calls.append(spec)
        return compiled, compile_for.estimated_memory(spec, len(devices)).total, 0.0, "sp8 ring"

    monkeypatch.setattr(compile_for, "_compile", compile_stub)
    estimate = compile_for.estimated_memory(SPEC, 8).total
    spec = SPEC.updated(device_memory_gib=_budget_between(compiled, estimate))
    lines = []
    assert compile_for.compile_for(spec, "h100x8", log=lines.append) == 0
    assert lines[-1].startswith("fits: compiled") and len(calls) == 1, lines

    far = SPEC.updated(device_memory_gib=estimate / (FAR_BEYOND * 1.1) / GIB)
    with pytest.raises(DoesNotFit, match="not compiled") as caught:
        compile_for.compile_for(far, "h100x8", log=lines.append)
    assert len(str(caught.value).splitlines()) == 1 and len(calls) == 1


def test_on_accelerators_the_host_memory_offload_keeps_is_decided_by_the_compiled_program(monkeypatch):
    """--offload optimizer on (stubbed) accelerators: the AdamW state's host bytes estimated above this host's
    budget, within FAR_BEYOND times it, are not refused before compiling; the compiled program's host bytes
    decide (the compile stubbed: device bytes well within, host bytes as given). Far beyond, the estimate refuses,
    as it does on simulated CPU devices, whose devices live in that memory."""
    devices = jax.devices()[:8]
    monkeypatch.setattr(fit, "on_cpu", lambda devices: False)
    monkeypatch.setattr(fits, "on_cpu", lambda devices: False)
    spec = RunSpec.of(preset="tiny", seq_len=512, batch_size=1, sp=8, attention="ring", offload="optimizer")
    spec = spec.updated(device_memory_gib=1.0)
    memory = fit.estimate(spec.resolved(8), devices)
    need = memory.host * 8  # this host's 8 devices together
    assert memory.host > 0 and memory.total < GIB
    between = spec.updated(host_memory_gib=need / 1.5 / GIB)  # the estimate above it, within FAR_BEYOND
    assert fit.host_decision(between.resolved(8), devices, memory) == "compile"
    assert check_fits(between.resolved(8), devices) is not None  # not refused before compiling
    lines = []
    within = need / 1.5 / 8 * 0.9  # compiled host bytes per device that fit
    device_bytes = 0.01 * GIB
    assert fits.check_compiled_fits(between, devices, lines.append, lambda s, d: (device_bytes, within)) == device_bytes
    assert "host memory: compiled" in lines[-1] and "the host estimate is above" in lines[-1], lines
    with pytest.raises(DoesNotFit, match=r"^the run does not fit in host memory: compiled .* x 8 devices") as caught:
        fits.check_compiled_fits(between, devices, lines.append, lambda s, d: (device_bytes, within * 1.2))
    assert len(str(caught.value).splitlines()) == 1

    far = spec.updated(host_memory_gib=need / (FAR_BEYOND * 1.1) / GIB)
    with pytest.raises(DoesNotFit, match=f"in host memory: .* more than {FAR_BEYOND:g}x the"):
        check_fits(far.resolved(8), devices)
    assert fits.check_compiled_fits(far, devices, compiled=lambda s, d: pytest.fail("compiled")) is None
    monkeypatch.undo()  # simulated CPU devices: their whole memory is the host's, checked by the estimate
    assert fit.host_decision(between.resolved(8), devices, fit.estimate(between.resolved(8), devices)) == "refuse"
