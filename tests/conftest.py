"""Eight simulated CPU devices, set before JAX starts its backend."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")

from jaxring.platform import use_simulated_devices

use_simulated_devices()  # (jaxring.platform: explicit, not an import side effect)


import pytest


@pytest.fixture(autouse=True, scope="session")
def _runs_in_a_temporary_directory(tmp_path_factory):
    """Runs that name no output directory write under runs/ of the working directory; in the tests, under a
    temporary one instead of the repository."""
    from jaxring.train import loop

    loop.RUNS_DIR = str(tmp_path_factory.mktemp("runs"))
