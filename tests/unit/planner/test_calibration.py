"""The cost model's fitted terms are data (jaxring/planner/calibrations/<target>.json): every term documented,
none left in cost_model.py, and the refit script reproduces them from the recorded compiles."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
from helpers import ROOT

from jaxring.planner import calibration


@pytest.mark.parametrize("target", calibration.TARGETS)
def test_every_term_has_a_value_unit_meaning_and_provenance(target):
    data = json.loads((ROOT / "jaxring" / "planner" / "calibrations" / f"{target}.json").read_text())
    assert data["target"] == target and data["xla_versions"]
    assert set(data["terms"]) == set(calibration.TERMS)
    for name, entry in data["terms"].items():
        assert set(entry) == {"value", "unit", "meaning", "fitted_on"}, name
        assert all(entry[k] for k in ("unit", "meaning", "fitted_on")), name
    k = calibration.calibration(target)
    assert k.target == target and k.source.endswith(f"calibrations/{target}.json")


def test_a_version_entry_overrides_its_terms():
    text = (ROOT / "jaxring" / "planner" / "calibrations" / "gpu.json").read_text()
    data = json.loads(text)
    data["by_xla_version"] = {"0.13": {"tiled_block_saving": 2.0}}
    newer = calibration.load(json.dumps(data), "test", "gpu", "0.13.1")
    assert newer.tiled_block_saving == 2.0
    assert calibration.load(json.dumps(data), "test", "gpu", "0.130.0").tiled_block_saving == 1.7
    assert calibration.load(text, "test", "gpu", "0.13.1").tiled_block_saving == 1.7


def test_cost_model_holds_no_fitted_constant_nor_fitting_history():
    source = (ROOT / "jaxring" / "planner" / "cost_model.py").read_text()
    assert "benchmarks/results" not in source and not re.search(r"\w\.json", source)  # no recorded file cited
    assert not re.search(r"_GONE|OFFLOADED_|RECOMPUTED_|UNTILED_MLP|LAYER_WORKING_SHARE|KERNEL_OVERHEAD", source)
    # module-level numeric constants: only structural counts and XLA:CPU's wire format remain
    constants = re.findall(r"^([A-Z_]+) = [0-9.]+", source, flags=re.M)
    assert set(constants) <= {"CPU_COLLECTIVE_BYTES", "STREAM_ARRAYS"}, constants


def test_the_refit_script_keeps_the_gpu_term_its_records_support(tmp_path):
    spec = importlib.util.spec_from_file_location("refit_calibration", ROOT / "benchmarks" / "refit_calibration.py")
    refit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(refit)
    found = refit.refit("gpu", refit.gpu_rows(), tmp_path)
    now, (within, _), best, (best_within, largest) = found["tiled_mlp_saving"]
    assert best == now == calibration.calibration("gpu").tiled_mlp_saving
    assert within == best_within == 10 and largest < 0.10
