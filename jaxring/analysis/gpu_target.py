"""The GPU targets of a deviceless compile (H100, H200): XLA's GpuTargetConfigProto (`gpu_targets/*.txtpb`,
from openxla/xla, shipped as package data), whether the compile-only CUDA plugin can compile here
(`available`), and abstract GPUs and meshes over them."""

from __future__ import annotations

import contextlib
import functools
import importlib.resources
from typing import TYPE_CHECKING, Any

import jax

from jaxring.analysis.deviceless import use_deviceless
from jaxring.core import compat

if TYPE_CHECKING:
    from jax.sharding import Mesh

TARGETS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb"}
DEFAULT_TARGET = "h200"
SM_ARCH = "sm_90a"


def target_config(target: str = DEFAULT_TARGET) -> str:
    """The GpuTargetConfigProto text of a target ("h100" or "h200")."""
    if target not in TARGETS:
        raise ValueError(f"unknown GPU target {target!r}; expected one of {', '.join(TARGETS)}")
    return (importlib.resources.files("jaxring.analysis") / "gpu_targets" / TARGETS[target]).read_text()


def _cuda_plugin_installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ImportError:
        return False


def available() -> tuple[bool, str]:
    """(True, "") when GPU targets can be compiled here, else (False, the reason)."""
    if not _cuda_plugin_installed():
        return False, (
            "the compile-only CUDA plugin (jax-cuda12-plugin) is not installed: "
            "install the gpu-compile extra in a venv of its own (VENV=.venv-gpu bash tools/setup.sh gpu-compile)"
        )
    platforms = jax.config.jax_platforms
    if platforms not in ("cpu", None, ""):
        return False, f"jax_platforms is {platforms!r}; deviceless GPU compilation needs 'cpu' (JAX_PLATFORMS=cpu)"
    if not platforms and compat.backends_started():
        return False, (
            "JAX started its backends without jax_platforms='cpu'; set JAX_PLATFORMS=cpu before "
            "JAX starts (the CUDA plugin's device check fails without a GPU)"
        )
    try:
        _topology(DEFAULT_TARGET, 1)
    except Exception as e:
        return False, f"the cuda topology is not available: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return True, ""


@functools.cache
def _topology(target: str, num_devices: int):
    from jax.experimental import topologies

    use_deviceless()
    return topologies.get_topology_desc(
        platform="cuda", target_config=target_config(target), topology=f"1x1x{num_devices}"
    )


def gpu_devices(target: str = DEFAULT_TARGET, num_devices: int = 8) -> list:
    """`num_devices` abstract GPUs of one host (no GPU needed): pass them to `jaxring.make_mesh(devices=...)`."""
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices={num_devices!r} must be a positive integer")
    return list(_topology(target, num_devices).devices)


def lowering_for(device: Any) -> contextlib.AbstractContextManager:
    """The context in which `jax.jit(f).lower(...)` lowers for `device`'s GPU (an abstract GPU of a topology).

    Pallas' Triton lowering reads the GPU it compiles for from the context's abstract mesh, else from JAX's
    default device (jax 0.11.2, 0.12.x), which in a deviceless compile is the host's CPU ("No supported GPU
    devices found"). An empty abstract mesh naming the device's kind is all it needs; nothing else reads it. A
    device that is not a GPU gets a context that changes nothing."""
    if getattr(device, "platform", None) != "gpu":
        return contextlib.nullcontext()
    kind = jax.sharding.AbstractDevice(device.device_kind, getattr(device, "core_count", None), "gpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=kind))


def gpu_mesh(axes: dict[str, int], target: str = DEFAULT_TARGET) -> Mesh:
    """A `jax.sharding.Mesh` (Auto axes) of abstract GPUs, e.g. gpu_mesh({"sp": 8})."""
    import math

    import numpy as np
    from jax.sharding import Mesh

    devices = gpu_devices(target, math.prod(axes.values()))
    return Mesh(np.array(devices).reshape(tuple(axes.values())), tuple(axes))
