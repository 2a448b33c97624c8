"""Benchmark result files: a header naming what ran, where and with which versions, then the measured rows.

record = benchmark_record("ring_attention", devices, {"seq_len": 4096})
record["results"].append({...}); save_record(record, "benchmarks/results/ring_attention.json")
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Sequence

import jax
import numpy as np

from jaxring.core.device_setup import describe_devices


def benchmark_record(name: str, devices: Sequence[jax.Device], config: dict) -> dict:
    """The header every benchmark result file carries: what ran, where, with which versions."""
    return {
        "benchmark": name,
        "command": " ".join(["python"] + sys.argv),
        "device": describe_devices(devices),
        "host_cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "numpy": np.__version__,
        "config": config,
        "results": [],
    }


def save_record(record: dict, path: str) -> None:
    """Writes a benchmark record as JSON (after every row, so a long run keeps what it measured)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
