"""Eight simulated CPU devices, set before JAX starts its backend.

No persistent compilation cache: an XLA:CPU executable loaded from it deadlocked in its collective-permutes
(tests/integration/test_train.py's resume test: device 0 waiting at another permute than the rest, aborted by XLA's
40 s rendezvous timeout, 3 runs of 3; with the cache off it passes).
"""

import os
import sys
from pathlib import Path

# XLA's CPU backend optimisation level 0 (LLVM's, after XLA's own HLO passes, which are unchanged): compiling is
# most of a test's time: tests/integration/test_train.py's parity cases took 27% less CPU time with it. The HLO, buffer sizes and bytes moved that tests check
# are the same, and the results are IEEE float either way (no fast-math). XLA_FLAGS with its own level keeps it.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
# XLA:CPU aborts a collective whose devices have not all arrived within 40 s; the TPU kernels' tests run them in
# Pallas' TPU interpret mode (Python callbacks per grid step, a barrier over the devices per kernel call), where
# a device starved of the 2 CI cores can lag that long: give it 300 s (a real deadlock still ends)
if "xla_cpu_collective_call_terminate_timeout_seconds" not in _flags:
    _flags += " --xla_cpu_collective_call_terminate_timeout_seconds=300"
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The tests live in tiers (unit/<package>, integration, compiled, device) and import shared pieces from one
# another by module name (`from test_reliability import CLI`): every folder of tests is on sys.path, so a
# module is found (once, under its own name) whichever tier collects first. Module names are unique.
TESTS = Path(__file__).resolve().parent
for _folder in sorted({p.parent for p in TESTS.rglob("test_*.py")}, reverse=True):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")

from jaxring.core.device_setup import use_simulated_devices

use_simulated_devices()  # (jaxring.core.device_setup: explicit, not an import side effect)


import pytest


@pytest.fixture(autouse=True, scope="session")
def _runs_in_a_temporary_directory(tmp_path_factory):
    """Runs that name no output directory write under runs/ of the working directory; in the tests, under a
    temporary one instead of the repository."""
    from jaxring.train import loop

    loop.RUNS_DIR = str(tmp_path_factory.mktemp("runs"))


TIERS = {
    "unit": "one package's behaviour against its oracle (tests/unit/<package>/)",
    "integration": "commands and whole runs: train.py, README and docs commands, notebooks, faults",
    "compiled": "deviceless GPU and TPU compiles: need the gpu-compile or tpu-compile extra, skip without it",
    "device": "a real GPU or TPU: skip without one",
}


def pytest_collection_modifyitems(config, items):
    """Each test carries its tier's marker, from its folder: `-m unit` is the fast lane, `-m compiled` the
    compile lane."""
    for item in items:
        tier = item.path.resolve().relative_to(TESTS).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test outside the tiers' folders ({', '.join(TIERS)})")
        item.add_marker(tier)
