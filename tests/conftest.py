"""Eight simulated CPU devices, set before JAX starts its backend; one compilation cache for the whole run."""

import os
import shutil
import tempfile

# XLA's CPU backend optimisation level 0 (LLVM's, after XLA's own HLO passes, which are unchanged): compiling is
# most of a test's time: with the compilation cache below, tests/test_train.py's parity cases took 27% less CPU time
# and tests/test_rsa.py 53% less (93.5 s -> 43.9 s, -n 0). The HLO, buffer sizes and bytes moved that tests check
# are the same, and the results are IEEE float either way (no fast-math). XLA_FLAGS with its own level keeps it.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")

# JAX's persistent compilation cache, in a directory made for this run (pytest-xdist's workers inherit it from the
# controller, which removes it at the end): a program compiled again (a fixture per module, the same train step
# built by another test or another Trainer, a rebuilt closure) is loaded instead of compiled by XLA again. Set
# JAXRING_TEST_COMPILE_CACHE=DIR to keep the cache between runs.
_OWN_CACHE = "JAXRING_TEST_COMPILE_CACHE" not in os.environ
if _OWN_CACHE:
    os.environ["JAXRING_TEST_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="jaxring-test-compile-cache-")
    os.environ["JAXRING_TEST_COMPILE_CACHE_OWNER"] = str(os.getpid())
jax.config.update("jax_compilation_cache_dir", os.environ["JAXRING_TEST_COMPILE_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

from jaxring.platform import use_simulated_devices

use_simulated_devices()  # (jaxring.platform: explicit, not an import side effect)


import pytest


def pytest_unconfigure(config):
    """The controller (the process that made the run's cache directory) removes it."""
    if os.environ.get("JAXRING_TEST_COMPILE_CACHE_OWNER") == str(os.getpid()):
        shutil.rmtree(os.environ["JAXRING_TEST_COMPILE_CACHE"], ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def _runs_in_a_temporary_directory(tmp_path_factory):
    """Runs that name no output directory write under runs/ of the working directory; in the tests, under a
    temporary one instead of the repository."""
    from jaxring.train import loop

    loop.RUNS_DIR = str(tmp_path_factory.mktemp("runs"))
