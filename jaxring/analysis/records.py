"""Benchmark result files: a header naming what ran, where, when, at which commit and with which versions, then
the measured rows.

record = benchmark_record("ring_attention", devices, {"seq_len": 4096})
record["results"].append({...}); save_record(record, "benchmarks/results/ring_attention.json")

Every save stamps the record with the date (UTC) and the commit of the code that measured it (`git rev-parse`;
"-dirty" when tracked files differ; JAXRING_COMMIT when the code runs from a copy without git, as on the lent
GPU machines).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
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


def code_commit() -> str:
    """The commit of the code that runs (12 hex digits, "-dirty" when tracked files differ), JAXRING_COMMIT when
    set, else "unknown (not a git checkout)"."""
    if os.environ.get("JAXRING_COMMIT"):
        return os.environ["JAXRING_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
    except OSError:
        return "unknown (not a git checkout)"
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def stamp(record: dict) -> dict:
    """The record with its date (UTC, ISO 8601) and the code's commit set (see `code_commit`)."""
    record["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    record["commit"] = code_commit()
    return record


def save_record(record: dict, path: str) -> None:
    """Writes a benchmark record as JSON, stamped (`stamp`), after every row, so a long run keeps what it
    measured."""
    stamp(record)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1, default=str)  # a typed setting (Offload) as its text form
